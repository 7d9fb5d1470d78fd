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
from jaxtyping import Array, Bool, Float, Int

from gdn2_jax_ref.chunk import Blocking, PlainRows
from gdn2_jax_ref.local import ChunkLocal, chunk_local
from gdn2_jax_ref.params import ChunkParams, einsum
from gdn2_jax_ref.segments import RowSegments
from gdn2_jax_ref.varlen import (
    SeqStates,
    VarlenLayout,
    VarlenRows,
    enter,
    record,
    varlen_length,
)
from gdn2core.diagnostics import probe


def plan_rows(
    q: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    params: ChunkParams,
    cu_seqlens: Int[Array, " N1"] | None = None,
    continues: Bool[Array, " N"] | None = None,
) -> tuple[Blocking, PlainRows | VarlenRows, VarlenLayout | None]:
    """The group plan of one call and its group I/O (shared by forward and backward, so their
    groups agree). With ``cu_seqlens`` the chunks cover the static length of
    :func:`gdn2_jax_ref.varlen.varlen_length` and read their windows of the row."""
    _, seq, heads, K = q.shape
    row_bytes = q.shape[0] * heads * max(K, v.shape[-1]) * params.acc_dtype.itemsize
    if cu_seqlens is None:
        blk = Blocking.plan(seq, params.bt, row_bytes)
        return blk, PlainRows(blk), None
    length = varlen_length(seq, cu_seqlens.shape[0] - 1, params.bt)  # static
    blk = Blocking.plan(length, params.bt, row_bytes)
    layout = VarlenLayout.build(cu_seqlens, seq, params.bt, blk.n_chunks, continues)
    return blk, VarlenRows(layout, blk), layout


def state_pass(
    L: ChunkLocal,
    S0: Float[Array, "B H K V"],
    scale: float,
    seqs: SeqStates | None = None,
    h_final: Float[Array, "N H K V"] | None = None,
) -> tuple[
    Float[Array, "G B H C V"],
    Float[Array, "B H K V"],
    Float[Array, "N H K V"] | None,
    Float[Array, "G B H K V"],
]:
    """Phase B for the chunks of one group. Returns ``(o, S_out, h_final, S)``: S the chunk-entry
    states.

    Only F7 and F9 are sequential (two matmuls per chunk, :func:`entry_states`); F8,
    O = scale (Q_tilde S + A_qk R), then runs for the G chunks at once.
    """
    S, R, S_out, h_final = entry_states(L, S0, seqs, h_final)  # [G, B, H, K, V], [G, B, H, C, V]
    o = scale * (
        einsum("...ck,...kv->...cv", L.Q_tilde, S) + einsum("...cs,...sv->...cv", L.A_qk, R)
    )  # F8 [G, B, H, C, V]
    return o, S_out, h_final, S


