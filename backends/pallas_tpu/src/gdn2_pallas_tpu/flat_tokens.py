"""The pooled forward's token tiles read straight from the flat ``(1, T, H, d)`` arrays of a
ragged call, and its o written straight to the flat ``(1, T, HV, dv)`` output
(``plan.flat_tokens``; pooled.py has the row and the chunk table), so XLA moves no input into
the row and no output out of it.

Chunk ``c`` of the row wants the flat tokens ``want = c C + REL[c]`` to ``want + C``: where its
request's rows would start, the filler before a request and the padding after it included. Its
``(C, hb, d)`` block is an element window (``pl.Element``) of the token-major array, whose token
axis is untiled, so any start is one DMA; the grid step's ``nc`` chunks are ``nc`` BlockSpecs,
pipelined like any block. Near the ends of the array the window is clamped into it,
``src = clip(want, 0, T - C)``, and the chunk's rows are its block's rows rolled by
``src - want`` (``|src - want| < C``). The kernel has two copies of a grid step, with and
without the rolls, and runs the first only where a chunk of the step needs it (a request within
``C`` tokens of either end of the array): rolling every chunk by a traced shift, 0 nearly always,
cost 3% of the kernel, and a ``lax.cond`` around each roll more (its value is materialised for
both branches; TPU compiler static estimate, 8 prefills of 256 tokens, v5e: 1.44M cycles with
the conds, 1.39M rolling always, 1.34M without rolls). The rows ``[LO, HI)`` of a chunk are
its request's tokens; the others (a neighbour's, the decodes', the engine's padding: any value,
NaN included) are replaced by zeros after the activations (:meth:`FlatTokens.mask`), so they
leave the state unchanged and never meet another row.

Grouped value heads: v and w are read as the caller laid them out, ``(T, HV, dv)`` (the core's
``(T, H, G dv)`` view of them, a relayout on a TPU, and the backend's view back cancel in XLA),
``G`` windows of ``hb`` value heads per chunk, and joined in VMEM into the kernel head's ``G dv``
value columns (:func:`join_groups`). One window of ``hb G`` heads would be fewer DMAs, but the
static profile classifies it remote and prices the whole kernel at 0.

VMEM: the windows of a step are the bytes of the one ``(nc C, hb, d)`` block of the padded row,
double-buffered the same way (plan.vmem_bytes counts them unchanged).

Output (:class:`FlatOutput`). Windows of neighbouring chunks overlap where a request starts or
ends, and two DMAs in flight to the same rows land in no set order, so each chunk writes only
the rows it owns (``WROWS``, pooled.py): a chunk inside a request all ``C`` (one DMA), the first
and last of a request the ``n < C`` rows of its request (one DMA per set bit of ``n``: at most
``log2 C``, every size static). Every token of the output is owned by exactly one chunk: a
request's by its chunks, the others (the decodes' before the first request, the engine's padding
after the last) by the chunks after the last request's, which write zeros (their inputs all
zeroed); ``t_pad`` has room for them (two chunks more than the requests need: the two ranges'
partial chunks). A step's o is staged in VMEM as ``G`` value-head windows ``(nc C, hb, dv)``,
the layout of ``(T, HV, dv)``: no relayout of o in XLA either. The DMAs run behind the next
step's compute (waited before its o is staged) and the last step's are waited at its end.
Estimate (v5e, 2 requests of 1024 tokens, H = 16, HV = 32, bf16): the kernel 528k -> 580k
cycles, the whole call 830k -> 668k (the gather, relayout and zeroing of o gone).
"""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2_pallas_tpu import pooled
from gdn2_pallas_tpu.blocks import I0, join_blocks, split_blocks
from gdn2_pallas_tpu.chunk_math import iota
from gdn2_pallas_tpu.plan import Plan

F32 = jnp.float32


def window(table, chunk, plan: Plan):
    """``(src, want)``: the first flat token of chunk ``chunk``'s block, and of its rows."""
    want = chunk * plan.C + table[pooled.REL, chunk]
    return jnp.minimum(jnp.maximum(want, 0), plan.token_rows - plan.C), want


