"""The jax_ref acceptance targets, checked on the rows of one run (speed) or one memory report."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gdn2core.bench.programs import REFERENCE_ROW
from gdn2core.bench.runner import RowResult
from gdn2core.bench.shapes import ACCEPT_REF, ACCEPT_SCAN, BenchShape

#: (backend, baseline, mode, shape, minimum speed-up, description)
SPEED_TARGETS = (
    ("jax_ref", REFERENCE_ROW, "fwdbwd", ACCEPT_REF, 4.0, "jax_ref fwd+bwd >= 4x reference_grad"),
    ("jax_ref", REFERENCE_ROW, "fwd", ACCEPT_REF, 1.0, "jax_ref fwd no slower than reference fwd"),
    (
        "jax_ref",
        "scan_baseline",
        "fwdbwd",
        ACCEPT_SCAN,
        20.0,
        "jax_ref fwd+bwd >= 20x scan_baseline",
    ),
)


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    shape: BenchShape
    dtype: str
    passed: bool
    detail: str

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return f"{verdict}  {self.name} [{self.shape.label}, {self.dtype}]: {self.detail}"

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "shape": self.shape.as_dict(),
            "dtype": self.dtype,
            "passed": self.passed,
            "detail": self.detail,
        }


def speed_checks(results: Sequence[RowResult]) -> list[Check]:
    """One check per target and dtype where both rows were timed in this run."""
    index = {(r.backend, r.shape, r.dtype): r for r in results if r.source == "this run"}
    dtypes = sorted({r.dtype for r in results})
    checks = []
    for backend, base, mode, shape, need, desc in SPEED_TARGETS:
        for dtype in dtypes:
            mine, theirs = index.get((backend, shape, dtype)), index.get((base, shape, dtype))
            if mine is None or theirs is None:
                continue
            tm, tb = mine.median(mode), theirs.median(mode)
            if tm is None or tb is None:
                continue
            ratio = tb / tm
            detail = (
                f"{backend} {mode} {tm * 1e3:.2f} ms vs {base} {tb * 1e3:.2f} ms: "
                f"{ratio:.2f}x (need >= {need:g}x)"
            )
            checks.append(Check(desc, shape, dtype, ratio >= need, detail))
    return checks


def memory_check(rows: Sequence[dict]) -> list[Check]:
    """jax_ref compiled fwd+bwd temp bytes at ACCEPT_REF below the total size of its inputs,
    in float32 (the target is stated for float32: bf16 halves the inputs, not the float32
    state and accumulators, so the bf16 ratio is reported in the table but not judged)."""
    checks = []
    for r in rows:
        if r.get("backend") != "jax_ref" or r.get("status") != "ok" or r["dtype"] != "float32":
            continue
        shape = BenchShape.from_dict(r["shape"])
        if shape != ACCEPT_REF:
            continue
        temp, inputs = r["temp_bytes"], r["input_bytes"]
        detail = (
            f"temp {temp / 2**20:.1f} MiB vs inputs {inputs / 2**20:.1f} MiB "
            f"({temp / inputs:.2f}x; need < 1x) on {r.get('target', 'local')}"
        )
        checks.append(
            Check("jax_ref fwd+bwd temp < inputs", shape, r["dtype"], temp < inputs, detail)
        )
    return checks