def entry_states(
    L: ChunkLocal,
    S0: Float[Array, "B H K V"],
    seqs: SeqStates | None = None,
    h_final: Float[Array, "N H K V"] | None = None,
) -> tuple[
    Float[Array, "G B H K V"],
    Float[Array, "G B H C V"],
    Float[Array, "B H K V"],
    Float[Array, "N H K V"] | None,
]:
    """The sequential part, F7 and F9, over the chunks of one group entered with state ``S0``.
    Returns the chunk-entry states, the residual writes R, the state leaving the group and
    ``h_final``. With ``seqs`` (cu_seqlens) a sequence's first chunk is entered with its h0, and,
    given the buffer ``h_final``, the state leaving its last chunk is recorded there."""

    def step(carry, xs):  # S: [B, H, K, V]
        S, hf = carry
        Y, U, K_tilde, decay_C, rs = xs  # [B, H, C, *] / [B, H, K] / per-chunk scalars
        if rs is not None:
            S = enter(seqs.h0, S, rs.first, rs.seq)  # [B=1, H, K, V]
        R = U - einsum("bhck,bhkv->bhcv", Y, S)  # F7 [B, H, C, V]
        S_next = decay_C[..., None] * S + einsum("bhck,bhcv->bhkv", K_tilde, R)  # F9 [B, H, K, V]
        if hf is not None:
            hf = record(hf, S_next, rs.last, rs.seq)  # [N, H, K, V]
        return (S_next, hf), (S, R)

    rs = None if seqs is None else seqs.resets
    xs = (L.Y, L.U, L.K_tilde, L.decay_C, rs)
    (S_out, h_final), (S, R) = lax.scan(step, (S0, h_final), xs)
    return S, R, S_out, h_final  # [G, B, H, K, V], [G, B, H, C, V], [B, H, K, V], [N, H, K, V]


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
    segment_ids: Int[Array, "B T"] | None = None,
    cu_seqlens: Int[Array, " N1"] | None = None,
    continues: Bool[Array, " N"] | None = None,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B H K V"], Float[Array, "n B H K V"] | None]:
    """Chunkwise GDN-2 forward. Returns ``(o, h_final, states)``: o in v's dtype, h_final and the
    group-entry states (None unless ``keep_states``) in the accumulation dtype.

    Packed sequences: ``segment_ids`` (:mod:`gdn2_jax_ref.segments`): h0 enters each row's first
    sequence and h_final leaves its last; or ``cu_seqlens`` (:mod:`gdn2_jax_ref.varlen`, B = 1):
    h0 and h_final are per sequence, ``(N, H, K, V)``; with ``continues`` too, sequence ``n``
    starts from the state the one before it left where ``continues[n]`` (its h0 unread).
    """
    o, h_final, states, _ = _chunk_forward(
        q, k, v, w, b, g, h0, params, keep_states, False, segment_ids, cu_seqlens, continues
    )
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
    accumulation dtype, entry ``i`` the state after the first ``i C`` tokens (no entry for
    T = 0: there is no chunk). No packed sequences (the core refuses them with chunk states)."""
    o, h_final, _, chunks = _chunk_forward(q, k, v, w, b, g, h0, params, False, True)
    n_chunks = -(-q.shape[1] // params.bt)  # ceil(T / C): none for T = 0 (docs/operator.md)
    chunks = chunks.reshape(-1, *chunks.shape[2:])[:n_chunks]  # [NC, B, H, K, V]
    return o, h_final, jnp.swapaxes(chunks, 0, 1)


def _chunk_forward(
    q, k, v, w, b, g, h0, params: ChunkParams, keep_states: bool, keep_chunks: bool,
    segment_ids=None, cu_seqlens=None, continues=None,
):  # fmt: skip
    """``(o, h_final, group-entry states | None, chunk-entry states [n, G, B, H, K, V] | None)``
    (see :func:`gdn2_chunk_forward`)."""
    acc = params.acc_dtype
    bsz, seq, heads, _ = q.shape
    blk, io, varlen = plan_rows(q, v, params, cu_seqlens, continues)
    rows = None if segment_ids is None else RowSegments.build(segment_ids, blk)
    h0 = h0.astype(acc)  # [B, H, K, V] or, with cu_seqlens, [N, H, K, V]
    hf0 = None
    if varlen is not None:  # the scan's own carry starts at zero; h0[n] enters at chunk level
        h0, hf0 = jnp.zeros((bsz, *h0.shape[1:]), acc), h0  # empty sequences keep h0
    inputs = tuple(io.pad(x) for x in (q, k, v, w, b, g))  # [B, Tp, H, d]
    o_buf = jnp.zeros((*inputs[2].shape[:-1], v.shape[-1]), v.dtype)  # [B, Tp, H, V]

    def group_work(S, hf, i):
        chunks = [io.load(x, i, acc) for x in inputs]  # [G, B, H, C, d]
        seg = None if rows is None else rows.load_group(i, blk)  # [G, B, 1, C, 1]
        L = chunk_local(*chunks, params=params, seg=seg)
        seqs = None if varlen is None else SeqStates(varlen.group(i, blk.group), hf0)
        return state_pass(L, S, params.scale, seqs, hf)  # o [G, B, H, C, V], S_next, hf, S

    def group_skip(S, hf, i):  # zero tokens only: no output, the state unchanged
        o = jnp.zeros((blk.group, bsz, heads, blk.bt, v.shape[-1]), acc)  # [G, B, H, C, V]
        return o, S, hf, jnp.broadcast_to(S, (blk.group, *S.shape))  # [G, B, H, K, V]

    def group_step(carry, i):
        S, o_buf, hf = carry  # [B, H, K, V], [B, Tp, H, V], [N, H, K, V] or None
        if varlen is None:
            o, S_next, hf, S_chunks = group_work(S, hf, i)
        else:
            used = varlen.group_used(i, blk.group)
            o, S_next, hf, S_chunks = lax.cond(used, group_work, group_skip, S, hf, i)
        kept = (S if keep_states else None, S_chunks if keep_chunks else None)
        return (S_next, io.store(o_buf, o, i), hf), kept

    carry0 = (h0, o_buf, hf0)
    (h_final, o_buf, hf), (states, chunk_states) = lax.scan(
        group_step, carry0, jnp.arange(blk.n_groups)
    )
    o = probe("jax_ref o", o_buf[:, :seq])  # [B, T, H, V]
    h_final = probe("jax_ref h_final", h_final if hf is None else hf)  # [B or N, H, K, V]
    return o, h_final, states, chunk_states
