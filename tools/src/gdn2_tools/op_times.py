"""Per-op time of a compiled program from a profiler trace: where a measured call's time goes.

``op_times(compiled, args, calls)`` runs the program ``calls`` times under ``jax.profiler.trace``
and reads the trace (``jax.profiler.ProfileData``): on an accelerator, the events of the device
planes' ``XLA Ops`` lines (one per executed HLO op, which a TPU trace names by its HLO text; kept
here as the op's name, a Pallas kernel's its custom call's, e.g. ``gdn2_bwd.1``) and of their
``XLA Modules`` lines (one per executed program); on a CPU, the XLA execute threads of the host
plane. Summed durations divided by ``calls``: milliseconds per call. A measurement of the device
at hand, not an estimate; the ops' sum is below the module's time by the device's gaps between
ops, and that below the call's wall clock by what the host adds (dispatch, the wait for the
result).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import tempfile
from collections.abc import Sequence
from typing import Any, Final

import jax

#: The device planes' line of executed HLO ops (TPU and GPU traces).
OPS_LINE: Final = "XLA Ops"
#: The device planes' line of executed programs.
MODULES_LINE: Final = "XLA Modules"
#: The host plane's XLA threads (a CPU trace's ops).
HOST_OPS_PREFIX: Final = "tf_XLAExecute"


def _is_op(name: str) -> bool:
    """An HLO op's event, not the host runtime's (``ThreadpoolListener::StartRegion``,
    ``SlinkyThreadPool::Await``, ``end: ...``): HLO names hold no ``::``."""
    return "::" not in name and not name.startswith("end: ")


@dataclasses.dataclass(frozen=True)
class OpTimes:
    """``ms``: op name -> milliseconds per call, largest first; ``module_ms``: the device's
    programs per call (None without device planes); ``lines``: every plane's lines seen,
    ``plane/line``, so that a trace laid out otherwise shows what it held."""

    ms: dict[str, float]
    module_ms: float | None
    lines: tuple[str, ...]


def op_name(event: str) -> str:
    """An op's name from its event's: a TPU trace names an op by its HLO text (``%gdn2_bwd.1 =
    (bf16[...]) custom-call(...)``), a CPU trace by its name."""
    return event.split(" = ", 1)[0].lstrip("%")


def _is_op_line(plane: str, line: str) -> bool:
    if plane.startswith("/device:"):
        return line == OPS_LINE
    return plane.startswith("/host:CPU") and line.startswith(HOST_OPS_PREFIX)


def from_profile(profile: Any, calls: int) -> OpTimes:
    """Per-op milliseconds per call of a ``jax.profiler.ProfileData`` of ``calls`` calls. The
    device planes' ops when the trace has any, else the host's (a CPU run)."""
    if calls < 1:
        raise ValueError(f"calls: expected at least 1, got {calls}")
    planes = [(p.name, [(ln.name, list(ln.events)) for ln in p.lines]) for p in profile.planes]
    on_device = any(
        name.startswith("/device:") and any(ln == OPS_LINE for ln, _ in lines)
        for name, lines in planes
    )
    totals: collections.Counter[str] = collections.Counter()
    module_ns = None
    for plane, lines in planes:
        if on_device and not plane.startswith("/device:"):
            continue
        for line, events in lines:
            if on_device and line == MODULES_LINE:
                module_ns = (module_ns or 0.0) + sum(e.duration_ns for e in events)
            if not _is_op_line(plane, line):
                continue
            for e in events:
                if _is_op(e.name):
                    totals[op_name(e.name)] += e.duration_ns
    ms = {name: ns / 1e6 / calls for name, ns in totals.most_common()}
    seen = tuple(f"{plane}/{line}" for plane, lines in planes for line, _ in lines)
    module_ms = None if module_ns is None else module_ns / 1e6 / calls
    return OpTimes(ms, module_ms, seen)


def op_times(compiled: Any, args: Sequence[Any], calls: int) -> OpTimes:
    """Run ``compiled(*args)`` ``calls`` times (blocking on each) under a profiler trace and read
    its per-op times (:func:`from_profile`). Warm the program up first: a first call's one-off
    work would count."""
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            for _ in range(calls):
                jax.block_until_ready(compiled(*args))
        files = glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)
        if len(files) != 1:
            raise RuntimeError(f"expected one *.xplane.pb in the trace, found {files}")
        profile = jax.profiler.ProfileData.from_file(files[0])
        return from_profile(profile, calls)
