"""Packed sequences by segment ids: where the resets fall, in chunk layout.

A row of ``segment_ids`` (B, T) holds several sequences; a new one starts wherever the id changes
from the previous token. The state is reset to zero before every start except the row's first
token (there ``h0`` enters). A start can fall anywhere, inside a chunk too, so the chunkwise
algorithm works with *segments*: the runs of rows of one chunk that belong to one sequence.

Every row gets its *segment number*, the number of starts up to and including it (a running
count along the row, so two rows are in the same sequence iff their numbers are equal), and every
chunk the number of the state entering it (that of the token before its first row). Resets are
then exact, with no huge negative g anywhere:

- the cumsum of g restarts at a start and leaves the start's own g out (it decays a zero state),
  so ``gamma_cum[r]`` sums the g of r's own segment only, and the start's dg is exactly 0;
- every decay factor between two rows of different segments, pairwise or through a reference row
  (:mod:`gdn2_jax_ref.scores`), has its exponent masked to -inf before the exp, so it is exactly 0;
- the chunk-boundary factors are masked likewise: exp(gamma_cum[r]) (the chunk-entry state's
  weight) only for rows of the segment the entry state belongs to ("carry-in" rows),
  exp(gamma_C - gamma_cum[r]) (the weight in the exit state) only for rows of the chunk's last
  segment, and exp(gamma_C) only when the chunk holds no start.

A zero factor times a finite number is an exact 0, and a sum with exact zeros added is the sum
without them, so no result of one sequence depends on another's tokens, not even by an ulp
(for finite inputs: an inf or NaN in one sequence still poisons the products it meets).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Int

from gdn2_jax_ref.chunk import Blocking
from gdn2core.plugin import segment_starts


@functools.partial(jax.tree_util.register_dataclass, data_fields=["seg", "entry"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SegmentMasks:
    """Segment numbers of one group of chunks; ``...`` = ``G, B, 1`` (broadcast over heads)."""

    seg: Int[Array, "... C 1"]  # segment number of every row
    entry: Int[Array, "... 1 1"]  # segment number of the state entering the chunk

    @property
    def carry_in(self) -> Bool[Array, "... C 1"]:
        """Rows that see the chunk-entry state: no start in the chunk up to and including them."""
        return self.seg == self.entry

    @property
    def in_last(self) -> Bool[Array, "... C 1"]:
        """Rows of the chunk's last segment: no start after them in the chunk."""
        return self.seg == self.seg[..., -1:, :]

    @property
    def no_start(self) -> Bool[Array, "... 1"]:
        """Chunks that hold no start (their entry state survives the chunk)."""
        return self.seg[..., -1, :] == self.entry[..., 0, :]

    @property
    def is_start(self) -> Bool[Array, "... C 1"]:
        """Rows where a sequence starts (the state is reset before them)."""
        prev = jnp.concatenate([self.entry, self.seg[..., :-1, :]], axis=-2)  # [..., C, 1]
        return self.seg != prev


def same_segment(sr: Int[Array, "... r 1"], ss: Int[Array, "... s 1"]) -> Bool[Array, "... r s"]:
    """``[r, s]``: rows r and s are in the same segment."""
    return sr[..., :, None, 0] == ss[..., None, :, 0]


def segment_numbers(segment_ids: Int[Array, "B T"]) -> Int[Array, "B T"]:
    """The number of starts up to and including each token (0 for the row's first sequence)."""
    return jnp.cumsum(segment_starts(segment_ids), axis=1, dtype=jnp.int32) - 1  # [B, T]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["seg", "entry"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class RowSegments:
    """Segment numbers of a whole padded row (padding continues the last sequence)."""

    seg: Int[Array, "B Tp"]
    entry: Int[Array, "B Nc"]  # per chunk: the segment number of the state entering it

    @classmethod
    def build(cls, segment_ids: Int[Array, "B T"], blk: Blocking) -> RowSegments:
        seg = segment_numbers(segment_ids)  # [B, T]
        seg = jnp.pad(seg, ((0, 0), (0, blk.padded_len - seg.shape[1])), mode="edge")  # [B, Tp]
        last = seg[:, blk.bt - 1 :: blk.bt]  # [B, Nc] segment of every chunk's last row
        entry = jnp.concatenate([seg[:, :1], last[:, :-1]], axis=1)  # [B, Nc] the row before
        return cls(seg=seg, entry=entry)  # [B, Tp], [B, Nc]

    def load_group(self, i, blk: Blocking) -> SegmentMasks:
        """The masks of group ``i`` in chunk layout ``[G, B, 1, C, 1]``."""
        bsz = self.seg.shape[0]
        seg = lax.dynamic_slice_in_dim(self.seg, i * blk.group_len, blk.group_len, axis=1)
        seg = jnp.transpose(seg.reshape(bsz, blk.group, blk.bt), (1, 0, 2))  # [G, B, C]
        entry = lax.dynamic_slice_in_dim(self.entry, i * blk.group, blk.group, axis=1)  # [B, G]
        return SegmentMasks(
            seg=seg[:, :, None, :, None],  # [G, B, 1, C, 1]
            entry=jnp.transpose(entry)[:, :, None, None, None],  # [G, B, 1, 1, 1]
        )
