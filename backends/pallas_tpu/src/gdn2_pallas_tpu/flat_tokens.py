"""The pooled forward's token tiles read straight from the flat ``(1, T, H, d)`` arrays of a
ragged call, and its o written straight to the flat ``(1, T, HV, dv)`` output
(``plan.flat_tokens``; pooled.py has the row and the chunk table), so XLA moves no input into
the row and no output out of it.

Chunk ``c`` of the row wants the flat tokens ``want = c C + REL[c]`` to ``want + C``: where its
request's rows would start, the filler before a request and the padding after it included.
A grid step reads one window of ``nc C`` tokens per input (``pl.Element`` windows of the
token-major arrays, whose token axis is untiled, so any start is one DMA, pipelined like any
block) from the first token wanted by a chunk of the step with rows to read (:func:`step_table`,
computed in XLA and scalar-prefetched), and takes each chunk's ``C`` rows from it at a dynamic
row (an address: the window's token axis is its major one). The windows of consecutive chunks
differ by at most ``C`` tokens either way (``C`` inside a request; at a request's start, between
``2 - C`` and ``C``: the filler before it), so ``nc C`` tokens from the lowest hold every row a
step reads (from the first chunk's would too, the tokens being in order, but a request's filler
would then need a roll).
Near the ends of the array the window is clamped into it and a chunk's rows are rolled by what
their start misses the window by (``< C``). The kernel has two copies of a grid step, with and
without the rolls, and runs the first only where a chunk of the step needs it (a request within
a step of either end of the array): rolling every chunk by a traced shift, 0 nearly always,
cost 3% of the kernel, and a ``lax.cond`` around each roll more (its value is materialised for
both branches; TPU compiler static estimate, 8 prefills of 256 tokens, v5e: 1.44M cycles with
the conds, 1.39M rolling always, 1.34M without rolls). One window per chunk (``nc`` DMAs per
input and step) cost 1.6% more than one per step on v5e, 2.6% on v6e (2 prompts of 1024, H = 16,
HV = 32, float32). The rows ``[LO, HI)`` of a chunk are its request's tokens; the others (a
neighbour's, the decodes', the engine's padding: any value, NaN included) are replaced by zeros
after the activations (:meth:`FlatTokens.mask`), so they leave the state unchanged and never meet
another row. The arrays are padded to one step's window when shorter (``token_rows``).

Grouped value heads: v and w are read as the caller laid them out, ``(T, HV, dv)`` (the core's
``(T, H, G dv)`` view of them, a relayout on a TPU, and the backend's view back cancel in XLA),
``G`` windows of ``hb`` value heads per step, and joined in VMEM into the kernel head's ``G dv``
value columns (:func:`join_groups`). One window of ``hb G`` heads would be fewer DMAs, but the
static profile classifies it remote and prices the whole kernel at 0.

Grouped keys (``plan.key_groups = G``: b, g on the value heads, q and k with their own ``H / G``
heads): a step's ``hb`` value heads read the window of the ``hb`` key heads holding theirs
(shared by ``G`` steps) and take their part of it, each key head repeated ``G`` times in VMEM
(:meth:`FlatTokens.load_keys`, blocks.py section Grouped keys), so XLA repeats no key. Scalar
gates (``(T, heads)``, 4 bytes a head and token) are not read flat: XLA moves them into the
chunk-aligned row (vjp.py), and the kernel reads them as any scalar gate's ``(hb, nc C)`` block.

VMEM: a step's window is the one ``(nc C, hb, d)`` block of the padded row, double-buffered the
same way (plan.vmem_bytes counts it unchanged).

Output (:class:`FlatOutput`). Windows of neighbouring chunks overlap where a request starts or
ends, and two DMAs in flight to the same rows land in no set order, so each chunk writes only the
rows it owns (``WROWS``, pooled.py): a chunk inside a request all ``C`` (one DMA), the first and
last of a request the ``n < C`` rows of its request (one DMA per set bit of ``n``: at most ``log2
C``, every size static), and a step whose ``nc C`` rows are consecutive tokens, all written (nearly
every step; :func:`step_table`), one DMA per value-head window for all of them (chunk by chunk on
every step, the DMAs and branches cost 2.5% of the kernel on v5e). Every token of the output is
owned by exactly one chunk: a request's by its chunks, the others (the decodes' before the first
request, the engine's padding after the last) by the chunks after the last request's, which write
zeros (their inputs all zeroed); ``t_pad`` has room for them (two chunks more than the requests
need: the two ranges' partial chunks). A step's o is staged in VMEM as ``G`` value-head windows
``(nc C, hb, dv)``, the layout of ``(T, HV, dv)``: no relayout of o in XLA either. The DMAs run
behind the next step's compute (waited before its o is staged) and the last step's are waited at
its end. Estimate (v5e, 2 requests of 1024 tokens, H = 16, HV = 32, bf16): the kernel 528k -> 580k
cycles, the whole call 830k -> 668k (the gather, relayout and zeroing of o gone); with one window
per step and whole steps' o in one DMA, 580k -> 540k (float32: 1246k -> 1193k on v5e, 843k -> 792k
on v6e; the plain forward of the same two prompts, 1021k and 668k, has no padding steps: 16 grid
steps per head group to the pooled row's 18).
"""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2_pallas_tpu import pooled
from gdn2_pallas_tpu.blocks import I0, join_blocks, key_part, split_blocks
from gdn2_pallas_tpu.chunk_math import iota
from gdn2_pallas_tpu.plan import Plan