def _chunk_index(batch, head_group, step, table, *, j: int, part: int, groups: int, plan: Plan):
    """Element offsets of part ``part`` of chunk ``j`` of the step: ``(batch, src, first head,
    0)``."""
    src, _ = window(table, step * plan.nc + j, plan)
    return (batch, src, (head_group * groups + part) * plan.hb, I0)


def in_specs(plan: Plan, d: int, groups: int = 1) -> list[pl.BlockSpec]:
    """``G`` ``(C, hb, d / G)`` element windows per chunk of a step, chunk by chunk (refs.py
    passes the array once per spec): for v and w, ``groups = G`` value heads per kernel head,
    read as the caller laid them out, ``(T, HV, dv)``, ``hb`` heads a window (a window of
    ``hb G`` heads is a DMA the TPU compiler's static profile classifies remote and prices at 0,
    the whole kernel with it)."""
    shape = (None, pl.Element(plan.C), pl.Element(plan.hb), pl.Element(d // groups))
    index = functools.partial(_chunk_index, groups=groups, plan=plan)
    return [
        pl.BlockSpec(shape, functools.partial(index, j=j, part=m))
        for j in range(plan.nc)
        for m in range(groups)
    ]


class FlatTokens:
    """In the kernel: the chunks of grid step ``step`` from the refs of :func:`in_specs`."""

    def __init__(self, plan: Plan, table, step, roll: bool = False):
        self.plan, self.table, self.step, self.roll = plan, table, step, roll
        chunks = [step * plan.nc + j for j in range(plan.nc)]
        self.lo = [table[pooled.LO, c] for c in chunks]  # the step's chunks' request rows
        self.hi = [table[pooled.HI, c] for c in chunks]
        self.shifts = []  # the roll of each chunk's block rows, in [0, C): 0 unless clamped
        for c in chunks:
            src, want = window(table, c, plan)
            shift = src - want  # row i of the chunk is row i - shift of the block
            self.shifts.append(jnp.where(shift < 0, shift + plan.C, shift))  # no rem (profiler)

    def rolled(self, roll: bool) -> FlatTokens:
        """The same chunks, read with (``roll``) or without their rolls."""
        other = copy.copy(self)
        other.roll = roll
        return other

    def needs_roll(self):
        """Whether a chunk of the step with rows to read has a clamped window."""
        needs = jnp.bool_(False)
        for lo, hi, shift in zip(self.lo, self.hi, self.shifts, strict=True):
            needs = needs | ((lo < hi) & (shift != 0))
        return needs

    def _chunk(self, refs, j: int, groups: int) -> jax.Array:
        """Chunk ``j``'s rows ``[hb, C, G d]`` float32 (rows outside ``[LO, HI)`` unspecified)."""
        x = join_blocks([ref[...] for ref in refs], groups).astype(F32)  # [hb, C, G d]
        return pltpu.roll(x, self.shifts[j], 1) if self.roll else x

    def load(self, refs, d: int, groups: int = 1) -> jax.Array:
        """The step's chunks as float32 units ``[U, C, d]`` (unit ``= head * nc + chunk``)."""
        plan = self.plan
        parts = [refs[j * groups : (j + 1) * groups] for j in range(plan.nc)]
        x = jnp.stack([self._chunk(p, j, groups) for j, p in enumerate(parts)], axis=1)
        return x.reshape(plan.units, plan.C, d)  # [hb, nc, C, d] -> [U, C, d]

    def valid(self) -> jax.Array:
        """``[U, C, 1]`` bool: the rows that are their chunk's request's tokens."""
        plan = self.plan
        row = iota((plan.hb, plan.C, 1), 1)  # [hb, C, 1]
        rows = [(row >= lo) & (row < hi) for lo, hi in zip(self.lo, self.hi, strict=True)]
        return jnp.stack(rows, axis=1).reshape(plan.units, plan.C, 1)  # [hb, nc, C, 1] -> [U]

    @staticmethod
    def mask(valid: jax.Array, *xs: jax.Array) -> tuple[jax.Array, ...]:
        """Each ``[U, C, d]`` of ``xs`` with the rows outside ``valid`` set to zero (a select: a
        NaN there never reaches a product)."""
        return tuple(jnp.where(valid, x, 0.0) for x in xs)


class FlatOutput:
    """In the kernel: the step's o written at the flat tokens, ``(1, T, HV, dv)``, by DMAs of the
    rows each chunk owns (module docstring, section Output).

    ``out`` the output in HBM; ``stage`` a ``[G, nc C, hb, dv]`` VMEM buffer in o's dtype; ``sem``
    one DMA semaphore. The DMAs of step ``s`` are waited at step ``s + 1``, before its o replaces
    them in the buffer (their pieces recomputed from the table), and at the last step of the head
    group, so they run behind the next step's compute. (Two buffers, waited two steps later,
    estimate the same on v5e.)"""

    def __init__(self, plan: Plan, table, out, stage, sem, head_group, step):
        assert plan.C & (plan.C - 1) == 0, f"bt={plan.C} must be a power of two"
        self.plan, self.table, self.out, self.stage, self.sem = plan, table, out, stage, sem
        self.head_group, self.step = head_group, step

    def _rows(self, chunk):
        """``(want, lo, hi)``: chunk ``chunk`` writes its rows ``[lo, hi)`` to the flat tokens
        ``want + lo ...``, kept inside the output whatever the table says."""
        plan = self.plan
        _, want = window(self.table, chunk, plan)
        code = self.table[pooled.WROWS, chunk]
        lo = jnp.maximum(code & pooled.ROW_MASK, -want)
        hi = jnp.minimum(plan.C - (code >> pooled.ROW_BITS), plan.token_rows - want)
        return want, lo, hi

    def _piece(self, j: int, m: int, size: int, at, want, start: bool) -> None:
        """Rows ``[at, at + size)`` of chunk ``j``, value-head window ``m``: start or wait."""
        plan = self.plan
        heads = pl.ds((self.head_group * plan.pool_groups + m) * plan.hb, plan.hb)
        src = self.stage.at[m, pl.ds(j * plan.C + at, size)]  # [size, hb, dv]
        dst = self.out.at[0, pl.ds(want + at, size), heads]  # [size, hb, dv]
        copy = pltpu.make_async_copy(src, dst, self.sem)
        if start:
            copy.start()
        else:
            copy.wait()

    def _bits(self, j: int, m: int, n, lo, want, start: bool) -> None:
        """``n < C`` rows from ``lo``: one DMA per set bit of ``n``."""
        at, size = lo, self.plan.C // 2
        while size:
            self._when_bit(j, m, n, size, at, want, start)
            at = at + (n & size)
            size //= 2

    def _when_bit(self, j, m, n, size, at, want, start) -> None:
        @pl.when((n & size) != 0)
        def _():
            self._piece(j, m, size, at, want, start)

    def _chunk(self, j: int, step, start: bool) -> None:
        """Start (or wait for) the DMAs of chunk ``j`` of grid step ``step``."""
        want, lo, hi = self._rows(step * self.plan.nc + j)
        for m in range(self.plan.pool_groups):
            self._window(j, m, want, lo, hi - lo, start)

    def _window(self, j: int, m: int, want, lo, n, start: bool) -> None:
        """Value-head window ``m`` of chunk ``j``: its ``n`` rows from ``lo``, one DMA when they
        are the whole chunk (every chunk inside a request), one per set bit of ``n`` else."""
        C = self.plan.C

        @pl.when(n == C)
        def _():
            self._piece(j, m, C, jnp.int32(0), want, start)

        @pl.when((n > 0) & (n < C))
        def _():
            self._bits(j, m, n, lo, want, start)

    def _all(self, step, start: bool) -> None:
        """Start (or wait for) the DMAs of every chunk of grid step ``step``."""
        for j in range(self.plan.nc):
            self._chunk(j, step, start)

    def store(self, o: jax.Array) -> None:
        """Write the step's units ``o`` ``[U, C, G dv]`` f32: wait for the previous step's DMAs
        (the buffer's), stage o by value-head window, start this step's DMAs, and at the last
        step wait for them."""
        plan, step = self.plan, self.step
        G, hb, R = plan.pool_groups, plan.hb, plan.step_len

        @pl.when(step > 0)
        def _():
            self._all(step - 1, start=False)

        self.stage[...] = split_blocks(o.reshape(hb, R, plan.dv), G).astype(self.stage.dtype)
        self._all(step, start=True)

        @pl.when(step == pl.num_programs(2) - 1)
        def _():
            self._all(step, start=False)
