"""The blocked WY inverse T = ((1 + wy_eps) I + A_kk)^-1 (docs/algorithm.md F5, 5.3).

A_kk is strictly lower triangular, so M = (1 + wy_eps) I + A_kk is lower triangular with a
constant diagonal and never singular; wy_eps acts only on that diagonal (0 is exact).

- Diagonal mb x mb blocks by row recursion, t_r = (e_r - sum_{s<r} A_rs t_s) / (1 + wy_eps),
  vectorised over every chunk and every diagonal block at once (mb small steps).
- Off-diagonal blocks by the block identity T_IJ = -T_II sum_{J<=L<I} A_IL T_LJ, one block row at
  a time: all matmuls.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from gdn2_jax_ref.params import einsum


def _diag_block_inverse(
    A_blk: Float[Array, "... nb mb mb"], wy_eps: float
) -> Float[Array, "... nb mb mb"]:
    """Inverse of (1 + wy_eps) I + A_blk for strictly lower A_blk, by row recursion."""
    mb = A_blk.shape[-1]
    eye = jnp.eye(mb, dtype=A_blk.dtype)  # [mb, mb]
    inv_d = 1.0 / (1.0 + wy_eps)

    def row(r, T_blk):  # T_blk: [..., nb, mb, mb]; rows >= r are still zero
        a_r = lax.dynamic_index_in_dim(A_blk, r, axis=-2, keepdims=False)  # [..., nb, mb]
        acc = einsum("...s,...st->...t", a_r, T_blk)  # [..., nb, mb]
        t_r = (lax.dynamic_index_in_dim(eye, r, axis=0, keepdims=False) - acc) * inv_d
        return lax.dynamic_update_index_in_dim(T_blk, t_r, r, axis=T_blk.ndim - 2)

    return lax.fori_loop(0, mb, row, jnp.zeros_like(A_blk))  # [..., nb, mb, mb]


def wy_inverse(A_kk: Float[Array, "... C C"], mb: int, wy_eps: float) -> Float[Array, "... C C"]:
    """T = ((1 + wy_eps) I + A_kk)^-1 for strictly lower-triangular A_kk (lower triangular T)."""
    C = A_kk.shape[-1]
    if C % mb:
        raise ValueError(f"chunk length {C} is not a multiple of the WY micro-block {mb}")
    nb = C // mb
    sl = [slice(i * mb, (i + 1) * mb) for i in range(nb)]
    A_diag = jnp.stack([A_kk[..., s, s] for s in sl], axis=-3)  # [..., nb, mb, mb]
    T_diag = _diag_block_inverse(A_diag, wy_eps)  # [..., nb, mb, mb]
    lead = A_kk.shape[:-2]
    T = T_diag[..., 0, :, :]  # [..., mb, mb]: the leading I*mb x I*mb block of T, grown below
    for i in range(1, nb):
        w = i * mb
        acc = einsum("...rl,...lj->...rj", A_kk[..., sl[i], :w], T)  # [..., mb, w]
        T_off = -einsum("...rs,...sj->...rj", T_diag[..., i, :, :], acc)  # [..., mb, w]
        top = jnp.concatenate([T, jnp.zeros((*lead, w, mb), T.dtype)], axis=-1)  # [..., w, w+mb]
        bottom = jnp.concatenate([T_off, T_diag[..., i, :, :]], axis=-1)  # [..., mb, w+mb]
        T = jnp.concatenate([top, bottom], axis=-2)  # [..., w+mb, w+mb]
    return T  # [..., C, C]
