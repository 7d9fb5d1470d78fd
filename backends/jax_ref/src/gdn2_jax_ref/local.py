"""Phase A of the chunkwise forward (ALGORITHM.md F1-F6): everything that does not depend on the
chunk-entry state, for all chunks of a group at once. The backward recomputes it from the inputs.

Every decay factor formed here has a non-positive exponent (for g <= 0): exp(gamma_cum),
exp(gamma_C - gamma_cum) and exp(gamma_C); the scores go through :mod:`gdn2_jax_ref.scores`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn2_jax_ref.params import ChunkParams, einsum
from gdn2_jax_ref.scores import score
from gdn2_jax_ref.wy import wy_inverse
from gdn2core.diagnostics import probe


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["gamma_cum", "decay_C", "E", "E_bar", "Q_tilde", "K_tilde", "A_qk", "T", "Y", "U"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class ChunkLocal:
    """Chunk-local quantities, all in the accumulation dtype; ``...`` = ``N, B, H``."""

    gamma_cum: Float[Array, "... C K"]  # F1 inclusive chunk-local cumsum of g
    decay_C: Float[Array, "... K"]  # exp(gamma_C), the chunk carry
    E: Float[Array, "... C K"]  # F2 b * k
    E_bar: Float[Array, "... C K"]  # F3 exp(gamma_cum) * E
    Q_tilde: Float[Array, "... C K"]  # F3 exp(gamma_cum) * q
    K_tilde: Float[Array, "... C K"]  # F3 exp(gamma_C - gamma_cum) * k
    A_qk: Float[Array, "... C C"]  # F4 inclusive score (unscaled)
    T: Float[Array, "... C C"]  # F5 ((1 + wy_eps) I + A_kk)^-1
    Y: Float[Array, "... C K"]  # F6 T E_bar
    U: Float[Array, "... C V"]  # F6 T Z


def cumsum_rows(x: Float[Array, "... C K"], reverse: bool = False) -> Float[Array, "... C K"]:
    """Inclusive (or reverse inclusive) cumsum over the C axis, as a matmul with a triangle of
    ones (faster on CPU than XLA's reduce-window cumsum; the same number of additions per row)."""
    C = x.shape[-2]
    ones = jnp.tril(jnp.ones((C, C), x.dtype))  # [C(r), C(s)]: s <= r
    if reverse:
        ones = ones.T  # s >= r
    return einsum("rs,...sk->...rk", ones, x)  # [..., C, K]


def chunk_local(
    q: Float[Array, "... C K"],
    k: Float[Array, "... C K"],
    v: Float[Array, "... C V"],
    w: Float[Array, "... C V"],
    b: Float[Array, "... C K"],
    g: Float[Array, "... C K"],
    params: ChunkParams,
) -> ChunkLocal:
    """F1-F6 for every chunk (inputs already chunked and in the accumulation dtype)."""
    gamma_cum = probe("jax_ref gamma_cum", cumsum_rows(g))  # [..., C, K]
    gamma_C = gamma_cum[..., -1, :]  # [..., K]
    E = b * k  # [..., C, K]
    Z = w * v  # [..., C, V]
    e_gamma = jnp.exp(gamma_cum)  # [..., C, K] <= 1
    E_bar = e_gamma * E  # [..., C, K]
    Q_tilde = e_gamma * q  # [..., C, K]
    K_tilde = jnp.exp(gamma_C[..., None, :] - gamma_cum) * k  # [..., C, K]
    decay_C = jnp.exp(gamma_C)  # [..., K]
    # F4: both scores share K and gamma_cum, so they run as one stacked (inclusive) Score; A_kk
    # then drops its diagonal (masking after the fact is exact: the diagonal terms are finite).
    A_both = score(jnp.stack([E, q]), k, gamma_cum, params.bc, params.clip, strict=False)
    A_kk = probe("jax_ref A_kk", jnp.tril(A_both[0], -1))  # [..., C, C] strictly lower
    A_qk = probe("jax_ref A_qk", A_both[1])  # [..., C, C] lower incl. diagonal
    T = probe("jax_ref T", wy_inverse(A_kk, params.mb, params.wy_eps))  # [..., C, C]
    Y = probe("jax_ref Y", einsum("...rs,...sk->...rk", T, E_bar))  # [..., C, K]
    U = probe("jax_ref U", einsum("...rs,...sv->...rv", T, Z))  # [..., C, V]
    return ChunkLocal(gamma_cum, decay_C, E, E_bar, Q_tilde, K_tilde, A_qk, T, Y, U)
