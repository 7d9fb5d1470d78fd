"""Asynchronous writes of carried states to HBM, overlapped with the chunks that follow.

The packed kernels write a state to HBM at some chunk boundaries: the pooled forward a request's
final state and its checkpoints (pooled.py), the packed forward a sequence's final state and the
backward its ``dh0`` (varlen.py). A write started and waited at once stalls the state pass for the
whole DMA (a ``[hb, K, V]`` float32 state of 8 heads is 512 KiB, ~0.6 us of v5e HBM time); a
write at every chunk made the pooled forward 1.35x slower in the v5e estimate, 1.04x this way
(docs/results.md, section Serving). Here the state is staged into one of ``DEPTH`` VMEM buffers
(chunk ``j`` uses buffer ``j % DEPTH``) and its DMA started; it is waited only when the buffer is
needed again, ``DEPTH`` chunks later, or at the end of the grid's sequential axis, so the DMA runs
under the next chunks' compute.

Which DMAs are in flight is data-dependent (the chunk table says which chunks write), so an SMEM
counter per buffer counts the DMAs started from it and not yet waited (a request that ends on a
checkpoint writes the same staged state twice: at most :data:`MOST_PER_BUFFER`). The counters are
zeroed at the first step of the sequential axis: every buffer was drained at the last step of the
previous run of that axis on the core, and a core's SMEM is uninitialised when the kernel starts.

The reads stay synchronous (a state is needed before the chunk that reads it can start) and use
their own buffer, so a read never waits on a write.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

#: Staging buffers: a write is waited ``DEPTH`` chunks after it was started.
DEPTH: Final = 2
#: DMAs one staged state may feed: a request's final state and the checkpoint at the same chunk.
MOST_PER_BUFFER: Final = 2


def scratch_shapes(shape: tuple[int, ...], dtype) -> tuple:
    """The scratch of :class:`StateWrites` for states staged as ``shape`` in ``dtype``:
    ``(buffers [DEPTH, *shape], DMA semaphores [DEPTH], counters SMEM [DEPTH] int32)``."""
    return (
        pltpu.VMEM((DEPTH, *shape), dtype),
        pltpu.SemaphoreType.DMA((DEPTH,)),
        pltpu.SMEM((DEPTH,), jnp.int32),
    )


def vmem_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """VMEM bytes of the staging buffers of ``shape`` (the counters are SMEM)."""
    return DEPTH * itemsize * math.prod(shape)


class StateWrites:
    """In a kernel: states written to HBM without waiting (module docstring).

    ``bufs``, ``sems``, ``pending``: the scratch of :func:`scratch_shapes`; ``like``: an HBM ref
    of the staged shape (any destination: a wait needs only the DMA's size); ``seq_axis``: the
    grid's sequential axis."""

    def __init__(self, bufs, sems, pending, like, seq_axis: int = 2):
        self.bufs, self.sems, self.pending, self.like = bufs, sems, pending, like
        step, n_steps = pl.program_id(seq_axis), pl.num_programs(seq_axis)

        @pl.when(step == 0)
        def _():
            for i in range(DEPTH):
                self.pending[i] = jnp.int32(0)

        self._last = step == n_steps - 1

    def _drain(self, i: int) -> None:
        """Wait for every DMA in flight from buffer ``i``."""
        started = self.pending[i]
        for n in range(MOST_PER_BUFFER):

            @pl.when(started > n)
            def _():
                pltpu.make_async_copy(self.bufs.at[i], self.like, self.sems.at[i]).wait()

        self.pending[i] = jnp.int32(0)

    def stage(self, j: int, fill: Callable[[jax.Array], None]) -> None:
        """Chunk ``j``'s buffer, drained, filled by ``fill(buffer ref)``."""
        i = j % DEPTH
        self._drain(i)
        fill(self.bufs.at[i])

    def start(self, j: int, dst) -> None:
        """The DMA of chunk ``j``'s staged state to the HBM ref ``dst``, not waited."""
        i = j % DEPTH
        pltpu.make_async_copy(self.bufs.at[i], dst, self.sems.at[i]).start()
        self.pending[i] = self.pending[i] + 1

    def close(self) -> None:
        """At the last step of the sequential axis: wait for every write still in flight."""

        @pl.when(self._last)
        def _():
            for i in range(DEPTH):
                self._drain(i)
