"""GDN-2 as a ``jax.lax.associative_scan`` over per-token affine maps (the "OLD" baseline).

Each token is the affine map ``S -> A_t S + B_t`` with::

    A_t = (I - k_t (b_t * k_t)^T) diag(exp(g_t))      [dk, dk]
    B_t = k_t (w_t * v_t)^T                           [dk, dv]

Maps compose as ``(A2, B2) o (A1, B1) = (A2 A1, A2 B1 + B2)``, which is associative, so all prefix
maps come from one parallel scan; the prefix states are ``S_t = A_{1..t} h0 + B_{1..t}`` and the
outputs ``o_t = scale * S_t^T q_t``. Gradients are JAX autodiff of this program.

It shares no derivation with the chunked WY backends, which makes it an independent check; its
memory grows as ``T * dk * (dk + dv)`` per (batch, head), which makes it slow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn2core.plugin import state_dtype

# Peak temporary bytes of the jitted value_and_grad in units of one [B, H, T, dk, dk + dv] float32
# buffer: the per-token maps, the scan's sweep partials, the prefix states and their cotangents.
# memory_analysis() on CPU gave 9.2 to 10.8 units for (T, dk, dv) from (128, 64, 8) to
# (256, 16, 128) and (1024, 64, 64);
# tests/scan_baseline/test_memory_model.py checks that this bound holds.
PEAK_BUFFERS_TRAIN = 12


def _compose(earlier, later):
    """(A2, B2) o (A1, B1) for stacked maps; ``earlier`` applies first."""
    A1, B1 = earlier
    A2, B2 = later
    return A2 @ A1, A2 @ B1 + B2  # [..., dk, dk], [..., dk, dv]


def gdn2_associative_scan(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T H dv"],
    w: Float[Array, "B T H dv"],
    b: Float[Array, "B T H dk"],
    g: Float[Array, "B T H dk"],
    h0: Float[Array, "B H dk dv"],
    scale: float,
) -> tuple[Float[Array, "B T H dv"], Float[Array, "B H dk dv"]]:
    acc = state_dtype(q.dtype)
    # [B, H, T, d] in the accumulation dtype
    qf, kf, vf, wf, bf, gf = (jnp.swapaxes(x, 1, 2).astype(acc) for x in (q, k, v, w, b, g))
    dk = kf.shape[-1]
    eye = jnp.eye(dk, dtype=acc)  # [dk, dk]
    erase = eye - kf[..., :, None] * (bf * kf)[..., None, :]  # [B, H, T, dk, dk]
    A = erase * jnp.exp(gf)[..., None, :]  # (I - k e^T) diag(exp g)   [B, H, T, dk, dk]
    Bm = kf[..., :, None] * (wf * vf)[..., None, :]  # k z^T          [B, H, T, dk, dv]
    A_pre, B_pre = jax.lax.associative_scan(_compose, (A, Bm), axis=2)  # prefix maps
    S = A_pre @ h0.astype(acc)[:, :, None] + B_pre  # [B, H, T, dk, dv]
    o = scale * jnp.einsum("bhtkv,bhtk->bhtv", S, qf)  # [B, H, T, dv]
    return jnp.swapaxes(o, 1, 2).astype(v.dtype), S[:, :, -1].astype(h0.dtype)
