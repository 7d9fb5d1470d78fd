"""``fused_recurrent_kda`` and ``fused_recurrent_gated_delta_rule``: fla's recurrent (decoding)
entry points, on the GDN-2 decode op and, for long or packed rows, the chunked forward op.

fla keeps two kernels per layer: the chunked one (training, prefill) and a fused recurrent one
that walks the tokens one by one (decoding: a few tokens per sequence against a cached state).
Both compute the same recurrence; only their cost differs. Here the recurrent form runs

- the decode op (:func:`gdn2core.gdn2_decode`) when each row has at most
  :data:`DECODE_MAX_TOKENS` tokens (one default chunk) and there are no packed sequences: it walks
  the tokens without padding them to a chunk; ``initial_state`` is its pool, one slot per
  sequence, or, with our keyword ``state_indices``, a pool of any size whose named slots the call
  advances (continuous batching; every other slot is returned bit for bit);
- the chunked forward op (:func:`gdn2core.gdn2_forward`) otherwise (longer rows, ``cu_seqlens``,
  ``segment_ids``, the mesh keywords).

As fla's, these are forward only (fla's backward raises); train with ``chunk_kda`` /
``chunk_gated_delta_rule``.

fla's ``fused_recurrent_gated_delta_rule`` takes its decays as ``g`` (one per value head and
token), ``gk`` (per key channel) or both (``exp(g) * exp(gk)``: the log decays add); ``gv`` (a
decay per value channel) and a ``beta`` per value channel (``(B, T, HV, dv)``, fla's "headwise"
beta) scale the state's columns, which the GDN-2 recurrence (gates on the key channels) does not
express: both are refused, naming the argument.
"""

from __future__ import annotations

from typing import Any, Final

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn2core.checks import expect_shape
from gdn2core.features.activations import per_channel_dt_bias
from gdn2core.ops.decode.api import gdn2_decode
from gdn2core.ops.family.convert import FamilyCall, convert, finish
from gdn2core.ops.forward.api import gdn2_forward

#: Rows of at most this many tokens run on the decode op (the default chunk: a longer row fills
#: whole chunks, where the chunked op's products pay off).
DECODE_MAX_TOKENS: Final = 64
#: Keywords of the GDN-2 call that the decode op takes (the rest need the chunked op).
_DECODE_KEYWORDS: Final = frozenset(
    {"scale", "backend", "config", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "A_log",
     "dt_bias", "lower_bound"}
)  # fmt: skip


def _state_indices(op: str, kwargs: dict[str, Any]):
    """Our ``state_indices`` out of ``kwargs``; vLLM's keywords refused, naming ours."""
    if "ssm_state_indices" in kwargs:
        raise TypeError(f"{op}: ssm_state_indices is vLLM's keyword; pass state_indices= (the "
                        f"slots of the pool initial_state) with output_final_state=True")  # fmt: skip
    if "num_accepted_tokens" in kwargs:
        raise TypeError(f"{op}: num_accepted_tokens (vLLM's speculative decoding) is not "
                        f"supported; gdn2_decode(..., return_token_states=True) returns the state "
                        f"after every token to roll back to")  # fmt: skip
    return kwargs.pop("state_indices", None)


def _run(op: str, call: FamilyCall, state_indices) -> tuple[jax.Array, jax.Array | None]:
    """The converted call on the decode op or the chunked forward op (module docstring)."""
    q, k, v, w, b, g = call.args
    B, T, _, dk = q.shape
    HV, dv = v.shape[2], v.shape[3]
    on_decode = set(call.keywords) <= _DECODE_KEYWORDS and T <= DECODE_MAX_TOKENS
    if state_indices is not None and not on_decode:
        raise ValueError(
            f"state_indices: a state pool needs the decode op: at most {DECODE_MAX_TOKENS} tokens "
            f"per sequence and none of cu_seqlens, segment_ids or the mesh keywords, got T={T} "
            f"and {sorted(set(call.keywords) - _DECODE_KEYWORDS)}"
        )
    if not on_decode:
        o, h = gdn2_forward(q, k, v, w, b, g, h0=call.h0, **call.keywords)
        return finish(call, o, h)
    if state_indices is not None and (call.h0 is None or not call.output_final_state):
        raise ValueError(
            f"{op}: state_indices names slots of a pool: expected initial_state (the pool) and "
            f"output_final_state=True (the advanced pool), got initial_state="
            f"{'None' if call.h0 is None else 'an array'} and "
            f"output_final_state={call.output_final_state}"
        )
    if call.h0 is None:
        pool = jnp.zeros((B, HV, dk, dv), jnp.float32)
    elif state_indices is None:  # fla: the state enters and leaves in float32
        expect_shape("initial_state", call.h0.shape, (B, HV, dk, dv), "(B, HV, dk, dv)")
        pool = call.h0.astype(jnp.float32)
    else:
        pool = call.h0
    keywords = dict(call.keywords)  # the decode op takes dt_bias per channel
    if keywords.get("dt_bias") is not None:
        keywords["dt_bias"] = per_channel_dt_bias(keywords["dt_bias"], dk)
    o, h = gdn2_decode(q, k, v, w, b, g, pool, state_indices=state_indices, **keywords)
    return finish(call, o, h)


