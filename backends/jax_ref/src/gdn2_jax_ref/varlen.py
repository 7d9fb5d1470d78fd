"""Packed sequences by ``cu_seqlens`` (fla's convention, B = 1): one h0 and one h_final per
sequence.

Sequence n is tokens ``cu_seqlens[n]:cu_seqlens[n+1]`` of the single row. The chunks are laid out
so that every sequence starts at a chunk boundary: sequence n takes chunks
``sum_{m<n} ceil(L_m / C)`` on, and the rows of its last chunk past its end are zero tokens
(k = 0, g = 0: they leave the state unchanged exactly). No chunk mixes two sequences, and the
resets are chunk-level, in the sequential state pass only:

- forward: at a sequence's first chunk the entry state is ``h0[n]`` (not the carried one); the
  state leaving its last chunk is ``h_final[n]``; an empty sequence has ``h_final[n] = h0[n]``;
- backward: at a sequence's last chunk dS is ``dh_final[n]`` (not the carried one), the dS
  entering its first chunk is ``dh0[n]``, nothing flows from one sequence into another;
  ``dh0[n] = dh_final[n]`` for an empty one.

The re-laid row is never stored: each chunk reads C consecutive tokens of the caller's row
(:class:`VarlenRows`; the rows past the sequence's end are zero tokens when read and dropped when
written), so the inputs, outputs and gradients stay in the caller's layout.

Padding cost: the chunk count is static, ``ceil((T + N (C - 1)) / C)`` (N = number of sequences,
static from ``cu_seqlens.shape``); the groups of chunks past the last sequence are skipped at run
time (``lax.cond``), so the work grows by the actual padding, ``sum_n (ceil(L_n / C) C - L_n)``
tokens: about ``N C / 2`` for lengths that are not multiples of C, i.e. nothing for one sequence,
3% for 8 sequences of 1024 tokens at C = 64, about 50% for sequences of about C tokens. The
segment-ids path (:mod:`gdn2_jax_ref.segments`) has no padding at all, but only one h0 and h_final
per row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from gdn2_jax_ref.chunk import Blocking
from gdn2core.plugin import count_at_most


def varlen_length(seq_len: int, n_seqs: int, bt: int) -> int:
    """Static length of the re-laid row: ``T + N (C - 1)`` rounded up to a multiple of C."""
    return -(-(seq_len + n_seqs * (bt - 1)) // bt) * bt


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        *("chunk_src", "chunk_len", "chunk_seq", "chunk_first", "chunk_last", "empty", "n_used")
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class VarlenLayout:
    """Where every chunk reads its tokens, and the chunk-level resets.

    The chunk arrays cover ``n_chunks`` chunks (those of the static length and any padding of the
    blocking); chunks past the last sequence belong to none (first = last = False, no tokens).
    """

    chunk_src: Int[Array, " Nc"]  # the caller's token read by each chunk's first row
    chunk_len: Int[Array, " Nc"]  # rows of each chunk that hold a token (the rest: zero tokens)
    chunk_seq: Int[Array, " Nc"]  # sequence of each chunk
    chunk_first: Bool[Array, " Nc"]  # chunk is its sequence's first: entry state is h0[n]
    chunk_last: Bool[Array, " Nc"]  # chunk is its sequence's last: exit state is h_final[n]
    empty: Bool[Array, " N"]  # sequences of length 0 (h_final = h0)
    n_used: Int[Array, ""]  # chunks that hold a sequence

    @classmethod
    def build(cls, cu_seqlens: Int[Array, " N1"], seq_len: int, bt: int, n_chunks: int,
              continues: Bool[Array, " N"] | None = None):  # fmt: skip
        """The layout for ``cu_seqlens`` over ``seq_len`` tokens, chunks of ``bt`` and
        ``n_chunks >= varlen_length(...) / bt`` chunks in the blocking. A sequence that
        ``continues`` (forward only) has no first chunk: the state the chunk before it left
        enters it (the previous sequence's last chunk, its padding rows zero tokens)."""
        cu = cu_seqlens.astype(jnp.int32)  # [N+1]
        n_seqs = cu.shape[0] - 1
        lens = cu[1:] - cu[:-1]  # [N]
        chunks = (lens + bt - 1) // bt  # [N] chunks per sequence
        first_chunk = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(chunks)])  # [N+1]
        # Chunk c belongs to the last sequence n with first_chunk[n] <= c (skipping empty ones).
        c = jnp.arange(n_chunks, dtype=jnp.int32)  # [Nc]
        used = c < first_chunk[-1]  # [Nc] chunks that hold a sequence
        seq = jnp.clip(count_at_most(first_chunk, c) - 1, 0, n_seqs - 1)  # [Nc]
        offset = bt * (c - first_chunk[seq])  # [Nc] first row's position inside its sequence
        src = jnp.where(used, cu[seq] + offset, seq_len)  # [Nc] unused: the zero padding
        n_rows = jnp.where(used, jnp.minimum(bt, lens[seq] - offset), 0)  # [Nc]
        first = used & (c == first_chunk[seq])  # [Nc]
        if continues is not None:
            first = first & ~continues[seq]
        last = used & (c + 1 == first_chunk[seq + 1])  # [Nc]
        return cls(src, n_rows, seq, first, last, lens == 0, first_chunk[-1])

    def group_used(self, i, group: int) -> Bool[Array, ""]:
        """Whether group ``i`` of ``group`` chunks holds any sequence (a group of zero tokens
        only, past the last sequence, leaves the state as it is and is skipped)."""
        return i * group < self.n_used

    def group(self, i, group: int) -> ChunkResets:
        """The chunk-level resets of group ``i`` of ``group`` chunks."""

        def sl(x):
            return lax.dynamic_slice_in_dim(x, i * group, group)  # [G]

        return ChunkResets(sl(self.chunk_seq), sl(self.chunk_first), sl(self.chunk_last))


