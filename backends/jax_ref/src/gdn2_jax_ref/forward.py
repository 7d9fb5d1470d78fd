"""The chunkwise forward (docs/algorithm.md section 4).

One ``lax.scan`` over groups of G chunks (see :mod:`gdn2_jax_ref.chunk`) carries the float32 (or
float64) state. Per group: Phase A (F1-F6) for all G chunks at once, then F7 and F9 as an inner
``lax.scan`` over the G chunks (the only sequential work: two matmuls per chunk), then F8 for the
G chunks at once.

``gdn2_chunk_forward`` is the inference entry; with ``keep_states=True`` it also returns the
group-entry states ``[n_groups, B, H, K, V]`` (the entry states of every G-th chunk), the only
non-input residual of the custom VJP; the backward recomputes the other chunk-entry states.
``gdn2_chunk_forward_chunk_states`` returns every chunk-entry state (``return_chunk_states``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from gdn2_jax_ref.chunk import Blocking, load_group, pad_time, store_group
from gdn2_jax_ref.local import ChunkLocal, chunk_local
from gdn2_jax_ref.params import ChunkParams, einsum
from gdn2core.diagnostics import probe


def plan_blocking(q: Float[Array, "B T H K"], v: Float[Array, "B T H V"], params: ChunkParams):
    """The group plan of one call (shared by forward and backward, so their groups agree)."""
    bsz, seq, heads, K = q.shape
    row_bytes = bsz * heads * max(K, v.shape[-1]) * params.acc_dtype.itemsize
    return Blocking.plan(seq, params.bt, row_bytes)


def state_pass(
    L: ChunkLocal, S0: Float[Array, "B H K V"], scale: float
) -> tuple[Float[Array, "G B H C V"], Float[Array, "B H K V"], Float[Array, "G B H K V"]]:
    """Phase B for the chunks of one group. Returns ``(o, S_out, S)``: S the chunk-entry states.

    Only F7 and F9 are sequential (two matmuls per chunk, :func:`entry_states`); F8,
    O = scale (Q_tilde S + A_qk R), then runs for the G chunks at once.
    """
    S, R, S_out = entry_states(L, S0)  # [G, B, H, K, V], [G, B, H, C, V], [B, H, K, V]
    o = scale * (
        einsum("...ck,...kv->...cv", L.Q_tilde, S) + einsum("...cs,...sv->...cv", L.A_qk, R)
    )  # F8 [G, B, H, C, V]
    return o, S_out, S


def entry_states(
    L: ChunkLocal, S0: Float[Array, "B H K V"]
) -> tuple[Float[Array, "G B H K V"], Float[Array, "G B H C V"], Float[Array, "B H K V"]]:
    """The sequential part, F7 and F9, over the chunks of one group entered with state ``S0``.
    Returns the chunk-entry states, the residual writes R and the state leaving the group."""

    def step(S, xs):  # S: [B, H, K, V]
        Y, U, K_tilde, decay_C = xs  # [B, H, C, *] / [B, H, K]
        R = U - einsum("bhck,bhkv->bhcv", Y, S)  # F7 [B, H, C, V]
        S_next = decay_C[..., None] * S + einsum("bhck,bhcv->bhkv", K_tilde, R)  # F9 [B, H, K, V]
        return S_next, (S, R)

    S_out, (S, R) = lax.scan(step, S0, (L.Y, L.U, L.K_tilde, L.decay_C))
    return S, R, S_out  # [G, B, H, K, V], [G, B, H, C, V], [B, H, K, V]


def gdn2_chunk_forward(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    w: Float[Array, "B T H V"],
    b: Float[Array, "B T H K"],
    g: Float[Array, "B T H K"],
    h0: Float[Array, "B H K V"],
    params: ChunkParams,
    keep_states: bool = False,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B H K V"], Float[Array, "n B H K V"] | None]:
    """Chunkwise GDN-2 forward. Returns ``(o, h_final, states)``: o in v's dtype, h_final and the
    group-entry states (None unless ``keep_states``) in the accumulation dtype."""
    o, h_final, states, _ = _chunk_forward(q, k, v, w, b, g, h0, params, keep_states, False)
    return o, h_final, states


def gdn2_chunk_forward_chunk_states(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    w: Float[Array, "B T H V"],
    b: Float[Array, "B T H K"],
    g: Float[Array, "B T H K"],
    h0: Float[Array, "B H K V"],
    params: ChunkParams,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B H K V"], Float[Array, "B NC H K V"]]:
    """The forward that also returns the state entering every chunk (prefix caching):
    ``(o, h_final, chunk_states)``, chunk_states ``[B, ceil(T / C), H, K, V]`` in the
    accumulation dtype, entry ``i`` the state after the first ``i C`` tokens."""
    o, h_final, _, chunks = _chunk_forward(q, k, v, w, b, g, h0, params, False, True)
    n_chunks = max(1, -(-q.shape[1] // params.bt))
    chunks = chunks.reshape(-1, *chunks.shape[2:])[:n_chunks]  # [NC, B, H, K, V]
    return o, h_final, jnp.swapaxes(chunks, 0, 1)


def _chunk_forward(q, k, v, w, b, g, h0, params: ChunkParams, keep_states: bool, chunks: bool):
    """``(o, h_final, group-entry states | None, chunk-entry states [n, G, B, H, K, V] | None)``."""
    acc = params.acc_dtype
    bsz, seq, heads, _ = q.shape
    blk = plan_blocking(q, v, params)
    inputs = tuple(pad_time(x, blk) for x in (q, k, v, w, b, g))  # [B, Tp, H, d]
    o_buf = jnp.zeros((bsz, blk.padded_len, heads, v.shape[-1]), v.dtype)  # [B, Tp, H, V]

    def group_step(carry, i):
        S, o_buf = carry  # [B, H, K, V], [B, Tp, H, V]
        chunks = [load_group(x, i, blk, acc) for x in inputs]  # [G, B, H, C, d]
        L = chunk_local(*chunks, params=params)
        o, S_next, S_chunks = state_pass(L, S, params.scale)
        kept = (S if keep_states else None, S_chunks if chunks else None)
        return (S_next, store_group(o_buf, o, i, blk)), kept

    carry0 = (h0.astype(acc), o_buf)
    (h_final, o_buf), (states, chunk_states) = lax.scan(
        group_step, carry0, jnp.arange(blk.n_groups)
    )
    o = probe("jax_ref o", o_buf[:, :seq])  # [B, T, H, V]
    h_final = probe("jax_ref h_final", h_final)  # [B, H, K, V]
    return o, h_final, states, chunk_states
