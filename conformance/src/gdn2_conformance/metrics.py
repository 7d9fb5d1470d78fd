"""The one error metric and the one tolerance table of gdn2 (tests, the kit and the bench gate).

Metric: ``rel_err(x, ref) = max|x - ref| / max|ref|`` in float64 (``inf`` when x has a non-finite
value). A maximum, not an RMS: an error confined to a few tokens (a decay off by one token at a
chunk boundary) must not be averaged away.

Tolerances, by input dtype and by quantity (outputs o and h_final; the seven gradients):

- float32: a chunked backend sums in another order than the token-serial scan and forms the WY
  inverse explicitly; ``docs/algorithm.md`` section 5.4 measures 2e-6 to 1e-5 for that in float32.
  Strong decay and erase gates up to 2 (negative eigenvalues) amplify rounding a few-fold: 1e-4
  for outputs, 3e-4 for gradients (longer chains of products). On a GPU or TPU a float32 matmul at
  JAX's default precision runs as TF32 or bf16 passes (about 1e-3 relative): there the float32
  entries are multiplied by :data:`ACCELERATOR_FLOAT32_FACTOR`.
- bfloat16: both sides use the same bf16 input values (the reference computes them in float32),
  so the difference is the backend's bf16 matmul operands and the rounding of o and the gradients
  to bf16: a few ulps of 2^-8 = 3.9e-3 over sums of about dk terms: 3e-2 and 6e-2.
- float64: the same derivation in float64, rounding only: 1e-9.
- decode (``gdn2_decode`` against the decode reference, outputs and states): both are
  token-serial in float32, so the difference is the order of a few roundings per token (a kernel
  folds the decay into the read vectors): about 1e-7 measured over a chunk of tokens; 1e-5.
  bfloat16: o is rounded to bfloat16 (2^-9) and, with a bfloat16 pool, so is the state: 2e-2.
  The accelerator factor applies as above (a decode written with matmuls runs bf16 passes).

Any algorithmic slip (a decay off by a token, a missing erase term) gives errors of 1e-2 to 1.
"""

from __future__ import annotations

import enum
from typing import Final

import numpy as np

from gdn2core.platform import default_platform


class Quantity(enum.StrEnum):
    """What is compared: the outputs (o, h_final) or a gradient."""

    OUT = "out"
    GRAD = "grad"
    DECODE = "decode"


TOLERANCES: Final[dict[str, dict[Quantity, float]]] = {
    "float32": {Quantity.OUT: 1e-4, Quantity.GRAD: 3e-4, Quantity.DECODE: 1e-5},
    "bfloat16": {Quantity.OUT: 3e-2, Quantity.GRAD: 6e-2, Quantity.DECODE: 2e-2},
    "float64": {Quantity.OUT: 1e-9, Quantity.GRAD: 1e-9, Quantity.DECODE: 1e-9},
}
ACCELERATOR_FLOAT32_FACTOR: Final = 10.0
OUTPUT_NAMES: Final = ("o", "h_final")


def quantity(name: str) -> Quantity:
    """The quantity of a named array (``"o"``, ``"h_final"``, ``"dq"``, ``"o (fwd)"``,
    ``"state (decode)"``, ...).

    Args:
        name: the array's label; a suffix after a space is ignored, except ``(decode)``.

    Returns:
        :attr:`Quantity.DECODE` for a label ending in ``(decode)``, :attr:`Quantity.OUT` for o and
        h_final, else :attr:`Quantity.GRAD`.
    """
    if name.endswith("(decode)"):
        return Quantity.DECODE
    return Quantity.OUT if name.split(" ")[0] in OUTPUT_NAMES else Quantity.GRAD


def tolerance(dtype: str, name: str | Quantity, platform: str = "cpu") -> float:
    """The tolerance on :func:`rel_err` for one array.

    Args:
        dtype: the input dtype of the call.
        name: the array's label (see :func:`quantity`) or a :class:`Quantity`.
        platform: where the backend ran (``"cpu"``, ``"gpu"``, ``"tpu"``).

    Returns:
        The largest acceptable relative error.
    """
    q = name if isinstance(name, Quantity) else quantity(name)
    tol = TOLERANCES[dtype][q]
    if dtype == "float32" and platform != "cpu":
        tol *= ACCELERATOR_FLOAT32_FACTOR
    return tol


def rel_err(actual, expected) -> float:
    """``max|actual - expected| / max|expected|`` in float64.

    Args:
        actual: the backend's array (any float dtype, bfloat16 included).
        expected: the reference array of the same shape.

    Returns:
        The relative error; ``inf`` if ``actual`` has a non-finite value; the absolute error when
        ``expected`` is all zeros.

    Raises:
        ValueError: the shapes differ.
    """
    a = np.asarray(actual).astype(np.float64)
    e = np.asarray(expected).astype(np.float64)
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: {a.shape} vs expected {e.shape}")
    if not np.all(np.isfinite(a)):
        return float("inf")
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    diff = float(np.max(np.abs(a - e))) if a.size else 0.0
    return diff / scale if scale > 0 else diff


def assert_close(name: str, actual, expected, dtype: str) -> None:
    """Fail, naming the array, the error and the tolerance, when ``actual`` is off.

    Args:
        name: the array's label (``"o"``, ``"h_final"``, ``"dq"``...).
        actual: the backend's array.
        expected: the reference's.
        dtype: the input dtype of the call (selects the tolerance).
    """
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    err, tol = rel_err(actual, expected), tolerance(dtype, name, default_platform())
    assert err <= tol, f"{name}: relative error {err:.2e} > tolerance {tol:.0e} ({dtype})"
