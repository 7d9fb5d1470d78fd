"""fla's delta-rule arguments as a GDN-2 call.

KDA and GDN are GDN-2 with ``b = w = beta`` (and, for GDN, ``g`` the same on every key channel):
``S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_(t-1) + beta_t k_t v_t^T``. The GDN-2 call takes
beta as the scalar gates ``b`` ``(B, T, Hg)`` and ``w`` ``(B, T, HV)`` (and GDN's decay as a
scalar ``g``): a backend that declares ``Capabilities.scalar_gates`` reads them so, any other gets
them broadcast to their channels by the core (docs/operator.md, sections KDA and GDN; the
gradient of ``beta`` is the sum of those of ``b`` and ``w``, of a scalar ``g`` the sum over the
key channels).

fla's keywords keep fla's meaning: ``use_beta_sigmoid_in_kernel`` is ``beta = sigmoid(beta)``
and ``allow_neg_eigval`` doubles it (both the erase and the write: there is one beta), applied
here on the ``(B, T, Hg)`` beta; ``A_log``, ``dt_bias`` (``(Hg * dk,)`` as fla lays it out, or
``(Hg, dk)``; GDN's ``(Hg,)``), ``lower_bound`` and ``use_qk_l2norm_in_kernel`` go to the
operator's fused activations; ``state_v_first`` transposes the states in and out.

Dtypes: ``g`` in float32 beside bfloat16 q stays float32 (fla's layers compute the log decay in
float32 and its kernels keep it so; the GDN-2 call takes it as ``OpSpec.float32_decay``); any
other ``g`` and ``beta`` are cast to q's dtype (a deliberate difference for ``beta``: fla's
kernels read a float32 beta as it is, here it is rounded to bfloat16 in a bfloat16 call, as fla's
layers compute it). The gradients return in each argument's own dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from gdn2core.checks import expect_shape, is_float32_decay

#: fla keywords accepted without an effect on the result (performance and memory hints of fla's
#: kernels; ``safe_gate`` promises ``g >= lower_bound``, which the GDN-2 kernels do not need to be
#: exact, and ``cu_seqlens_cpu`` is fla's host copy of ``cu_seqlens``).
HINTS = ("disable_recompute", "cu_seqlens_cpu", "chunk_indices", "chunk_size")
#: fla keywords refused, with what to use instead.
REFUSED = {
    "return_intermediate_states": "gdn2_forward(..., return_chunk_states=True)",
    "cp_context": "the mesh keywords (mesh=, context_axis=)",
    "transpose_state_layout": "state_v_first",
    "head_first": "the (B, T, H, d) layout",
}
#: Our own keywords, passed to the GDN-2 op as they are.
OURS = ("segment_ids", "backend", "config", "mesh", "batch_axes", "head_axes", "context_axis")


@dataclasses.dataclass(frozen=True)
class FamilyCall:
    """One call of the family, converted: the GDN-2 arguments and keywords."""

    args: tuple[jax.Array, ...]  # q, k, v, w, b, g
    h0: jax.Array | None
    keywords: dict[str, Any]
    state_v_first: bool
    output_final_state: bool


def convert(op: str, q, k, v, g, beta, *, scalar_gate: bool, scale, initial_state,
            output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first,
            cu_seqlens, kwargs: dict[str, Any]) -> FamilyCall:  # fmt: skip
    """Check fla's arguments (errors name fla's arguments) and build the GDN-2 call.

    Args:
        op: ``"chunk_kda"`` or ``"chunk_gated_delta_rule"`` (for messages).
        q, k, v, g, beta: fla's arrays; ``g`` ``(B, T, Hg, dk)`` (KDA) or ``(B, T, Hg)`` (GDN,
            ``scalar_gate``), ``beta`` ``(B, T, Hg)``, ``Hg`` = H or HV.
        scalar_gate: GDN's one decay per head and token.
        the rest: fla's keywords; ``kwargs`` the others (``A_log``, ``dt_bias``, fla's hints,
            our own keywords).

    Returns:
        The :class:`FamilyCall`.

    Raises:
        ValueError, TypeError: an argument of the wrong shape, type or combination, or a
            keyword refused or unknown.
    """
    for name, use in REFUSED.items():
        if kwargs.get(name) not in (None, False):
            raise ValueError(f"{op}: {name} is not supported; use {use}")
    unknown = sorted(set(kwargs) - set(HINTS) - set(OURS) - {"A_log", "dt_bias"} - set(REFUSED))
    if unknown:
        raise TypeError(f"{op}: unexpected keyword argument(s) {unknown}")
    for name, flag in (("output_final_state", output_final_state), ("safe_gate", safe_gate),
                       ("state_v_first", state_v_first),
                       ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
                       ("allow_neg_eigval", allow_neg_eigval)):  # fmt: skip
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    if safe_gate and lower_bound is None:
        raise ValueError("safe_gate: expected lower_bound to be set (fla's safe range is "
                         "[lower_bound, 0)), got lower_bound=None")  # fmt: skip
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval: expected use_beta_sigmoid_in_kernel=True (it doubles "
                         "sigmoid(beta)), got use_beta_sigmoid_in_kernel=False")  # fmt: skip
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q, k: expected the same shape (B, T, H, dk), got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")  # fmt: skip
    B, T, H, dk = q.shape
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v: expected shape (B, T, HV, dv) with (B, T) = {(B, T)}, got "
                         f"{tuple(v.shape)}")  # fmt: skip
    HV = v.shape[2]
    Hg = beta.shape[2] if beta.ndim == 3 else None
    if Hg not in (H, HV):
        raise ValueError(f"beta: expected shape (B, T, Hg) with Hg = H = {H} or HV = {HV}, got "
                         f"{tuple(beta.shape)}")  # fmt: skip
    expect_shape("beta", beta.shape, (B, T, Hg), "(B, T, Hg)")
    if scalar_gate:
        expect_shape("g", g.shape, (B, T, Hg), "(B, T, Hg) as beta")
    else:
        expect_shape("g", g.shape, (B, T, Hg, dk), "(B, T, Hg, dk) as beta")

    keep = g.dtype == q.dtype or is_float32_decay(g.dtype, q.dtype)
    if jnp.issubdtype(g.dtype, jnp.floating) and not keep:
        g = g.astype(q.dtype)  # float32 g beside bf16 q stays float32 (OpSpec.float32_decay)
    if use_beta_sigmoid_in_kernel:  # on the scalar beta: one beta erases and writes
        acc = jnp.promote_types(beta.dtype, jnp.float32)  # the state dtype
        beta = jax.nn.sigmoid(beta.astype(acc)) * (2.0 if allow_neg_eigval else 1.0)
    b = beta.astype(q.dtype)  # [B, T, Hg] a scalar gate
    w = (b if Hg == HV else jnp.repeat(b, HV // H, axis=2)).astype(v.dtype)  # [B, T, HV]
    #   value head j: beta of j // G

    keywords: dict[str, Any] = {k_: kwargs[k_] for k_ in OURS if k_ in kwargs}
    keywords["use_qk_l2norm_in_kernel"] = use_qk_l2norm_in_kernel
    if cu_seqlens is not None:
        keywords["cu_seqlens"] = cu_seqlens
    A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    if use_gate_in_kernel:
        keywords.update(use_gate_in_kernel=True, A_log=A_log)
        if dt_bias is not None:
            if scalar_gate:  # GDN: one bias per head (the GDN-2 op takes it so with a scalar g)
                expect_shape("dt_bias", dt_bias.shape, (Hg,), "(Hg,)")
            elif dt_bias.ndim == 1:  # fla lays KDA's out flat, (Hg * dk,)
                expect_shape("dt_bias", dt_bias.shape, (Hg * dk,), "(Hg * dk,)")
                dt_bias = dt_bias.reshape(Hg, dk)
            keywords["dt_bias"] = dt_bias
        if lower_bound is not None:
            keywords["lower_bound"] = lower_bound
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log, dt_bias: expected only with use_gate_in_kernel=True, got "
                         "use_gate_in_kernel=False")  # fmt: skip
    h0 = initial_state
    if h0 is not None and state_v_first:
        h0 = jnp.swapaxes(h0, -1, -2)  # fla's [N, HV, dv, dk] -> [N, HV, dk, dv]
    if scale is not None:
        keywords["scale"] = scale
    return FamilyCall((q, k, v, w, b, g), h0, keywords, state_v_first, output_final_state)


def finish(call: FamilyCall, o: jax.Array, h: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """fla's return convention: ``(o, final_state)``, ``final_state`` None unless asked, in
    ``[N, HV, dv, dk]`` with ``state_v_first``."""
    if not call.output_final_state:
        return o, None
    return o, jnp.swapaxes(h, -1, -2) if call.state_v_first else h
