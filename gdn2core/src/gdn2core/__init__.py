"""gdn2core: the Gated DeltaNet-2 operator: spec, config, token-serial reference, public functions,
backend registry and multi-device execution.

Importing this package imports no backend and no tool; backends are discovered through the
entry-point group ``gdn2.backends`` on first use. Backend authors import :mod:`gdn2core.plugin`;
the conformance kit is :mod:`gdn2_conformance`.
"""

from gdn2core.backend import Backend, Capabilities, Verdict
from gdn2core.config import (
    DEFAULT_CONFIG,
    KAGGLE_LARGE,
    KAGGLE_MEDIUM,
    KAGGLE_SMALL,
    LONG_CHUNKS,
    PRESETS,
    SHORT_CHUNKS,
    KernelConfig,
)
from gdn2core.hooks import hookimpl
from gdn2core.memory import estimate_memory, get_recommended_config
from gdn2core.ops.decode.api import gdn2_decode, init_state_pool, which_decode_backend
from gdn2core.ops.decode.reference import gdn2_decode_reference
from gdn2core.ops.decode.spec import DecodeSpec
from gdn2core.ops.family.gdn import chunk_gated_delta_rule
from gdn2core.ops.family.kda import chunk_kda
from gdn2core.ops.family.recurrent import fused_recurrent_gated_delta_rule, fused_recurrent_kda
from gdn2core.ops.family.reference import naive_recurrent_gated_delta_rule, naive_recurrent_kda
from gdn2core.ops.forward.api import gdn2_forward, gdn2_forward_trainable, which_backend
from gdn2core.ops.forward.reference import gdn2_token_serial_reference
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.ops.ragged.api import gdn2_ragged
from gdn2core.ops.ragged.reference import gdn2_ragged_reference
from gdn2core.ops.ragged.spec import RaggedSpec
from gdn2core.options import Activations, FeatureArgs, Features, GateMode, OpExtras, SegmentMode
from gdn2core.platform import is_tpu_available
from gdn2core.registry import (
    BackendInfo,
    BackendNotFoundError,
    BackendUnsupportedError,
    get_backend,
    list_backends,
    register_backend,
    unregister_backend,
)
from gdn2core.selection import resolve_backend

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_CONFIG",
    "KAGGLE_LARGE",
    "KAGGLE_MEDIUM",
    "KAGGLE_SMALL",
    "LONG_CHUNKS",
    "PRESETS",
    "SHORT_CHUNKS",
    "Activations",
    "Backend",
    "BackendInfo",
    "BackendNotFoundError",
    "BackendUnsupportedError",
    "Capabilities",
    "DecodeSpec",
    "FeatureArgs",
    "Features",
    "GateMode",
    "KernelConfig",
    "OpExtras",
    "OpSpec",
    "RaggedSpec",
    "SegmentMode",
    "Verdict",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "estimate_memory",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_kda",
    "gdn2_decode",
    "gdn2_decode_reference",
    "gdn2_forward",
    "gdn2_forward_trainable",
    "gdn2_ragged",
    "gdn2_ragged_reference",
    "gdn2_token_serial_reference",
    "get_backend",
    "get_recommended_config",
    "hookimpl",
    "init_state_pool",
    "is_tpu_available",
    "list_backends",
    "naive_recurrent_gated_delta_rule",
    "naive_recurrent_kda",
    "register_backend",
    "resolve_backend",
    "unregister_backend",
    "which_backend",
    "which_decode_backend",
]