@dataclasses.dataclass(frozen=True)
class VarlenRows:
    """Group I/O for a cu_seqlens row, in the caller's layout (the counterpart of
    :class:`gdn2_jax_ref.chunk.PlainRows`): a group's rows are gathered from, and scattered to,
    their tokens; rows past a sequence's end read as zero tokens and are dropped when written."""

    layout: VarlenLayout
    blk: Blocking

    def pad(self, x: Float[Array, "1 T H d"]) -> Float[Array, "1 T H d"]:
        """Nothing to pad: the rows index the caller's tokens."""
        return x

    def _tokens(self, i, seq_len: int) -> tuple[Int[Array, "G C"], Bool[Array, "G C"]]:
        """The token of every row of group ``i``; rows without one get distinct indices past
        the row (so the indices of a group are unique)."""
        G, C = self.blk.group, self.blk.bt
        src = lax.dynamic_slice_in_dim(self.layout.chunk_src, i * G, G)  # [G]
        n_rows = lax.dynamic_slice_in_dim(self.layout.chunk_len, i * G, G)  # [G]
        row = jnp.arange(C, dtype=jnp.int32)  # [C]
        keep = row < n_rows[:, None]  # [G, C]
        past = seq_len + C * jnp.arange(G, dtype=jnp.int32)[:, None] + row  # [G, C]
        return jnp.where(keep, src[:, None] + row, past), keep  # [G, C]

    def load(self, x: Float[Array, "1 T H d"], i, dtype) -> Float[Array, "G 1 H C d"]:
        """Group ``i`` in chunk layout, zero tokens past each sequence's end."""
        tok, keep = self._tokens(i, x.shape[1])  # [G, C]
        rows = jnp.take(x[0], tok, axis=0, mode="fill", fill_value=0)  # [G, C, H, d]
        rows = jnp.where(keep[:, :, None, None], rows, jnp.zeros((), x.dtype))  # [G, C, H, d]
        return jnp.transpose(rows.astype(dtype), (0, 2, 1, 3))[:, None]  # [G, 1, H, C, d]

    def store(
        self, buf: Float[Array, "1 T H d"], x: Float[Array, "G 1 H C d"], i
    ) -> Float[Array, "1 T H d"]:
        """Write the token rows of group ``i`` into ``buf`` (the other rows are dropped)."""
        tok, _ = self._tokens(i, buf.shape[1])  # [G, C]
        rows = jnp.transpose(x[:, 0], (0, 2, 1, 3)).astype(buf.dtype)  # [G, C, H, d]
        return buf.at[0, tok].set(rows, mode="drop", unique_indices=True)  # [1, T, H, d]


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["seq", "first", "last"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class ChunkResets:
    """Chunk-level resets of the chunks of one group (scanned over with them)."""

    seq: Int[Array, " G"]
    first: Bool[Array, " G"]
    last: Bool[Array, " G"]


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["resets", "h0", "dh_final"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class SeqStates:
    """One group's chunk-level resets (scanned over with its chunks) and the per-sequence states
    they read: h0 in the forward, also dh_final in the backward."""

    resets: ChunkResets
    h0: Float[Array, "N H K V"]
    dh_final: Float[Array, "N H K V"] | None = None


def enter(
    per_seq: Float[Array, "N H K V"], S: Float[Array, "1 H K V"], flag, n
) -> Float[Array, "1 H K V"]:
    """``per_seq[n]`` where ``flag`` (a sequence's boundary chunk), else the carried S."""
    own = lax.dynamic_index_in_dim(per_seq, n, keepdims=True)  # [1, H, K, V]
    return jnp.where(flag, own.astype(S.dtype), S)


def record(
    buf: Float[Array, "N H K V"], x: Float[Array, "1 H K V"], flag, n
) -> Float[Array, "N H K V"]:
    """``buf[n] = x`` where ``flag`` (one sequence's h_final or dh0), else unchanged."""
    old = lax.dynamic_index_in_dim(buf, n, keepdims=True)  # [1, H, K, V]
    return lax.dynamic_update_index_in_dim(buf, jnp.where(flag, x.astype(buf.dtype), old), n, 0)
