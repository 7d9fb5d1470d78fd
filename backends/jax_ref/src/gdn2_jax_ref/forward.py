"""The chunkwise forward (docs/algorithm.md section 4).

One ``lax.scan`` over groups of G chunks (see :mod:`gdn2_jax_ref.chunk`) carries the float32 (or
float64) state. Per group: Phase A (F1-F6) for all G chunks at once, then F7 and F9 as an inner
``lax.scan`` over the G chunks (the only sequential work: two matmuls per chunk), then F8 for the
G chunks at once.

``gdn2_chunk_forward`` is the inference entry; with ``keep_states=True`` it also returns the
group-entry states ``[n_groups, B, H, K, V]`` (the entry states of every G-th chunk), the only
non-input residual of the custom VJP; the backward recomputes the other chunk-entry states.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from gdn2_jax_ref.chunk import Blocking, load_group, pad_time, store_group
from gdn2_jax_ref.local import ChunkLocal, chunk_local
from gdn2_jax_ref.params import ChunkParams, einsum
from gdn2_jax_ref.segments import RowSegments
from gdn2_jax_ref.varlen import SeqStates, VarlenLayout, enter, record, varlen_length
from gdn2core.diagnostics import probe


def plan_blocking(q: Float[Array, "B T H K"], v: Float[Array, "B T H V"], params: ChunkParams):
    """The group plan of one call (shared by forward and backward, so their groups agree)."""
    bsz, seq, heads, K = q.shape
    row_bytes = bsz * heads * max(K, v.shape[-1]) * params.acc_dtype.itemsize
    return Blocking.plan(seq, params.bt, row_bytes)


def state_pass(
    L: ChunkLocal,
    S0: Float[Array, "B H K V"],
    scale: float,
    seqs: SeqStates | None = None,
    h_final: Float[Array, "N H K V"] | None = None,
) -> tuple[Float[Array, "G B H C V"], Float[Array, "B H K V"], Float[Array, "N H K V"] | None]:
    """Phase B for the chunks of one group. Returns ``(o, S_out, h_final)``.

    Only F7 and F9 are sequential (two matmuls per chunk, :func:`entry_states`); F8,
    O = scale (Q_tilde S + A_qk R), then runs for the G chunks at once.
    """
    S, R, S_out, h_final = entry_states(L, S0, seqs, h_final)  # [G, B, H, K, V], [G, B, H, C, V]
    o = scale * (
        einsum("...ck,...kv->...cv", L.Q_tilde, S) + einsum("...cs,...sv->...cv", L.A_qk, R)
    )  # F8 [G, B, H, C, V]
    return o, S_out, h_final


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
    varlen: VarlenLayout | None = None,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B H K V"], Float[Array, "n B H K V"] | None]:
    """Chunkwise GDN-2 forward. Returns ``(o, h_final, states)``: o in v's dtype, h_final and the
    group-entry states (None unless ``keep_states``) in the accumulation dtype.

    ``segment_ids``: packed sequences (:mod:`gdn2_jax_ref.segments`); h0 enters each row's first
    sequence and h_final leaves its last. ``varlen``: the inputs are a re-laid cu_seqlens row
    (:mod:`gdn2_jax_ref.varlen`, B = 1) whose layout covers this call's blocking; h0 and h_final
    are then per sequence, ``(N, H, K, V)``."""
    acc = params.acc_dtype
    bsz, seq, heads, _ = q.shape
    blk = plan_blocking(q, v, params)
    rows = None if segment_ids is None else RowSegments.build(segment_ids, blk)
    h0 = h0.astype(acc)  # [B, H, K, V] or, with varlen, [N, H, K, V]
    hf0 = None
    if varlen is not None:  # the scan's own carry starts at zero; h0[n] enters at chunk level
        h0, hf0 = jnp.zeros((bsz, *h0.shape[1:]), acc), h0  # empty sequences keep h0
    inputs = tuple(pad_time(x, blk) for x in (q, k, v, w, b, g))  # [B, Tp, H, d]
    o_buf = jnp.zeros((bsz, blk.padded_len, heads, v.shape[-1]), v.dtype)  # [B, Tp, H, V]

    def group_step(carry, i):
        S, o_buf, hf = carry  # [B, H, K, V], [B, Tp, H, V], [N, H, K, V] or None
        chunks = [load_group(x, i, blk, acc) for x in inputs]  # [G, B, H, C, d]
        seg = None if rows is None else rows.load_group(i, blk)  # [G, B, 1, C, 1]
        L = chunk_local(*chunks, params=params, seg=seg)
        seqs = None if varlen is None else SeqStates(varlen.group(i, blk.group), hf0)
        o, S_next, hf = state_pass(L, S, params.scale, seqs, hf)
        return (S_next, store_group(o_buf, o, i, blk), hf), (S if keep_states else None)

    carry0 = (h0, o_buf, hf0)
    (h_final, o_buf, hf), states = lax.scan(group_step, carry0, jnp.arange(blk.n_groups))
    o = probe("jax_ref o", o_buf[:, :seq])  # [B, T, H, V]
    h_final = probe("jax_ref h_final", h_final if hf is None else hf)  # [B or N, H, K, V]
    return o, h_final, states


def varlen_layout(
    q: Float[Array, "1 T H K"],
    v: Float[Array, "1 T H V"],
    cu_seqlens: Int[Array, " N1"],
    params: ChunkParams,
) -> VarlenLayout:
    """The re-laid row of a cu_seqlens call (:mod:`gdn2_jax_ref.varlen`), covering the blocking
    that :func:`plan_blocking` gives the re-laid inputs."""
    _, seq, heads, K = q.shape
    relaid = varlen_length(seq, cu_seqlens.shape[0] - 1, params.bt)  # Tv, static
    shape = jax.ShapeDtypeStruct((1, relaid, heads, K), q.dtype)  # [1, Tv, H, K]
    blk = plan_blocking(shape, v, params)
    return VarlenLayout.build(cu_seqlens, seq, params.bt, blk.n_chunks)


def gdn2_varlen_forward(
    q: Float[Array, "1 T H K"],
    k: Float[Array, "1 T H K"],
    v: Float[Array, "1 T H V"],
    w: Float[Array, "1 T H V"],
    b: Float[Array, "1 T H K"],
    g: Float[Array, "1 T H K"],
    h0: Float[Array, "N H K V"],
    cu_seqlens: Int[Array, " N1"],
    params: ChunkParams,
    keep_states: bool = False,
) -> tuple[Float[Array, "1 T H V"], Float[Array, "N H K V"], Float[Array, "n 1 H K V"] | None]:
    """Chunkwise GDN-2 forward over the sequences ``cu_seqlens`` of one row, each with its own
    h0 and h_final (``(N, H, K, V)``). Returns ``(o, h_final, states)`` as
    :func:`gdn2_chunk_forward`, the states those of the re-laid row."""
    layout = varlen_layout(q, v, cu_seqlens, params)
    inputs = tuple(layout.gather_in(x) for x in (q, k, v, w, b, g))  # [1, Tv, H, d]
    o, h_final, states = gdn2_chunk_forward(
        *inputs, h0, params, keep_states=keep_states, varlen=layout
    )
    return layout.gather_out(o), h_final, states  # [1, T, H, V], [N, H, K, V]
