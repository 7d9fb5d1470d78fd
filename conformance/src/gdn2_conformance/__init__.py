"""The gdn2 conformance kit: the suite, its input generator, error metric, tolerance table and
token-serial checks, and a pytest plugin (``gdn2 conformance NAME``, ``pytest --gdn2-backend
NAME``). Tests, the benchmark gate and third-party backends all use these same pieces.

Importing :mod:`gdn2core` never imports this package.
"""

from gdn2_conformance.backends import ReferenceBackend
from gdn2_conformance.checks import (
    check_central_differences,
    cotangent_loss,
    decode_reference_outputs,
    op_function,
    outputs_and_grads,
    reference,
    reference_outputs_and_grads,
)
from gdn2_conformance.feature_inputs import (
    FeatureCase,
    GateHeads,
    activate_numpy,
    make_feature_arrays,
    make_feature_inputs,
)
from gdn2_conformance.inputs import (
    ARG_NAMES,
    GRAD_NAMES,
    INPUT_NAMES,
    PARAM_NAMES,
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
from gdn2_conformance.metrics import (
    TOLERANCES,
    Quantity,
    assert_close,
    quantity,
    rel_err,
    tolerance,
)
from gdn2_conformance.suite import ConformanceSuite
from gdn2_conformance.target import (
    CASES,
    DECODE_CASES,
    GATED_FEATURES,
    SMALL_CONFIG,
    CaseSpec,
    DecodeCaseSpec,
    Feature,
    Target,
    capability,
    declared_features,
)

__all__ = [
    "ARG_NAMES",
    "CASES",
    "DECODE_CASES",
    "GATED_FEATURES",
    "GRAD_NAMES",
    "INPUT_NAMES",
    "PARAM_NAMES",
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
    "FeatureCase",
    "GateHeads",
    "Inputs",
    "Quantity",
    "ReferenceBackend",
    "Target",
    "activate_numpy",
    "assert_close",
    "capability",
    "check_central_differences",
    "cotangent_loss",
    "declared_features",
    "decode_reference_outputs",
    "make_arrays",
    "make_decode_arrays",
    "make_decode_inputs",
    "make_feature_arrays",
    "make_feature_inputs",
    "make_inputs",
    "op_function",
    "outputs_and_grads",
    "quantity",
    "reference",
    "reference_outputs_and_grads",
    "rel_err",
    "tolerance",
]
