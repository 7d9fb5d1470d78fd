"""The ragged op's packed requests against the pool (``Capabilities.pooled``,
gdn2core.features.pooled): the forward kernel reads each request's start from its slot and writes
its final and checkpoint states to theirs by DMA (the writes not waited: state_writes.py), the
pool aliased in place.

Layout: each request starts at a chunk boundary of a row of ``t_pad`` positions, after
``positions % C`` filler positions (empty rows: the state passes unchanged), so every absolute
position that is a multiple of ``C``, and so every checkpoint (``stored_every`` a multiple of
``C``), is the end of a chunk. A request wastes at most ``2 C - 2`` positions (the filler and its
last chunk's padding; ``C - 1`` without checkpoints, where there is no filler), an empty one
none: the row's static length is ``t_pad >= T + N C`` (``2 N C`` with checkpoints; two chunks
more with flat tokens, below). Tokens of no request (the decodes' before the first request, the
padding after the last) are not placed.

The tokens are not moved to that row. With the token-major layout (``plan.flat_tokens``: H a
multiple of 8) the kernel reads each chunk straight from the flat ``(T, H, d)`` arrays at the
token where its row would start (flat_tokens.py), zeroes the rows that are not its request's,
and writes o's rows of its request at the flat tokens, ``(T, HV, dv)``; the chunks after the
last request's write zeros over the tokens of no request. A head-major call (H not a multiple
of 8) cannot: its token axis is the tiled second-minor one, where the TPU compiler takes no
unaligned window ("Couldn't prove that tiling (8) divides index"), so XLA moves its inputs into
the row first (``varlen.to_padded``, :attr:`Layout.source`) and o out of it
(:func:`from_padded`).

The chunk table (SMEM, ``[8, n_chunks]`` int32, scalar-prefetched: the index maps read it) says
per chunk:

- ``READ``, ``MODE``: at a request's first chunk the state is its slot ``READ`` (``MODE`` =
  ``FROM_SLOT``), zeros (``FROM_ZEROS``) or NaN (``FROM_NAN``); elsewhere (``CARRY``) the state the
  chunk before left.
- ``OUT``: one more than the slot the state leaving the chunk goes to (a request's last chunk),
  0: none.
- ``CKPT``: one more than the checkpoint slot of the state leaving the chunk, 0: none (the same
  chunk may have both: a request ending on a checkpoint).
- ``REL``: the flat token of the chunk's row 0, less the chunk's own start ``c C`` (0 for a
  request that is where the row puts it); ``LO``, ``HI``: the chunk's rows ``[LO, HI)`` are its
  request's tokens, the others are zeroed (``LO = HI = 0``: a chunk of no request, or of a
  padded request, whose o is zero).
- ``WROWS``: the rows of o the chunk writes at the flat tokens (flat tokens only), as the rows
  skipped before and after them, ``front | back << ROW_BITS``: a request's ``[LO, HI)``, a
  padded one's included; for the chunks after the last request's, ``C`` tokens at a time, first
  those before the first request, then those from its end to ``T`` (zeros: their inputs are all
  zeroed).

Zero means "nothing" in every row but ``WROWS``, where it means all ``C`` rows, so a table of
zeros moves no state and reads and writes the tokens in order: the TPU compiler's static profile
simulates the kernel with such a table and so prices the token reads and o writes of a plain
forward and no slot DMA (``gdn2 bench --serve`` prices those by a model of its own).

The pool is viewed as ``[P, H, G, K, dv]`` (a free reshape): kernel head ``h`` holds the ``G``
value heads ``h G ... h G + G - 1`` of a grouped call side by side in its ``G dv`` value columns,
so a slot moves by ``G`` DMAs between HBM and the ``dv`` value columns of the carried state. Slots are distinct across a call's requests (the core's rules), so the reads
of the input ref and the writes of the aliased output ref never meet.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Final

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2core.plugin import FROM_ZEROS as START_ZEROS
from gdn2core.plugin import PoolRequests, count_at_most

READ, MODE, OUT, CKPT, REL, LO, HI, WROWS = range(8)  # rows of the chunk table
CARRY, FROM_SLOT, FROM_ZEROS, FROM_NAN = 0, 1, 2, 3  # MODE values
ROWS: Final = 8
#: WROWS packs the rows a chunk skips before and after the ones it writes: ``front | back <<
#: ROW_BITS`` (zero: all ``C``, as a plain forward writes).
ROW_BITS: Final = 16
ROW_MASK: Final = (1 << ROW_BITS) - 1


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the tokens go (arrays computed under jit); as varlen.Layout (``varlen.to_padded``
    moves the tokens of a head-major call), with ``placed`` for :func:`from_padded`."""

    position: jax.Array  # [T] int32: each token's position in the row (t_pad: not placed)
    placed: jax.Array  # [T] bool: the token belongs to a request, not a padded one
    source: jax.Array  # [t_pad] int32: the token at every position (T: a filler token)
    table: jax.Array  # [8, t_pad / C] int32: READ, MODE, OUT, CKPT, REL, LO, HI, WROWS per chunk


