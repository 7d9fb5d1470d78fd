"""The token-serial reference: the ground truth every backend is tested against.

One ``lax.scan`` step per token, in the kernel form of ``docs/operator.md``::

    S'  = exp(g_t)[:, None] * S          # decay, key axis
    r   = S'^T (b_t * k_t)               # read at the erase-gated key        [dv]
    S_t = S' + k_t (w_t * v_t - r)^T     # rank-1 edit                         [dk, dv]
    o_t = scale * S_t^T q_t                                                    [dv]

The state is float32 whatever the input dtype (float64 when the inputs are float64), so a
bfloat16 call is computed in float32 from the bfloat16 values. Differentiable by autodiff in all
of q, k, v, w, b, g and h0. The contract is ``docs/operator.md``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn2core.spec import OpSpec


def state_dtype(dtype) -> jnp.dtype:
    """The precision of the state and of every accumulator for inputs of ``dtype``.

    Args:
        dtype: the input dtype.

    Returns:
        float64 for float64 inputs, else float32.
    """
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def gdn2_token_serial_reference(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T H dv"],
    w: Float[Array, "B T H dv"],
    b: Float[Array, "B T H dk"],
    g: Float[Array, "B T H dk"],
    scale: float | None = None,
    h0: Float[Array, "B H dk dv"] | None = None,
) -> tuple[Float[Array, "B T H dv"], Float[Array, "B H dk dv"]]:
    """Token-serial GDN-2: one ``lax.scan`` step per token (the ground truth).

    Args:
        q, k, b, g: ``(B, T, H, dk)``; v, w: ``(B, T, H, dv)``; one floating dtype.
        scale: the query scale (None: ``dk ** -0.5``).
        h0: the initial state ``(B, H, dk, dv)`` (None: zeros).

    Returns:
        ``(o, h_final)``: o in v's dtype, h_final float32 (float64 for float64 inputs).

    Raises:
        ValueError, TypeError: as :func:`gdn2core.gdn2_forward` for bad inputs.
    """
    spec = OpSpec.from_inputs(q, k, v, w, b, g, scale, h0)
    acc = state_dtype(q.dtype)
    if h0 is None:
        h0 = jnp.zeros((spec.batch, spec.heads, spec.dk, spec.dv), acc)

    # [T, B, H, d] in the accumulation dtype: the scan runs over the leading axis.
    xs = tuple(jnp.swapaxes(x, 0, 1).astype(acc) for x in (q, k, v, w, b, g))

    def step(S, x):  # S: [B, H, dk, dv] acc
        S_new, o = token_step(S, *x, spec.scale)
        return S_new, o

    h_final, o = jax.lax.scan(step, h0.astype(acc), xs)  # o: [T, B, H, dv]
    return jnp.swapaxes(o, 0, 1).astype(v.dtype), h_final


def token_step(S, qt, kt, vt, wt, bt, gt, scale: float):
    """One token of the recurrence, in the four lines of the module docstring.

    Args:
        S: the state ``[..., dk, dv]``.
        qt, kt, bt, gt: ``[..., dk]``; vt, wt: ``[..., dv]`` (the same leading axes as S).
        scale: the query scale.

    Returns:
        ``(S_t, o_t)``: ``[..., dk, dv]`` and ``[..., dv]``, in S's dtype.
    """
    S_dec = jnp.exp(gt)[..., None] * S  # [..., dk, dv]
    r = jnp.einsum("...kv,...k->...v", S_dec, bt * kt)  # [..., dv]
    S_new = S_dec + kt[..., None] * (wt * vt - r)[..., None, :]  # [..., dk, dv]
    o = scale * jnp.einsum("...kv,...k->...v", S_new, qt)  # [..., dv]
    return S_new, o
