"""``chunk_kda``: Kimi Delta Attention with fla's signature, on the GDN-2 operator.

KDA (Kimi Linear) has a decay per key channel and one scalar ``beta`` per head and token::

    S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_(t-1) + beta_t k_t v_t^T,   o_t = scale S_t^T q_t

which is GDN-2 with ``b = w = beta`` (docs/operator.md, section KDA).
"""

from __future__ import annotations

from typing import Any

import jax
from jaxtyping import Array, Float

from gdn2core.ops.family.convert import convert, finish
from gdn2core.ops.forward.api import gdn2_forward_trainable


def chunk_kda(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T HV dv"],
    g: Float[Array, "B T Hg dk"],
    beta: Float[Array, "B T Hg"],
    scale: float | None = None,
    initial_state: Float[Array, "N HV dk dv"] | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: Any = None,
    **kwargs: Any,
) -> tuple[jax.Array, jax.Array | None]:
    """Kimi Delta Attention, fla's ``chunk_kda`` (same arguments, defaults and return), on any
    GDN-2 backend; differentiable in every array input, ``A_log`` and ``dt_bias`` included.

    Args:
        q, k: ``(B, T, H, dk)``.
        v: ``(B, T, HV, dv)``; ``HV`` a multiple of ``H`` (grouped value heads: value head ``j``
            reads key head ``j // (HV / H)``).
        g: ``(B, T, Hg, dk)`` log decay (``Hg`` = H or HV), or the raw gate with
            ``use_gate_in_kernel``.
        beta: ``(B, T, Hg)``; raw with ``use_beta_sigmoid_in_kernel``.
        scale: query scale; ``dk ** -0.5`` when None.
        initial_state: ``(B, HV, dk, dv)`` (``(N, ...)`` with ``cu_seqlens``; ``(..., dv, dk)``
            with ``state_v_first``), or None (zeros).
        output_final_state: return the final state (else None in its place).
        use_qk_l2norm_in_kernel: L2-normalise q and k (eps 1e-6).
        use_gate_in_kernel: ``g = -exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound``
            ``g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``; ``A_log`` ``(Hg,)`` and
            ``dt_bias`` ``(Hg * dk,)`` (or ``(Hg, dk)``) by keyword.
        use_beta_sigmoid_in_kernel: ``beta = sigmoid(beta)``.
        allow_neg_eigval: ``beta = 2 * sigmoid(beta)`` (needs the previous one).
        safe_gate: fla's promise that every log decay is in ``[lower_bound, 0)``; needs
            ``lower_bound``. Results do not depend on it (the lower-bound gate takes pallas_tpu's
            merged-levels path whether or not it is set).
        lower_bound: the bound of the lower-bound gate, in ``[-5, 0)``.
        state_v_first: states as ``(..., dv, dk)``.
        cu_seqlens: ``(N + 1,)`` offsets of packed sequences (B = 1).
        **kwargs: ``A_log``, ``dt_bias``; fla's hints ``disable_recompute``, ``cu_seqlens_cpu``,
            ``chunk_indices``, ``chunk_size`` (no effect); our ``segment_ids``, ``backend``,
            ``config`` and mesh keywords (``mesh``, ``batch_axes``, ``head_axes``,
            ``context_axis``), as for :func:`gdn2core.gdn2_forward`.

    Returns:
        ``(o, final_state)``: o ``(B, T, HV, dv)`` in v's dtype; the final state float32, or
        None unless ``output_final_state``.

    Raises:
        ValueError, TypeError: fla's arguments misshaped or combined wrongly (the message names
            the argument), a refused fla keyword (``return_intermediate_states``,
            ``cp_context``, ...) or an unknown one; as :func:`gdn2core.gdn2_forward` otherwise.
    """
    call = convert(
        "chunk_kda", q, k, v, g, beta, scalar_gate=False, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate, lower_bound=lower_bound, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, kwargs=kwargs,
    )  # fmt: skip
    o, h = gdn2_forward_trainable(*call.args, h0=call.h0, **call.keywords)
    return finish(call, o, h)
