"""Honest timing of compiled JAX programs.

Compilation (``jit(f).lower(*args).compile()``) is timed on its own and never mixed with run time.
Every program is run once before timing (the warm-up; its outputs feed the correctness gate), then
``repeats`` times, each call followed by ``jax.block_until_ready``. We report the median with the
min/max and the interquartile range of the repeats, and the time per call of as many calls
dispatched back to back with one wait at the end (``pipelined_s``, :func:`time_pipelined`): a
training loop's way, where the host's dispatch and wait overlap the device's work (on a TPU v5e a
blocking call added 0.75 to 0.9 ms to programs of 1 to 16 ms, docs/results.md).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass
class Timing:
    """Compile time and run times (seconds) of one program."""

    compile_s: float
    times_s: list[float] = dataclasses.field(default_factory=list)
    pipelined_s: float | None = None  # per call, back to back (time_pipelined)

    @property
    def median_s(self) -> float:
        return float(np.median(self.times_s)) if self.times_s else float("nan")

    def as_dict(self) -> dict[str, Any]:
        t = np.asarray(self.times_s, dtype=np.float64)
        has = t.size > 0
        return {
            "compile_s": self.compile_s,
            "median_s": float(np.median(t)) if has else None,
            "min_s": float(t.min()) if has else None,
            "max_s": float(t.max()) if has else None,
            "p25_s": float(np.percentile(t, 25)) if has else None,
            "p75_s": float(np.percentile(t, 75)) if has else None,
            "repeats": int(t.size),
            "times_s": [float(x) for x in t],
            "pipelined_s": self.pipelined_s,
        }


def compile_program(fn: Callable, *args, static_argnums: Sequence[int] = ()) -> tuple[Any, float]:
    """``(compiled, seconds)``: ahead-of-time compile of ``jax.jit(fn)`` for ``args``."""
    start = time.perf_counter()
    compiled = jax.jit(fn, static_argnums=tuple(static_argnums)).lower(*args).compile()
    return compiled, time.perf_counter() - start


def run_once(compiled, *args) -> Any:
    """One blocking call: the warm-up, whose outputs the gate checks."""
    return jax.block_until_ready(compiled(*args))


def time_repeats(compiled, args: Sequence, repeats: int) -> list[float]:
    """Wall-clock seconds of ``repeats`` blocking calls (after a warm-up done by the caller)."""
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        out = compiled(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
        del out
    return times


def time_pipelined(compiled, args: Sequence, calls: int) -> float:
    """Seconds per call of ``calls`` calls dispatched back to back with one wait at the end (as a
    training loop runs them: the host's dispatch and the wait for a result overlap the device's
    work), after a warm-up done by the caller. Each call's outputs are dropped when the next is
    dispatched (no more than two calls' outputs held at once); the device runs the calls in
    order, so the last one's being ready means all are."""
    calls = max(1, calls)
    start = time.perf_counter()
    out = None
    for _ in range(calls):
        out = compiled(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls
