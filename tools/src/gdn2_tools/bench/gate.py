"""The correctness gate: a backend is timed at a shape only after its outputs and gradients match
a trusted result of the same inputs.

Trusted result: the token-serial reference (``gdn2_token_serial_reference``, JAX autodiff for the
gradients) run in float32 at ``precision="highest"`` on the dtype-rounded inputs (a bfloat16 run
is judged against the float32 result of the same inputs). Where its autodiff would not fit
(:func:`reference_affordable`), the trusted result is the *trusted backend* in float32: the backend
``backend="auto"`` picks here for a trainable float32 call, after it passed the gate against the
reference at a smaller shape (``B=1``, ``T <= 1024``, same H, dk, dv).

Metric and tolerances: those of the conformance kit (:mod:`gdn2_conformance.metrics`): relative
max error per output (o, h_final) and per gradient (dq, dk, dv, dw, db, dg, dh0), every value
finite.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import numpy as np

from gdn2_conformance.metrics import rel_err, tolerance
from gdn2_tools.bench.shapes import BenchShape

#: Bytes of the reference's autodiff per unit of ``4 * B*H*T*dk*dv`` (one float32 state per token):
#: the states saved by ``lax.scan``'s linearisation and their cotangents. ``gdn2 memory`` measured
#: 3.1 units of compiled temp at B=2, T=2048, H=4, d=128 on CPU; 4 leaves a margin.
REFERENCE_STATE_FACTOR: Final = 4
#: At most this share of device memory (and this many bytes) for the reference gate / row.
REFERENCE_MEMORY_FRACTION: Final = 0.4
REFERENCE_MAX_BYTES: Final = 8 * 2**30
#: The smaller shape at which the trusted backend is checked before it serves as the trusted result.
FALLBACK_MAX_T: Final = 1024


def reference_bytes(shape: BenchShape) -> int:
    """Estimated bytes of the token-serial reference's forward + autodiff backward."""
    states = shape.B * shape.value_heads * shape.T * shape.dk * shape.dv
    return REFERENCE_STATE_FACTOR * 4 * states


def reference_budget(device_bytes: int) -> int:
    """The bytes the reference may use on a device of ``device_bytes``."""
    return int(min(REFERENCE_MAX_BYTES, REFERENCE_MEMORY_FRACTION * device_bytes))


def reference_affordable(shape: BenchShape, device_bytes: int) -> bool:
    """Whether the reference's autodiff fits at ``shape``."""
    return reference_bytes(shape) <= reference_budget(device_bytes)


def fallback_shape(shape: BenchShape) -> BenchShape:
    """The smaller shape the trusted backend is checked at."""
    T = min(shape.T, FALLBACK_MAX_T)
    return dataclasses.replace(shape, B=1, T=T, seqs=min(shape.seqs, T))


@dataclasses.dataclass(frozen=True)
class GateResult:
    """The gate's verdict on one row: errors per array, and the failures."""

    ok: bool
    against: str  # what the trusted result was
    errors: dict[str, float]  # name -> relative error
    failures: tuple[str, ...] = ()

    @property
    def message(self) -> str:
        """One line: the worst error, or the failures."""
        if self.ok:
            worst = max(self.errors, key=self.errors.get) if self.errors else "-"
            return f"ok vs {self.against} (worst {worst} {self.errors.get(worst, 0):.1e})"
        return f"rejected vs {self.against}: " + "; ".join(self.failures)

    def as_dict(self) -> dict:
        """The JSON form."""
        return {
            "ok": self.ok,
            "against": self.against,
            "errors": {k: (None if not np.isfinite(v) else v) for k, v in self.errors.items()},
            "failures": list(self.failures),
        }


def compare(
    got: dict, expected: dict, dtype: str, against: str, platform: str = "cpu"
) -> GateResult:
    """Check every array of ``got`` against the same-named one of ``expected``.

    Args:
        got: the row's arrays by name (``"o"``, ``"dq"``, ``"o (fwd)"``...).
        expected: the trusted arrays by name.
        dtype: the row's input dtype (selects the tolerances).
        against: what the trusted result is, for the report.
        platform: where the row ran (float32 tolerances widen off the CPU).

    Returns:
        The :class:`GateResult`.
    """
    errors: dict[str, float] = {}
    failures: list[str] = []
    for name, x in got.items():
        if name not in expected:
            continue
        try:
            err = rel_err(x, expected[name])
        except ValueError as exc:
            failures.append(f"{name}: {exc}")
            continue
        errors[name] = err
        tol = tolerance(dtype, name, platform)
        if not err <= tol:  # also catches NaN / inf
            what = "non-finite values" if not np.isfinite(err) else f"rel err {err:.2e}"
            failures.append(f"{name}: {what} > tol {tol:.0e}")
    return GateResult(not failures, against, errors, tuple(failures))
