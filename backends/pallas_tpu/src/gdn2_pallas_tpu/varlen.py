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

The table sits whole in SMEM, 1 MiB per core (:data:`SMEM_CAPACITY`), and Mosaic pads it: its 3
rows to 4, its chunks to a multiple of 128 (:func:`table_smem_bytes`; measured with the TPU
compiler, which refuses ``[3, 65536]``: "Ran out of memory in memory space smem ... window shape
s32[3,65536]", 1 MiB). The table may take :data:`SMEM_TABLE_SHARE` of it, the rest is headroom
for the scalars the compiler keeps in SMEM beside it (about 1.1 KiB in these kernels): at most
57344 chunks, a row of 917504 tokens at ``bt=16`` (``t_pad``, the sequences' padding included).
A longer row is refused by ``supports()`` (:func:`table_refusal`), not left to fail in the
compiler.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Final

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2core.plugin import count_at_most

SEQ, FIRST, LAST = 0, 1, 2  # rows of the chunk table
#: SMEM per core of every generation the kernels target (v5e, v5p, v6e, v7x:
#: ``pltpu.get_tpu_info().smem_capacity_bytes``).
SMEM_CAPACITY: Final = 2**20
#: Share of the SMEM the chunk table may take; the rest is headroom for the compiler's own scalars
#: in SMEM (grid indices, DMA descriptors, spilled scalars: about 1.1 KiB in these kernels).
SMEM_TABLE_SHARE: Final = 0.875
#: The table's rows: SEQ, FIRST, LAST (the pooled forward's table has more, pooled.py).
TABLE_ROWS: Final = 3
#: The chunks are padded to whole rows of 128 words.
SMEM_LANES: Final = 128
INT32_BYTES: Final = 4


def rows_padded(rows: int) -> int:
    """The table's rows as Mosaic lays them out in SMEM: padded to a power of two (the compiler
    allocates ``[3, n]`` int32 as 4 n words, ``[7, n]`` as 8 n)."""
    return 1 << max(0, rows - 1).bit_length()


def table_smem_bytes(n_chunks: int, rows: int = TABLE_ROWS) -> int:
    """SMEM bytes of a ``[rows, n_chunks]`` int32 chunk table as Mosaic allocates it (padded)."""
    return rows_padded(rows) * math.ceil(n_chunks / SMEM_LANES) * SMEM_LANES * INT32_BYTES


def table_smem_budget() -> int:
    """The SMEM bytes the chunk table may take: ``SMEM_TABLE_SHARE`` of ``SMEM_CAPACITY``."""
    return int(SMEM_TABLE_SHARE * SMEM_CAPACITY)


def table_refusal(
    n_seqs: int, seq_len: int, C: int, t_pad: int, rows: int = TABLE_ROWS
) -> str | None:
    """None when the ``rows``-row chunk table of a row of ``t_pad`` tokens (``n_seqs`` sequences
    in ``seq_len`` tokens, chunks of ``C``) fits its SMEM budget, else the reason."""
    n_chunks = t_pad // C
    need, budget = table_smem_bytes(n_chunks, rows), table_smem_budget()
    if need <= budget:
        return None
    most = budget // (rows_padded(rows) * INT32_BYTES)
    return (
        f"cu_seqlens: {n_seqs} sequences in T={seq_len} tokens make a row of {n_chunks} chunks "
        f"of bt={C} (each sequence padded to whole chunks), whose chunk table needs {need} bytes "
        f"of SMEM, more than the {budget} available ({SMEM_TABLE_SHARE:.1%} of the "
        f"{SMEM_CAPACITY} bytes of SMEM per core: at most {most} chunks); use a larger bt or "
        "fewer tokens per call"
    )


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


def layout(
    cu_seqlens: jax.Array, seq_len: int, C: int, t_pad: int, continues: jax.Array | None = None
) -> Layout:
    """The chunk-aligned layout of the sequences ``cu_seqlens`` (N + 1 offsets into T tokens).

    A sequence that ``continues`` (``(N,)`` bool, forward only) gets no first-chunk flag: the
    kernel then enters it with the state it carries from the chunk before, the previous
    sequence's last chunk (whose padding rows are zero tokens, so that state is the previous
    sequence's final state), and never reads its ``h0``."""
    cu = cu_seqlens.astype(jnp.int32)
    n_seqs = cu.shape[0] - 1
    lengths = cu[1:] - cu[:-1]  # [N]
    chunks = jnp.maximum(1, (lengths + C - 1) // C)  # [N] an empty sequence still owns a chunk
    end_chunk = jnp.cumsum(chunks)  # [N] first chunk after each sequence
    first_chunk = end_chunk - chunks  # [N]
    token = jnp.arange(seq_len, dtype=jnp.int32)
    seq_of_token = count_at_most(cu[1:], token)  # [T]
    position = first_chunk[seq_of_token] * C + token - cu[seq_of_token]
    source = jnp.full((t_pad,), seq_len, jnp.int32).at[position].set(token)
    chunk = jnp.arange(t_pad // C, dtype=jnp.int32)
    seq_of_chunk = count_at_most(end_chunk, chunk)
    seq_safe = jnp.minimum(seq_of_chunk, n_seqs - 1)
    used = seq_of_chunk < n_seqs  # chunks after the last sequence belong to none
    first = used & (chunk == first_chunk[seq_safe])
    if continues is not None:
        first = first & ~continues[seq_safe]
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
    ``[hb, K, V]`` float32 VMEM buffer and ``sem`` one DMA semaphore, for the reads; ``writes``
    the :class:`state_writes.StateWrites` of the writes (staged ``[hb, K, V]`` f32, not
    waited)."""

    def __init__(self, plan, table, hbm, buf, sem, writes, head_group, step):
        self.plan, self.table, self.hbm, self.buf, self.sem = plan, table, hbm, buf, sem
        self.writes, self.head_group, self.step = writes, head_group, step

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
        """``hbm[sequence of chunk j] = value`` (the step's heads) when ``when``: staged, its DMA
        waited chunks later (state_writes.py)."""

        def fill(buf):  # [hb, K, V] f32
            buf[...] = value

        @pl.when(when)
        def _():
            self.writes.stage(j, fill)
            self.writes.start(j, self._slot(j))