def layout(cu_seqlens, requests: PoolRequests, seq_len: int, C: int, t_pad: int) -> Layout:
    """The layout of the requests ``cu_seqlens`` (``N + 1`` offsets into T tokens) and the chunk
    table of their slots (module docstring)."""
    cu = cu_seqlens.astype(jnp.int32)
    n = cu.shape[0] - 1
    lens = cu[1:] - cu[:-1]  # [N]
    if requests.stores:
        front = jnp.where(lens > 0, requests.positions % C, 0)  # [N] filler before request n
    else:
        front = jnp.zeros_like(lens)
    chunks = (front + lens + C - 1) // C  # [N]: an empty request owns no chunk
    end_chunk = jnp.cumsum(chunks)  # [N]
    first_chunk = end_chunk - chunks  # [N]
    token = jnp.arange(seq_len, dtype=jnp.int32)  # [T]
    req = count_at_most(cu[1:], token)  # [T], N: after all
    placed = (token >= cu[0]) & (req < n)
    rq = jnp.minimum(req, n - 1)
    padded = (requests.writes[rq] < 0) & (requests.starts[rq] == START_ZEROS)
    placed = placed & ~padded  # a padded request's o is zero (Backend.forward_pooled)
    position = jnp.where(placed, first_chunk[rq] * C + front[rq] + token - cu[rq], t_pad)
    source = jnp.full((t_pad,), seq_len, jnp.int32).at[position].set(token, mode="drop")

    n_chunks = t_pad // C
    chunk = jnp.arange(n_chunks, dtype=jnp.int32)
    rc = count_at_most(end_chunk, chunk)  # [n_chunks]
    used = rc < n  # a chunk of a request (the one of its first chunk has chunks > 0)
    rc = jnp.minimum(rc, n - 1)
    dropped = (requests.writes[rc] < 0) & (requests.starts[rc] == START_ZEROS)  # padded: o zero
    first = used & (chunk == first_chunk[rc])
    last = used & (chunk == end_chunk[rc] - 1)
    start = requests.starts[rc]  # [n_chunks]
    mode = jnp.where(start >= 0, FROM_SLOT, jnp.where(start == START_ZEROS, FROM_ZEROS, FROM_NAN))
    mode = jnp.where(first, mode, CARRY)
    read = jnp.where(first & (start >= 0), start, 0)
    out = jnp.where(last, requests.writes[rc] + 1, 0)  # slot + 1, 0: none
    # The flat token of each chunk's row 0, and its rows that are its request's tokens.
    want = cu[rc] - front[rc] + (chunk - first_chunk[rc]) * C  # [n_chunks]
    lo = jnp.where(used, jnp.clip(cu[rc] - want, 0, C), 0)
    hi = jnp.where(used, jnp.clip(cu[rc + 1] - want, 0, C), 0)
    # The chunks of no request write zeros: the first the tokens before cu[0], then those from
    # cu[N] on, C at a time (t_pad leaves room: flat_tokens.py, section Output).
    head = (cu[0] + C - 1) // C
    u = chunk - end_chunk[-1]  # [n_chunks] >= 0: a chunk of no request
    z_want = jnp.where(u < head, u * C, cu[n] + (u - head) * C)
    z_rows = jnp.clip(jnp.where(u < head, cu[0], seq_len) - z_want, 0, C)
    rel = jnp.where(used, want, z_want) - chunk * C
    w_hi = jnp.where(used, hi, z_rows)
    wrows = lo | ((C - w_hi) << ROW_BITS)  # [n_chunks]: rows [lo, w_hi) of o written
    lo, hi = jnp.where(dropped, 0, lo), jnp.where(dropped, 0, hi)  # a padded request reads none
    ckpt = jnp.zeros((n_chunks,), jnp.int32)
    if requests.stores:
        local, slot = requests.stored_tokens, requests.stored_slots  # [N, M]
        at = first_chunk[:, None] + (front[:, None] + local) // C  # [N, M] the chunk it ends
        keep = (local >= 0) & (slot >= 0)
        ckpt = ckpt.at[jnp.where(keep, at, n_chunks)].set(slot + 1, mode="drop")
    table = jnp.stack([read, mode, out, ckpt, rel, lo, hi, wrows]).astype(jnp.int32)
    return Layout(position.astype(jnp.int32), placed, source, table)


