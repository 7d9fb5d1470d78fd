"""The gdn2 conformance kit: the suite, its input generator, error metric, tolerance table and
token-serial checks, and a pytest plugin (``gdn2 conformance NAME``, ``pytest --gdn2-backend
NAME``). Tests, the benchmark gate and third-party backends all use these same pieces.

Importing :mod:`gdn2core` never imports this package.
"""

from gdn2core.testing.backends import ReferenceBackend
from gdn2core.testing.checks import (
    check_central_differences,
    cotangent_loss,
    decode_reference_outputs,
    outputs_and_grads,
    reference,
    reference_outputs_and_grads,
)
from gdn2core.testing.inputs import (
    ARG_NAMES,
    GRAD_NAMES,
    INPUT_NAMES,
    Case,
    Decay,
    DecodeCase,
    DecodeInputs,
    Inputs,
    make_arrays,
    make_decode_arrays,
    make_decode_inputs,
    make_inputs,
)
from gdn2core.testing.metrics import TOLERANCES, Quantity, quantity, rel_err, tolerance
from gdn2core.testing.suite import (
    BASE_FEATURES,
    CASES,
    DECODE_CASES,
    SMALL_CONFIG,
    CaseSpec,
    ConformanceSuite,
    DecodeCaseSpec,
    Feature,
    Target,
    assert_close,
    capability,
)

__all__ = [
    "ARG_NAMES",
    "BASE_FEATURES",
    "CASES",
    "DECODE_CASES",
    "GRAD_NAMES",
    "INPUT_NAMES",
    "SMALL_CONFIG",
    "TOLERANCES",
    "Case",
    "CaseSpec",
    "ConformanceSuite",
    "Decay",
    "DecodeCase",
    "DecodeCaseSpec",
    "DecodeInputs",
    "Feature",
    "Inputs",
    "Quantity",
    "ReferenceBackend",
    "Target",
    "assert_close",
    "capability",
    "check_central_differences",
    "cotangent_loss",
    "decode_reference_outputs",
    "make_arrays",
    "make_decode_arrays",
    "make_decode_inputs",
    "make_inputs",
    "outputs_and_grads",
    "quantity",
    "reference",
    "reference_outputs_and_grads",
    "rel_err",
    "tolerance",
]
