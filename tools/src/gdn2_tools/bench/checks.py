"""Acceptance targets of the backend ``backend="auto"`` picks here (the fallback on a CPU host),
checked on the rows of one run (speed) or of one memory report. Rows are chosen by capability:
the subject is :func:`~gdn2_tools.bench.runner.trusted_backend`, the baselines are reference_grad
and every named-only backend."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gdn2_tools.bench.programs import REFERENCE_ROW
from gdn2_tools.bench.runner import RowResult, baselines
from gdn2_tools.bench.shapes import ACCEPT_REF, ACCEPT_SCAN, PACKED_MAX_RATIO, BenchShape


@dataclasses.dataclass(frozen=True)
class SpeedTarget:
    """``subject``'s ``mode`` median at ``shape`` is at least ``need`` times faster than the
    baseline's."""

    baseline: str
    mode: str
    shape: BenchShape
    need: float

    def describe(self, subject: str) -> str:
        """The target in words."""
        if self.need == 1.0:
            return f"{subject} {self.mode} no slower than {self.baseline} {self.mode}"
        return f"{subject} {self.mode} >= {self.need:g}x {self.baseline}"


def speed_targets() -> list[SpeedTarget]:
    """The speed targets: against the reference, and against every named-only baseline.

    Returns:
        The targets.
    """
    targets = [
        SpeedTarget(REFERENCE_ROW, "fwdbwd", ACCEPT_REF, 4.0),
        SpeedTarget(REFERENCE_ROW, "fwd", ACCEPT_REF, 1.0),
    ]
    targets += [SpeedTarget(b, "fwdbwd", ACCEPT_SCAN, 20.0) for b in baselines()[1:]]
    return targets


@dataclasses.dataclass(frozen=True)
class Check:
    """One target's verdict on one run."""

    name: str
    shape: BenchShape
    dtype: str
    passed: bool
    detail: str

    def line(self) -> str:
        """``PASS|FAIL  name [shape, dtype]: detail``."""
        verdict = "PASS" if self.passed else "FAIL"
        return f"{verdict}  {self.name} [{self.shape.label}, {self.dtype}]: {self.detail}"

    def as_dict(self) -> dict:
        """The JSON form."""
        return {
            "name": self.name,
            "shape": self.shape.as_dict(),
            "dtype": self.dtype,
            "passed": self.passed,
            "detail": self.detail,
        }


def speed_checks(results: Sequence[RowResult], subject: str | None) -> list[Check]:
    """One check per target and dtype where both rows were timed in this run.

    Args:
        results: the rows.
        subject: the backend the targets are about (None: no checks).

    Returns:
        The checks.
    """
    if subject is None:
        return []
    index = {(r.backend, r.shape, r.dtype): r for r in results if r.source == "this run"}
    dtypes = sorted({r.dtype for r in results})
    checks = []
    for target in speed_targets():
        for dtype in dtypes:
            mine = index.get((subject, target.shape, dtype))
            theirs = index.get((target.baseline, target.shape, dtype))
            if mine is None or theirs is None:
                continue
            tm, tb = mine.median(target.mode), theirs.median(target.mode)
            if tm is None or tb is None:
                continue
            ratio = tb / tm
            detail = (
                f"{subject} {target.mode} {tm * 1e3:.2f} ms vs {target.baseline} {tb * 1e3:.2f} "
                f"ms: {ratio:.2f}x (need >= {target.need:g}x)"
            )
            desc = target.describe(subject)
            checks.append(Check(desc, target.shape, dtype, ratio >= target.need, detail))
    return checks


def feature_checks(results: Sequence[RowResult], subject: str | None) -> list[Check]:
    """``subject``'s model-feature rows against their plain counterparts in the same run (fwd+bwd
    medians): a packed row (``seqs > 1``) against the unpacked row of the same B*T (target:
    at most :data:`~gdn2_tools.bench.shapes.PACKED_MAX_RATIO` times its time), and a grouped row
    (``HV``) against the plain call on repeated heads (``H = HV``; target: faster).

    Args:
        results: the rows.
        subject: the backend the targets are about (None: no checks).

    Returns:
        The checks (none when a counterpart is missing).
    """
    if subject is None:
        return []
    index = {(r.backend, r.shape, r.dtype): r for r in results if r.source == "this run"}
    checks = []
    for (name, shape, dtype), row in index.items():
        if name != subject or not shape.features:
            continue
        if shape.seqs > 1 and not shape.HV:
            base = dataclasses.replace(shape, seqs=1)
            what, need = "packed / unpacked fwd+bwd time", PACKED_MAX_RATIO
        elif shape.HV and shape.seqs == 1:
            base = dataclasses.replace(shape, H=shape.HV, HV=0)
            what, need = "grouped / repeated-heads fwd+bwd time", 1.0
        else:
            continue
        other = index.get((subject, base, dtype))
        mine = row.median("fwdbwd")
        theirs = other.median("fwdbwd") if other is not None else None
        if mine is None or theirs is None:
            continue
        ratio = mine / theirs
        limit = f"<= {need:g}x" if need != 1.0 else "< 1x"
        passed = ratio <= need if need != 1.0 else ratio < 1.0
        detail = (
            f"{mine * 1e3:.2f} ms vs {theirs * 1e3:.2f} ms at {base.label}: {ratio:.2f}x "
            f"(need {limit})"
        )
        checks.append(Check(f"{subject} {what}", shape, dtype, passed, detail))
    return checks


def memory_check(rows: Sequence[dict], subject: str | None) -> list[Check]:
    """``subject``'s compiled fwd+bwd temp bytes at ACCEPT_REF below the total size of its inputs,
    in float32 (the target is stated for float32: bf16 halves the inputs, not the float32 state
    and accumulators, so the bf16 ratio is reported in the table but not judged).

    Args:
        rows: the memory report's rows.
        subject: the backend the target is about (None: no checks).

    Returns:
        The checks.
    """
    checks = []
    for r in rows:
        if r.get("backend") != subject or r.get("status") != "ok" or r["dtype"] != "float32":
            continue
        shape = BenchShape.from_dict(r["shape"])
        if shape != ACCEPT_REF:
            continue
        temp, inputs = r["temp_bytes"], r["input_bytes"]
        detail = (
            f"temp {temp / 2**20:.1f} MiB vs inputs {inputs / 2**20:.1f} MiB "
            f"({temp / inputs:.2f}x; need < 1x) on {r.get('target', 'local')}"
        )
        name = f"{subject} fwd+bwd temp < inputs"
        checks.append(Check(name, shape, r["dtype"], temp < inputs, detail))
    return checks