def flat_row(x: jax.Array, rows: int) -> jax.Array:
    """The flat ``(1, T, H, d)`` tokens as the kernel reads them (flat_tokens.py): unchanged, or
    zero padded to ``rows`` when ``T < rows`` (a grid step's window, ``nc C`` tokens)."""
    pad = rows - x.shape[1]
    return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad > 0 else x


def from_padded(y: jax.Array, lay: Layout) -> jax.Array:
    """(1, t_pad, H, d) -> (1, T, H, d), zero on the tokens of no request or a padded one."""
    got = y[:, jnp.minimum(lay.position, y.shape[1] - 1)]
    return jnp.where(lay.placed[None, :, None, None], got, 0).astype(y.dtype)


class PoolStates:
    """In the forward kernel: the pool's slots of the chunks of one grid step.

    ``table`` the SMEM chunk table; ``pool_in`` and ``pool_out`` the ``[P, H, G K, dv]`` pool in
    HBM (one buffer, aliased), float32 or bfloat16; ``buf`` a ``[hb, G K, dv]`` VMEM buffer in
    the pool's dtype and ``sem`` one DMA semaphore, for the reads; ``writes`` the
    :class:`state_writes.StateWrites` of the final and checkpoint states (staged as ``buf``,
    not waited). The carried state is float32: a slot is widened when read and rounded once when
    written."""

    def __init__(self, plan, table, pool_in, pool_out, buf, sem, writes, head_group, step):
        self.plan, self.table, self.buf, self.sem = plan, table, buf, sem
        self.pool_in, self.pool_out, self.writes = pool_in, pool_out, writes
        self.head_group, self.step = head_group, step

    def _row(self, row: int, j: int):
        return self.table[row, self.step * self.plan.nc + j]

    def slot(self, pool, slot):
        """The step's heads of slot ``slot``: ``[hb, G K, dv]`` in HBM."""
        return pool.at[slot, pl.ds(self.head_group * self.plan.hb, self.plan.hb)]

    def _groups(self):
        """``(value columns of the carried state, rows of the slot)`` of each value head of a
        kernel head's group."""
        G, K = self.plan.pool_groups, self.plan.dk
        dv = self.plan.dv // G
        return [(slice(i * dv, (i + 1) * dv), slice(i * K, (i + 1) * K)) for i in range(G)]

    def enter(self, j: int, state) -> None:
        """``state`` (the carried ``[hb, K, G dv]`` ref) set as chunk ``j``'s MODE says."""
        mode = self._row(MODE, j)

        @pl.when(mode == FROM_SLOT)
        def _():
            copy = pltpu.make_async_copy(self.slot(self.pool_in, self._row(READ, j)), self.buf,
                                         self.sem)  # fmt: skip
            copy.start()
            copy.wait()
            for cols, rows in self._groups():
                state[:, :, cols] = self.buf[:, rows].astype(state.dtype)  # [hb, K, dv]

        @pl.when(mode >= FROM_ZEROS)
        def _():
            fill = jnp.where(mode == FROM_ZEROS, 0.0, jnp.nan).astype(state.dtype)
            state[...] = jnp.full(state.shape, fill, state.dtype)

    def leave(self, j: int, state) -> None:
        """The state leaving chunk ``j`` (``state``, ``[hb, K, G dv]`` f32) to its OUT and CKPT
        slots: staged once, one DMA per slot, waited chunks later (state_writes.py)."""
        entries = [self._row(OUT, j)]
        if self.plan.pool_checkpoints:  # compiled out without: a DMA in a branch still costs
            entries.append(self._row(CKPT, j))
        staged = functools.reduce(operator.or_, [entry > 0 for entry in entries])

        def fill(buf):  # [hb, G K, dv] in the pool's dtype
            for cols, rows in self._groups():
                buf[:, rows] = state[:, :, cols].astype(buf.dtype)  # rounded once

        @pl.when(staged)
        def _():
            self.writes.stage(j, fill)

        for entry in entries:  # pool[entry - 1] = state when entry > 0
            self._start(j, entry)

    def _start(self, j: int, entry) -> None:
        @pl.when(entry > 0)
        def _():
            self.writes.start(j, self.slot(self.pool_out, entry - 1))