F32 = jnp.float32


def first_token(table, chunk, plan: Plan):
    """The flat token of chunk ``chunk``'s row 0 (negative, or past the end: filler rows); in
    the kernel on an SMEM table, or in XLA on the table and an array of chunks."""
    return chunk * plan.C + table[pooled.REL, chunk]


#: Rows of the step table (:func:`step_table`).
WINDOW, WHOLE = 0, 1


def step_table(table: jax.Array, plan: Plan) -> jax.Array:
    """``[2, n_steps]`` int32, in XLA from the ``[8, n_chunks]`` chunk table, per grid step:

    - ``WINDOW``: the first flat token of the step's input window (``nc C`` rows, module
      docstring): the first token wanted by a chunk of the step with rows to read, clamped into
      the array;
    - ``WHOLE``: the first flat token of the step's ``nc C`` rows of o when they are consecutive
      tokens, all written (every chunk inside a request, or of the zeros after the last: each
      writes all ``C`` rows, none starts a request; :class:`FlatOutput`), nearly every step; -1
      else.

    A scalar-prefetch operand of its own, read once per step: derived from the chunk table in
    the index maps (eight of them, each reading every chunk of the step), the window cost 1.5%
    of the kernel (TPU compiler static estimate, v5e, 2 prompts of 1024, H = 16, HV = 32,
    float32)."""
    chunk = jnp.arange(plan.t_pad // plan.C, dtype=jnp.int32)  # [n_chunks]
    shape = (plan.n_steps, plan.nc)
    first = first_token(table, chunk, plan).reshape(shape)  # [n_steps, nc]
    rows = (table[pooled.LO] < table[pooled.HI]).reshape(shape)
    none = plan.token_rows  # above the first token of every chunk with rows
    lowest = jnp.min(jnp.where(rows, first, none), axis=1)  # [n_steps]
    lowest = jnp.where(lowest == none, first[:, 0], lowest)  # no rows: any
    window = jnp.clip(lowest, 0, plan.token_rows - plan.step_len)
    at = first[:, :1] + plan.C * jnp.arange(plan.nc, dtype=jnp.int32)  # [n_steps, nc]
    all_rows = table[pooled.WROWS].reshape(shape) == 0
    inside = (first[:, 0] >= 0) & (first[:, 0] + plan.step_len <= plan.token_rows)
    whole = jnp.all(all_rows & (first == at), axis=1) & inside  # [n_steps]
    return jnp.stack([window, jnp.where(whole, first[:, 0], -1)]).astype(jnp.int32)


def _step_index(batch, head_group, step, table, steps, *, part: int, groups: int, hb: int):
    """Element offsets of part ``part`` of grid step ``step``'s window: ``(batch, src, first
    head, 0)``."""
    del table
    return (batch, steps[WINDOW, step], (head_group * groups + part) * hb, I0)


def _key_index(batch, head_group, step, table, steps, *, hb: int, groups: int):
    """Grouped keys: the element offsets of the window of ``hb`` key heads holding the key heads
    of ``head_group`` (blocks.py, section Grouped keys)."""
    del table
    return (batch, steps[WINDOW, step], jax.lax.div(head_group, np.int32(groups)) * hb, I0)


def key_specs(plan: Plan, d: int) -> list[pl.BlockSpec]:
    """q and k: :func:`in_specs`, or with grouped keys (``plan.key_groups``, q and k of their own
    ``H / G`` heads) the ``(nc C, hb, d)`` window of the ``hb`` key heads holding the step's."""
    if plan.key_groups == 1:
        return in_specs(plan, d)
    shape = (None, pl.Element(plan.step_len), pl.Element(plan.hb), pl.Element(d))
    return [pl.BlockSpec(shape, functools.partial(_key_index, hb=plan.hb, groups=plan.key_groups))]


def in_specs(plan: Plan, d: int, groups: int = 1) -> list[pl.BlockSpec]:
    """``G`` ``(nc C, hb, d / G)`` element windows per grid step (refs.py passes the array once
    per spec): for v and w, ``groups = G`` value heads per kernel head, read as the caller laid
    them out, ``(T, HV, dv)``, ``hb`` heads a window (a window of ``hb G`` heads is a DMA the
    TPU compiler's static profile classifies remote and prices at 0, the whole kernel with it)."""
    shape = (None, pl.Element(plan.step_len), pl.Element(plan.hb), pl.Element(d // groups))
    index = functools.partial(_step_index, groups=groups, hb=plan.hb)
    return [pl.BlockSpec(shape, functools.partial(index, part=m)) for m in range(groups)]


class FlatTokens:
    """In the kernel: the chunks of grid step ``step`` from the windows of :func:`in_specs`."""

    def __init__(self, plan: Plan, table, steps, step, roll: bool = False):
        self.plan, self.table, self.step, self.roll = plan, table, step, roll
        chunks = [step * plan.nc + j for j in range(plan.nc)]
        self.lo = [table[pooled.LO, c] for c in chunks]  # the step's chunks' request rows
        self.hi = [table[pooled.HI, c] for c in chunks]
        src = steps[WINDOW, step]  # the window's first flat token
        self.starts = []  # the window row of each chunk's first row read
        self.shifts = []  # the roll of each chunk's rows read, in [0, C): 0 unless clamped
        for c in chunks:
            at = first_token(table, c, plan) - src  # the window row of the chunk's row 0
            start = jnp.minimum(jnp.maximum(at, 0), plan.step_len - plan.C)
            shift = start - at  # row i of the chunk is row i - shift of the rows read
            self.starts.append(start)
            self.shifts.append(jnp.where(shift < 0, shift + plan.C, shift))  # no rem (profiler)

    def rolled(self, roll: bool) -> FlatTokens:
        """The same chunks, read with (``roll``) or without their rolls."""
        other = copy.copy(self)
        other.roll = roll
        return other

    def needs_roll(self):
        """Whether a chunk of the step with rows to read is not a slice of the window."""
        needs = jnp.bool_(False)
        for lo, hi, shift in zip(self.lo, self.hi, self.shifts, strict=True):
            needs = needs | ((lo < hi) & (shift != 0))
        return needs

    def _chunk(self, refs, j: int, groups: int) -> jax.Array:
        """Chunk ``j``'s rows ``[hb, C, G d]`` float32 (rows outside ``[LO, HI)`` unspecified):
        ``C`` rows of the window from a dynamic row (its untiled major axis: an address)."""
        rows = pl.ds(self.starts[j], self.plan.C)
        x = join_blocks([ref[rows] for ref in refs], groups).astype(F32)  # [hb, C, G d]
        return pltpu.roll(x, self.shifts[j], 1) if self.roll else x

    def load(self, refs, d: int, groups: int = 1) -> jax.Array:
        """The step's chunks as float32 units ``[U, C, d]`` (unit ``= head * nc + chunk``)."""
        plan = self.plan
        x = jnp.stack([self._chunk(refs, j, groups) for j in range(plan.nc)], axis=1)
        return x.reshape(plan.units, plan.C, d)  # [hb, nc, C, d] -> [U, C, d]

    def load_keys(self, refs, d: int, head_group) -> jax.Array:
        """q or k as float32 units ``[U, C, d]``: :meth:`load`, with grouped keys the key head of
        each of the step's heads (:func:`blocks.key_part`)."""
        x = self.load(refs, d)  # [U, C, d]
        if self.plan.key_groups == 1:
            return x
        plan = self.plan
        x = key_part(x.reshape(plan.hb, plan.step_len, d), plan, head_group)  # [hb, nc C, d]
        return x.reshape(plan.units, plan.C, d)

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

    def __init__(self, plan: Plan, table, steps, out, stage, sem, head_group, step):
        assert plan.C & (plan.C - 1) == 0, f"bt={plan.C} must be a power of two"
        self.plan, self.table, self.out, self.stage, self.sem = plan, table, out, stage, sem
        self.steps = steps
        self.head_group, self.step = head_group, step

    def _rows(self, chunk):
        """``(want, lo, hi)``: chunk ``chunk`` writes its rows ``[lo, hi)`` to the flat tokens
        ``want + lo ...``, kept inside the output whatever the table says."""
        plan = self.plan
        want = first_token(self.table, chunk, plan)
        code = self.table[pooled.WROWS, chunk]
        lo = jnp.maximum(code & pooled.ROW_MASK, -want)
        hi = jnp.minimum(plan.C - (code >> pooled.ROW_BITS), plan.token_rows - want)
        return want, lo, hi

    def _piece(self, j: int, m: int, size: int, at, want, start: bool) -> None:
        """Rows ``[at, at + size)`` of chunk ``j``, value-head window ``m``: start or wait
        (``j = 0, size = nc C``: the whole step's rows)."""
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
        """Start (or wait for) the DMAs of grid step ``step``: one per value-head window when
        the step's rows are consecutive and all written (:func:`step_table`), else chunk by chunk.
        The chunk by chunk path costs DMAs and branches on the scalar unit (per chunk and window,
        and per bit of a partial chunk's row count): taken on every step, 2.5% more of the kernel
        (TPU compiler static estimate, v5e, 2 prompts of 1024, H = 16, HV = 32, float32)."""
        want = self.steps[WHOLE, step]  # -1: not whole

        @pl.when(want >= 0)
        def _():
            for m in range(self.plan.pool_groups):
                self._piece(0, m, self.plan.step_len, jnp.int32(0), want, start)

        @pl.when(want < 0)
        def _():
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
