"""The correctness gate: a backend is timed at a shape only after its outputs and gradients match
a trusted result of the same inputs.

Trusted result: the token-serial reference (``gdn2_token_serial_reference``, JAX autodiff for the
gradients) run in float32 at ``precision="highest"`` on the dtype-rounded inputs (OPERATOR.md: a
bfloat16 run is judged against the float32 result of the same inputs). Where its autodiff would not
fit (:func:`reference_affordable`), the trusted result is jax_ref in float32, after jax_ref itself
passed the gate against the reference at a smaller shape (``B=1``, ``T <= 1024``, same H, dk, dv).

Metric: relative RMS error ``||x - ref||_2 / ||ref||_2`` per output (o, h_final) and per gradient
(dq, dk, dv, dw, db, dg, dh0), and every value finite.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import numpy as np

from gdn2core.bench.shapes import BenchShape

#: Relative-RMS tolerances by input dtype, per output group.
#:
#: float32: the chunked (WY) form sums in a different order than the token-serial scan and solves a
#: unit-triangular system, so it differs by rounding growing mildly with T: about 1e-6..1e-5 on CPU
#: at T=2048; on TPU/GPU a float32 matmul at default precision may use bf16x3/TF32 passes (1e-4).
#: Any algorithmic slip (a decay off by a token, a missing erase term) gives errors of 1e-2 to 1.
#: The gate gradients (dw, db, dg) sum over the value axis and over all later tokens, so they get
#: 2.5x the margin.
#: bfloat16: inputs are identical (rounded once), so the error comes from bf16 matmul operands with
#: float32 accumulation inside kernels and from rounding o and the gradients to bf16 (unit roundoff
#: 2**-9 ~ 2e-3). fla tests fp16 (3 more significand bits, 8x smaller roundoff) at 5e-3 for outputs,
#: 1e-2 for dq/dk/dv and 2e-2 for gate gradients; we allow 4x those for bf16.
TOLERANCES: Final[dict[str, dict[str, float]]] = {
    "float32": {"out": 1e-3, "grad": 2e-3, "gate_grad": 5e-3},
    "bfloat16": {"out": 2e-2, "grad": 4e-2, "gate_grad": 8e-2},
    "float64": {"out": 1e-9, "grad": 1e-9, "gate_grad": 1e-8},
}

OUTPUT_NAMES: Final = ("o", "h_final")
GRAD_GROUP: Final = ("dq", "dk", "dv", "dh0")
GATE_GRAD_GROUP: Final = ("dw", "db", "dg")

#: Bytes of the reference's autodiff per unit of ``4 * B*H*T*dk*dv`` (one float32 state per token):
#: the states saved by ``lax.scan``'s linearisation and their cotangents. ``gdn2 memory`` measured
#: 3.1 units of compiled temp at B=2, T=2048, H=4, d=128 on CPU; 4 leaves a margin.
REFERENCE_STATE_FACTOR: Final = 4
#: At most this share of device memory (and this many bytes) for the reference gate / row.
REFERENCE_MEMORY_FRACTION: Final = 0.4
REFERENCE_MAX_BYTES: Final = 8 * 2**30
#: The smaller shape at which jax_ref is checked before it serves as the trusted result.
FALLBACK_MAX_T: Final = 1024


def tolerance(dtype: str, name: str) -> float:
    """The tolerance of output or gradient ``name`` (a suffix such as ``" (fwd)"`` is ignored)."""
    tol = TOLERANCES[dtype]
    base = name.split(" ")[0]
    if base in OUTPUT_NAMES:
        return tol["out"]
    return tol["gate_grad"] if base in GATE_GRAD_GROUP else tol["grad"]


def reference_bytes(shape: BenchShape) -> int:
    """Estimated bytes of the token-serial reference's forward + autodiff backward."""
    return REFERENCE_STATE_FACTOR * 4 * shape.B * shape.H * shape.T * shape.dk * shape.dv


def reference_budget(device_bytes: int) -> int:
    return int(min(REFERENCE_MAX_BYTES, REFERENCE_MEMORY_FRACTION * device_bytes))


def reference_affordable(shape: BenchShape, device_bytes: int) -> bool:
    return reference_bytes(shape) <= reference_budget(device_bytes)


def fallback_shape(shape: BenchShape) -> BenchShape:
    return BenchShape(1, min(shape.T, FALLBACK_MAX_T), shape.H, shape.dk, shape.dv)


def rel_rms(x, ref) -> float:
    """``||x - ref|| / ||ref||`` in float64; inf if x has a non-finite value."""
    xa = np.asarray(x, dtype=np.float64)
    ra = np.asarray(ref, dtype=np.float64)
    if xa.shape != ra.shape:
        raise ValueError(f"shape mismatch: {xa.shape} vs reference {ra.shape}")
    if not np.all(np.isfinite(xa)):
        return float("inf")
    denom = float(np.sqrt(np.mean(ra * ra)))
    err = float(np.sqrt(np.mean((xa - ra) ** 2)))
    return err / denom if denom > 0 else err


@dataclasses.dataclass(frozen=True)
class GateResult:
    ok: bool
    against: str  # what the trusted result was
    errors: dict[str, float]  # name -> relative RMS error
    failures: tuple[str, ...] = ()

    @property
    def message(self) -> str:
        if self.ok:
            worst = max(self.errors, key=self.errors.get) if self.errors else "-"
            return f"ok vs {self.against} (worst {worst} {self.errors.get(worst, 0):.1e})"
        return f"rejected vs {self.against}: " + "; ".join(self.failures)

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "against": self.against,
            "errors": {k: (None if not np.isfinite(v) else v) for k, v in self.errors.items()},
            "failures": list(self.failures),
        }


def compare(got: dict, expected: dict, dtype: str, against: str) -> GateResult:
    """Check every array of ``got`` against the same-named one of ``expected``."""
    errors: dict[str, float] = {}
    failures: list[str] = []
    for name, x in got.items():
        if name not in expected:
            continue
        try:
            err = rel_rms(x, expected[name])
        except ValueError as exc:
            failures.append(f"{name}: {exc}")
            continue
        errors[name] = err
        tol = tolerance(dtype, name)
        if not err <= tol:  # also catches NaN / inf
            what = "non-finite values" if not np.isfinite(err) else f"rel-RMS {err:.2e}"
            failures.append(f"{name}: {what} > tol {tol:.0e}")
    return GateResult(not failures, against, errors, tuple(failures))
