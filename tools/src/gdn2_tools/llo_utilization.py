"""``python -m gdn2_tools.llo_utilization``: what bounds a Pallas kernel's grid step on a TPU, from
the compiler's own schedule (deviceless, like ``gdn2 tpu-report --estimate``).

With ``--xla_jf_dump_to=DIR --xla_jf_dump_llo_text=true``, libtpu writes, per compiled op, the
LLO program after every pass; one file, ``*-static-per-bundle-utilization.txt``, lists for each
VLIW bundle of the scheduled program how many slots of each unit it uses (MXU, XLU, VALU, VPOP,
EUP, loads, stores; their capacities in its header). A kernel's program is one grid step (the
grid is a loop around it), so the bundle count is the step's static length, and a unit's slots
over its capacity is the fewest cycles that unit alone needs: the largest of those is the step's
bound, the others say how much of it each unit could hide. ``VSTORE:SPILL`` and ``VLOAD:FILL``
count the register spills inside ``VSTORE`` and ``VLOAD``. ``--segments N`` prints each unit's
busy fraction over N equal stretches of the step, in program order (the phases of a step show
as stretches bound by different units).

These are the compiler's static schedule, not a measurement, like every TPU figure here.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence

from gdn2_tools import static_profile

#: The file of a dumped op that holds its per-bundle slot use (its number varies with the passes).
UTILIZATION_GLOB = "*-{op}-*static-per-bundle-utilization.txt"


@dataclasses.dataclass(frozen=True)
class Utilization:
    """Per-bundle slot use of one kernel's program: ``units`` names, their ``capacity`` per
    bundle, and ``rows[i][j]`` the slots of unit j that bundle i uses."""

    units: tuple[str, ...]
    capacity: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...]

    @property
    def bundles(self) -> int:
        return len(self.rows)

    def slots(self, j: int, rows: Sequence[tuple[int, ...]] | None = None) -> int:
        return sum(r[j] for r in (self.rows if rows is None else rows))

    def min_cycles(self, j: int) -> float:
        """The fewest cycles unit j needs for its slots (at its capacity every bundle)."""
        return self.slots(j) / self.capacity[j]

    def segments(self, n: int) -> list[tuple[int, list[float]]]:
        """``n`` equal stretches of the program: (first bundle, each unit's busy fraction)."""
        size = max(1, self.bundles // n)
        out = []
        for start in range(0, size * n, size):
            part = self.rows[start : start + size]
            if part:
                busy = [self.slots(j, part) / (c * len(part)) for j, c in enumerate(self.capacity)]
                out.append((start, busy))
        return out


def parse(text: str) -> Utilization:
    """The ``*-static-per-bundle-utilization.txt`` text: a ``== CAPACTIY:`` header (libtpu's
    spelling) with the unit names and their capacities, then ``== UTILIZATION:`` and one line of
    slot counts per bundle."""
    lines = [ln.strip() for ln in text.splitlines()]
    head = next(i for i, ln in enumerate(lines) if ln.startswith("== CAPAC"))
    units = tuple(u.strip() for u in lines[head + 1].split(","))
    capacity = tuple(int(x) for x in lines[head + 2].split())
    if len(units) != len(capacity):
        raise ValueError(f"{len(units)} unit names but {len(capacity)} capacities")
    start = next(i for i, ln in enumerate(lines) if ln.startswith("== UTILIZATION"))
    rows = tuple(
        tuple(int(x) for x in ln.split())
        for ln in lines[start + 1 :]
        if ln and re.fullmatch(r"[0-9 ]+", ln)
    )
    if any(len(r) != len(units) for r in rows):
        raise ValueError(f"a bundle line without {len(units)} counts")
    return Utilization(units, capacity, rows)


def report(u: Utilization, segments: int = 0) -> str:
    lines = [f"{u.bundles} bundles in the step's program (its static length in cycles)"]
    for j, name in enumerate(u.units):
        lines.append(
            f"  {name:14s} capacity {u.capacity[j]}  slots {u.slots(j):8d}  "
            f"needs >= {u.min_cycles(j):8.0f} cycles"
        )
    for start, busy in u.segments(segments) if segments else ():
        shown = ", ".join(f"{name} {b:.2f}" for name, b in zip(u.units, busy, strict=True))
        lines.append(f"  from bundle {start:6d}: {shown}")
    return "\n".join(lines)


def read_dump(directory: str, op: str) -> Utilization | None:
    """The utilization of ``op``'s scheduled program in the LLO dump in ``directory``
    (:func:`gdn2_tools.static_profile.llo_dump_flags`), or None without its file."""
    found = sorted(glob.glob(os.path.join(directory, UTILIZATION_GLOB.format(op=op))))
    if not found:
        return None
    with open(found[0]) as f:
        return parse(f.read())


def measure(program: static_profile.Program, tpu: str, kernel: str) -> Utilization:
    """Compile ``program`` for ``tpu`` (in a child process) with the LLO dump of the Pallas
    kernel whose HLO name starts with ``kernel`` (e.g. ``gdn2_bwd``) and read its utilization."""
    work = tempfile.mkdtemp(prefix="gdn2_llo_")
    try:
        code, log = static_profile._compile_child(program, tpu, work, [], 1800, 12.0)
        if code != 0:
            raise RuntimeError(f"the compile failed ({code}):\n{log[-2000:]}")
        kernels = json.loads(static_profile._read(work, "meta.json"))["kernels"]
        ops = [n for n in kernels if n.split(".")[0] == kernel]
        if not ops:
            raise ValueError(f"no kernel named {kernel}.N in the compiled program: {kernels}")
        dump = os.path.join(work, "llo")
        flags = [*static_profile.llo_dump_flags(dump), f"{static_profile.ONLY_FLAG}{ops[0]}=true"]
        code, log = static_profile._compile_child(program, tpu, work, flags, 1800, 12.0)
        u = read_dump(dump, ops[0])
        if u is None:
            raise RuntimeError(f"libtpu wrote no utilization file for {ops[0]} ({code})")
        return u
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gdn2_tools.llo_utilization", description=__doc__)
    ap.add_argument("--kernel", default="gdn2_fwd", help="the kernel's name (default gdn2_fwd)")
    ap.add_argument("--mode", default="forward", choices=("forward", "train"))
    ap.add_argument("--backend", default="pallas_tpu")
    ap.add_argument("-B", type=int, default=1)
    ap.add_argument("-T", type=int, default=1024)
    ap.add_argument("-H", type=int, default=6)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--tpu", default="v5e", choices=sorted(static_profile.CLOCK_HZ))
    ap.add_argument("--segments", type=int, default=0, help="busy fractions over N stretches")
    args = ap.parse_args(argv)
    program = static_profile.Program(
        args.backend, args.mode, args.B, args.T, args.H, args.dk, args.dv, args.dtype
    )
    u = measure(program, args.tpu, args.kernel)
    print(f"{args.kernel} ({args.mode}, B={args.B} T={args.T} H={args.H}, {args.dtype}, "
          f"{args.tpu}): {static_profile.LABEL}")  # fmt: skip
    print(report(u, args.segments))
    return 0


if __name__ == "__main__":
    sys.exit(main())
