"""Packed sequences by ``cu_seqlens`` (fla's convention, B = 1): one h0 and one h_final per
sequence.

Sequence n is tokens ``cu_seqlens[n]:cu_seqlens[n+1]`` of the single row. The row is re-laid out
so that every sequence starts at a chunk boundary (a gather; sequence n begins at chunk
``sum_{m<n} ceil(L_m / C)``, and the tokens up to the next boundary are zero tokens, k = 0 and
g = 0, which leave the state unchanged exactly). The chunks then never mix two sequences, and the
resets are chunk-level, in the sequential state pass only:

- forward: at a sequence's first chunk the entry state is ``h0[n]`` (not the carried one); the
  state leaving its last chunk is ``h_final[n]``; an empty sequence has ``h_final[n] = h0[n]``;
- backward: at a sequence's last chunk dS is ``dh_final[n]`` (not the carried one), the dS
  entering its first chunk is ``dh0[n]``, nothing flows from one sequence into another;
  ``dh0[n] = dh_final[n]`` for an empty one.

Outputs and gradients are gathered back (a gather both ways, no scatter).

Padding cost: the re-laid row has the static length ``T + N * (C - 1)`` rounded up to a multiple
of C (N = number of sequences, static from ``cu_seqlens.shape``), so the chunk work grows by at
most ``N * (C - 1) / T``: nothing for one sequence, 6% for 8 sequences of 1024 tokens at C = 64,
100% for sequences of about C tokens. The segment-ids path (:mod:`gdn2_jax_ref.segments`) has no
padding at all, but only one h0 and h_final per row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int


def varlen_length(seq_len: int, n_seqs: int, bt: int) -> int:
    """Static length of the re-laid row: ``T + N (C - 1)`` rounded up to a multiple of C."""
    return -(-(seq_len + n_seqs * (bt - 1)) // bt) * bt


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["src", "valid", "pos", "chunk_seq", "chunk_first", "chunk_last", "empty"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class VarlenLayout:
    """Where every token goes in the re-laid row, and the chunk-level resets there.

    The chunk arrays cover ``n_chunks`` chunks (those of the re-laid row and any trailing padding
    of the blocking); chunks past the last sequence belong to none (first = last = False).
    """

    src: Int[Array, " Tv"]  # token read by each re-laid position (any token where not valid)
    valid: Bool[Array, " Tv"]  # re-laid positions that hold a token (else a zero token)
    pos: Int[Array, " T"]  # re-laid position of each token
    chunk_seq: Int[Array, " Nc"]  # sequence of each chunk
    chunk_first: Bool[Array, " Nc"]  # chunk is its sequence's first: entry state is h0[n]
    chunk_last: Bool[Array, " Nc"]  # chunk is its sequence's last: exit state is h_final[n]
    empty: Bool[Array, " N"]  # sequences of length 0 (h_final = h0)

    @classmethod
    def build(cls, cu_seqlens: Int[Array, " N1"], seq_len: int, bt: int, n_chunks: int):
        """The layout for ``cu_seqlens`` over ``seq_len`` tokens, chunks of ``bt`` and
        ``n_chunks >= varlen_length(...) / bt`` chunks in the blocking."""
        cu = cu_seqlens.astype(jnp.int32)  # [N+1]
        n_seqs = cu.shape[0] - 1
        lens = cu[1:] - cu[:-1]  # [N]
        chunks = (lens + bt - 1) // bt  # [N] chunks per sequence
        start = bt * jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(chunks)])  # [N+1]
        # Token t is in the last sequence n with cu[n] <= t (later empty sequences share cu[n]).
        t = jnp.arange(seq_len, dtype=jnp.int32)  # [T]
        seq_of_t = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, n_seqs - 1)  # [T]
        pos = start[seq_of_t] + t - cu[seq_of_t]  # [T]
        # Chunk c belongs to the last sequence n with start[n] <= c C (skipping empty ones).
        c0 = bt * jnp.arange(n_chunks, dtype=jnp.int32)  # [Nc] first position of each chunk
        used = c0 < start[-1]  # [Nc] chunks that hold a sequence
        seq_of_c = jnp.clip(jnp.searchsorted(start, c0, side="right") - 1, 0, n_seqs - 1)
        first = used & (c0 == start[seq_of_c])  # [Nc]
        last = used & (c0 + bt == start[seq_of_c + 1])  # [Nc]
        p = jnp.arange(varlen_length(seq_len, n_seqs, bt), dtype=jnp.int32)  # [Tv]
        seq_of_p = seq_of_c[p // bt]  # [Tv]
        offset = p - start[seq_of_p]  # [Tv] position inside its sequence
        valid = (p < start[-1]) & (offset < lens[seq_of_p])  # [Tv]
        src = jnp.clip(cu[seq_of_p] + offset, 0, seq_len - 1)  # [Tv]
        return cls(src, valid, pos, seq_of_c, first, last, lens == 0)

    def gather_in(self, x: Float[Array, "1 T H d"]) -> Float[Array, "1 Tv H d"]:
        """x in the re-laid row, zero tokens in the gaps."""
        xs = jnp.take(x[0], self.src, axis=0)  # [Tv, H, d]
        return jnp.where(self.valid[:, None, None], xs, jnp.zeros((), x.dtype))[None]

    def gather_out(self, x: Float[Array, "1 Tp H d"]) -> Float[Array, "1 T H d"]:
        """Back from the re-laid row (``Tp >= Tv``: trailing padding ignored)."""
        return jnp.take(x[0], self.pos, axis=0)[None]  # [1, T, H, d]

    def group(self, i, group: int) -> ChunkResets:
        """The chunk-level resets of group ``i`` of ``group`` chunks."""

        def sl(x):
            return lax.dynamic_slice_in_dim(x, i * group, group)  # [G]

        return ChunkResets(sl(self.chunk_seq), sl(self.chunk_first), sl(self.chunk_last))


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
