"""``chunk_gated_delta_rule``: Gated DeltaNet with fla's signature, on the GDN-2 operator.

GDN (Qwen3-Next, Qwen3.5) has one scalar decay and one scalar ``beta`` per head and token::

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_(t-1) + beta_t k_t v_t^T,   o_t = scale S_t^T q_t

which is GDN-2 with ``b = w = beta`` and ``g`` the same on every key channel (docs/operator.md,
section GDN).
"""

from __future__ import annotations

from typing import Any

import jax
from jaxtyping import Array, Float

from gdn2core.ops.family.convert import convert, finish
from gdn2core.ops.forward.api import gdn2_forward_trainable


def chunk_gated_delta_rule(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T HV dv"],
    g: Float[Array, "B T Hg"],
    beta: Float[Array, "B T Hg"],
    scale: float | None = None,
    initial_state: Float[Array, "N HV dk dv"] | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Any = None,
    use_gate_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[jax.Array, jax.Array | None]:
    """Gated DeltaNet, fla's ``chunk_gated_delta_rule`` (same arguments, defaults and return), on
    any GDN-2 backend; differentiable in every array input, ``A_log`` and ``dt_bias`` included.

    Args:
        q, k: ``(B, T, H, dk)``.
        v: ``(B, T, HV, dv)``; ``HV`` a multiple of ``H`` (value head ``j`` reads key head
            ``j // (HV / H)``).
        g: ``(B, T, Hg)`` log decay per head (``Hg`` = H or HV), or the raw gate with
            ``use_gate_in_kernel``: ``g = -exp(A_log) * softplus(g + dt_bias)``, ``A_log`` and
            ``dt_bias`` ``(Hg,)`` by keyword.
        beta: ``(B, T, Hg)``; raw with ``use_beta_sigmoid_in_kernel``.
        scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens: as for
            :func:`gdn2core.chunk_kda`.
        **kwargs: as for :func:`gdn2core.chunk_kda`.

    Returns:
        ``(o, final_state)`` as for :func:`gdn2core.chunk_kda`.

    Raises:
        As :func:`gdn2core.chunk_kda`.
    """
    call = convert(
        "chunk_gated_delta_rule", q, k, v, g, beta, scalar_gate=True, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        safe_gate=False, lower_bound=None, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        kwargs=kwargs,
    )  # fmt: skip
    o, h = gdn2_forward_trainable(*call.args, h0=call.h0, **call.keywords)
    return finish(call, o, h)