def fused_recurrent_kda(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T HV dv"],
    g: Float[Array, "B T Hg dk"],
    beta: Float[Array, "B T Hg"],
    A_log: Float[Array, " Hg"] | None = None,
    dt_bias: Float[Array, " Hgdk"] | None = None,
    scale: float | None = None,
    initial_state: Float[Array, "N HV dk dv"] | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: Any = None,
    **kwargs: Any,
) -> tuple[jax.Array, jax.Array | None]:
    """Kimi Delta Attention, fla's ``fused_recurrent_kda`` (same arguments, defaults and
    return), forward only, on the decode op or the chunked op (module docstring).

    Args:
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
            state_v_first, cu_seqlens: as for :func:`gdn2core.chunk_kda`.
        A_log, dt_bias: the gate parameters (fla passes them by position here): ``(Hg,)`` and
            ``(Hg * dk,)`` (or ``(Hg, dk)``), with ``use_gate_in_kernel``.
        **kwargs: our ``state_indices`` (``(N,)`` slots of the pool ``initial_state``
            ``(P, HV, dk, dv)``, with ``output_final_state=True``: the returned state is the pool,
            those slots advanced; float32 or bfloat16), ``backend``, ``config``, and the keywords
            of :func:`gdn2core.chunk_kda`.

    Returns:
        ``(o, final_state)``: o ``(B, T, HV, dv)`` in v's dtype; the final state float32 (the
        pool in its dtype with ``state_indices``), or None unless ``output_final_state``.

    Raises:
        ValueError, TypeError: as :func:`gdn2core.chunk_kda`; ``state_indices`` with long rows or
            packed sequences, or without a pool.
    """
    state_indices = _state_indices("fused_recurrent_kda", kwargs)
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x is not None:
            kwargs[name] = x
    call = convert(
        "fused_recurrent_kda", q, k, v, g, beta, scalar_gate=False, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        safe_gate=False, lower_bound=lower_bound, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, kwargs=kwargs,
    )  # fmt: skip
    return _run("fused_recurrent_kda", call, state_indices)


def fused_recurrent_gated_delta_rule(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T HV dv"],
    g: Float[Array, "B T Hg"] | None = None,
    gk: Float[Array, "B T Hg dk"] | None = None,
    gv: None = None,
    beta: Float[Array, "B T Hg"] | None = None,
    scale: float | None = None,
    initial_state: Float[Array, "N HV dk dv"] | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Any = None,
    **kwargs: Any,
) -> tuple[jax.Array, jax.Array | None]:
    """Gated DeltaNet, fla's ``fused_recurrent_gated_delta_rule`` (same arguments, defaults and
    return), forward only, on the decode op or the chunked op (module docstring).

    Args:
        q, k, v, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens:
            as for :func:`gdn2core.chunk_gated_delta_rule`.
        g: ``(B, T, Hg)`` log decay per head (``Hg`` = H or HV), or None.
        gk: ``(B, T, Hg, dk)`` log decay per key channel, or None; with ``g`` both apply. Neither:
            no decay.
        gv: refused (a decay per value channel; module docstring).
        beta: ``(B, T, Hg)``; None: ones.
        **kwargs: ``state_indices``, ``backend``, ``config`` and the rest as for
            :func:`fused_recurrent_kda`.

    Returns:
        ``(o, final_state)`` as :func:`fused_recurrent_kda`.

    Raises:
        ValueError, TypeError: as :func:`fused_recurrent_kda`; ``gv`` given, a ``beta`` per value
            channel, ``gk`` misshaped.
    """
    op = "fused_recurrent_gated_delta_rule"
    if gv is not None:
        raise ValueError(
            f"gv: a decay per value channel is not in the GDN-2 recurrence (its gates act on the "
            f"key channels), got an array of shape {tuple(getattr(gv, 'shape', ()))}; use gk"
        )
    if beta is not None and getattr(beta, "ndim", 3) == 4:
        raise ValueError(
            f"beta: expected shape (B, T, Hg), one value per head and token; a beta per value "
            f"channel (fla's headwise beta) is not in the GDN-2 recurrence, got "
            f"{tuple(beta.shape)}"
        )
    B, T = q.shape[:2]
    ref = beta if beta is not None else g
    if ref is None and gk is not None:
        ref = gk[..., 0]
    heads = v.shape[2] if ref is None else ref.shape[2]
    if beta is None:
        beta = jnp.ones((B, T, heads), q.dtype)
    state_indices = _state_indices(op, kwargs)
    common = dict(
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
        lower_bound=None, state_v_first=False, cu_seqlens=cu_seqlens, kwargs=kwargs,
    )  # fmt: skip
    if gk is None:
        decay = jnp.zeros((B, T, heads), q.dtype) if g is None else g  # [B, T, Hg]
        call = convert(op, q, k, v, decay, beta, scalar_gate=True, **common)
    else:
        expect_shape("gk", gk.shape, (B, T, heads, q.shape[3]), "(B, T, Hg, dk) as beta")
        if g is not None:
            expect_shape("g", g.shape, (B, T, heads), "(B, T, Hg) as beta")
        decay = gk if g is None else gk + g[..., None]  # [B, T, Hg, dk] log decays add
        call = convert(op, q, k, v, decay, beta, scalar_gate=False, **common)
    return _run(op, call, state_indices)


__all__ = ["DECODE_MAX_TOKENS", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda"]
