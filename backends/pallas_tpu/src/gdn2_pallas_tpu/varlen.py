"""Packed variable-length sequences given by ``cu_seqlens`` (fla's convention; B = 1), with an
initial and a final state per sequence.

Layout (XLA, outside the kernels): every sequence is moved to start at a chunk boundary, its last
chunk padded with zero tokens (``k = 0, g = 0``: the state passes unchanged), in a row of static
length ``t_pad >= T + N C`` (``N`` sequences, ``C`` the chunk; so the padding costs at most one
chunk per sequence). Each chunk then belongs to one sequence, and the kernels only reset the state
at chunk boundaries: at a sequence's first chunk the state is its ``h0`` (not the carried one),
after its last chunk the state is its ``h_final``. The backward mirrors it (the gradient of the
state leaving a sequence's last chunk is its ``dh_final``; ``dh0`` is the gradient entering its
first chunk), so nothing flows between sequences.

In the kernels, a per-chunk table in SMEM (``[3, n_chunks]`` int32: the sequence of the chunk,
whether it is the sequence's first chunk, whether it is its last) drives manual DMAs of the
per-sequence states between HBM and the carried state in VMEM.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

SEQ, FIRST, LAST = 0, 1, 2  # rows of the chunk table


def padded_length(seq_len: int, n_seqs: int, C: int, step_len: int) -> int:
    """Static length of the chunk-aligned row: room for every sequence to waste one chunk."""
    return max(1, math.ceil((seq_len + n_seqs * C) / step_len)) * step_len


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the tokens go (arrays computed from ``cu_seqlens`` under jit)."""

    position: jax.Array  # [T] int32: the chunk-aligned position of every token
    source: jax.Array  # [t_pad] int32: the token at every position (T: a padding token)
    table: (
        jax.Array
    )  # [3, t_pad / C] int32: per chunk its sequence, first-chunk and last-chunk flags


def layout(cu_seqlens: jax.Array, seq_len: int, C: int, t_pad: int) -> Layout:
    """The chunk-aligned layout of the sequences ``cu_seqlens`` (N + 1 offsets into T tokens)."""
    cu = cu_seqlens.astype(jnp.int32)
    n_seqs = cu.shape[0] - 1
    lengths = cu[1:] - cu[:-1]  # [N]
    chunks = jnp.maximum(1, (lengths + C - 1) // C)  # [N] an empty sequence still owns a chunk
    end_chunk = jnp.cumsum(chunks)  # [N] first chunk after each sequence
    first_chunk = end_chunk - chunks  # [N]
    token = jnp.arange(seq_len, dtype=jnp.int32)
    seq_of_token = jnp.searchsorted(cu[1:], token, side="right").astype(jnp.int32)  # [T]
    position = first_chunk[seq_of_token] * C + token - cu[seq_of_token]
    source = jnp.full((t_pad,), seq_len, jnp.int32).at[position].set(token)
    chunk = jnp.arange(t_pad // C, dtype=jnp.int32)
    seq_of_chunk = jnp.searchsorted(end_chunk, chunk, side="right").astype(jnp.int32)
    seq_safe = jnp.minimum(seq_of_chunk, n_seqs - 1)
    used = seq_of_chunk < n_seqs  # chunks after the last sequence belong to none
    first = used & (chunk == first_chunk[seq_safe])
    last = used & (chunk == end_chunk[seq_safe] - 1)
    table = jnp.stack([seq_safe, first.astype(jnp.int32), last.astype(jnp.int32)])
    return Layout(position.astype(jnp.int32), source, table)


def to_padded(x: jax.Array, lay: Layout, fill: float = 0.0) -> jax.Array:
    """(1, T, H, d) -> (1, t_pad, H, d): tokens moved to their positions, ``fill`` elsewhere."""
    pad = jnp.full((1, 1, *x.shape[2:]), fill, x.dtype)
    return jnp.concatenate([x, pad], axis=1)[:, lay.source]


def from_padded(y: jax.Array, lay: Layout) -> jax.Array:
    """(1, t_pad, H, d) -> (1, T, H, d)."""
    return y[:, lay.position]


class SequenceStates:
    """In a kernel: the per-sequence states of the chunks of one grid step (module docstring).

    ``table`` is the SMEM chunk table; ``hbm`` a ``(N, H, K, V)`` float32 array in HBM; ``buf`` a
    ``[hb, K, V]`` float32 VMEM buffer for the DMAs; ``sem`` one DMA semaphore."""

    def __init__(self, plan, table, hbm, buf, sem, head_group, step):
        self.plan, self.table, self.hbm, self.buf, self.sem = plan, table, hbm, buf, sem
        self.head_group, self.step = head_group, step

    def _chunk(self, j: int):
        return self.step * self.plan.nc + j

    def is_first(self, j: int):
        return self.table[FIRST, self._chunk(j)] == 1

    def is_last(self, j: int):
        return self.table[LAST, self._chunk(j)] == 1

    def _slot(self, j: int):
        heads = pl.ds(self.head_group * self.plan.hb, self.plan.hb)
        return self.hbm.at[self.table[SEQ, self._chunk(j)], heads]

    def read(self, j: int, when, into) -> None:
        """``into[...] = hbm[sequence of chunk j]`` (the step's heads) when ``when``."""

        @pl.when(when)
        def _():
            copy = pltpu.make_async_copy(self._slot(j), self.buf, self.sem)
            copy.start()
            copy.wait()
            into[...] = self.buf[...]

    def write(self, j: int, when, value) -> None:
        """``hbm[sequence of chunk j] = value`` (the step's heads) when ``when``."""

        @pl.when(when)
        def _():
            self.buf[...] = value
            copy = pltpu.make_async_copy(self.buf, self._slot(j), self.sem)
            copy.start()
            copy.wait()
