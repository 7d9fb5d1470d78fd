"""Everything a backend author imports, and nothing else: the whole contract of a gdn2 backend.

A backend distribution:

1. subclasses :class:`Backend` (``name``, ``priority``, ``capabilities``, ``forward`` and, for a
   custom VJP, ``forward_trainable``; optionally ``availability`` and ``supports``; with
   ``Capabilities(decode=True)``, ``decode`` and optionally ``supports_decode``; with
   ``Capabilities(chunk_states=True)``, ``forward_chunk_states``; with
   ``Capabilities(pooled=True)``, ``forward_pooled`` and optionally ``supports_pooled`` (the
   ragged op's requests against the pool, :class:`PoolRequests`));
2. exposes a module implementing the ``gdn2_backend`` hook (decorated with :data:`hookimpl`) under
   the entry-point group ``gdn2.backends``, named after the backend;
3. may implement ``gdn2_commands`` (its own ``gdn2`` subcommands) and ``gdn2_kernel_costs``
   (its kernels as report rows) in the same module;
4. runs the conformance kit: ``gdn2 conformance NAME`` (``docs/backends.md``).

Model features (``docs/backends.md``): a backend declares ``Capabilities(segments=...,
varlen=..., fused_activations=...)`` and then receives ``extras=`` (an :class:`OpExtras`) and
``spec.segments`` / ``spec.activations`` (:class:`SegmentMode`, :class:`Activations`,
:class:`GateMode`; the L2 norm's :data:`L2NORM_EPS`), and the token layouts of packed sequences:
:func:`segment_starts` (where ``segment_ids`` start sequences) and :func:`varlen_layout` (each
token's sequence, start and end under ``cu_seqlens``).

Helpers for the array methods: :func:`state_dtype` (the accumulation dtype), :func:`probe` (the
``GDN2_FWD_DIAG`` diagnostics), :func:`default_platform`, :func:`is_tpu_available`,
:func:`device_memory_bytes`, :func:`count_at_most` (a sorted-array lookup without
``jnp.searchsorted``'s loop, for the index arithmetic of packed sequences), and the scalar gates
broadcast to their channels (:func:`broadcast_gates`, for a backend with
``Capabilities.scalar_gates`` on a path of its own that takes only the full gates), the states of
grouped value heads in the core's view (:func:`group_state`, for a backend that reads
``spec.value_groups`` and writes states in the caller's layout), the token-serial references
:func:`gdn2_token_serial_reference` and :func:`gdn2_decode_reference`; a decode op receives a
:class:`DecodeSpec`, and :func:`sanitize_slots` is the core's rule for the slots it is given (out
of range or repeated: skipped), for a ``decode`` that may be called directly; :func:`expand_heads`
repeats a decode input's heads to the value heads (for a backend with
``Capabilities.grouped_decode`` on a path that takes them repeated).
"""

from gdn2core.backend import YES, Backend, Capabilities, Verdict
from gdn2core.checks import state_dtype
from gdn2core.config import KernelConfig
from gdn2core.diagnostics import probe
from gdn2core.features.gva import group_state
from gdn2core.features.pooled import FROM_NAN, FROM_ZEROS, PoolRequests
from gdn2core.features.scalar_gates import broadcast_gates
from gdn2core.features.segments import segment_starts, varlen_layout
from gdn2core.hooks import BACKENDS_GROUP, TOOLS_GROUP, Command, KernelCost, hookimpl
from gdn2core.indexing import count_at_most
from gdn2core.ops.decode.reference import gdn2_decode_reference
from gdn2core.ops.decode.spec import PAIRWISE_MAX, DecodeSpec, expand_heads, sanitize_slots
from gdn2core.ops.forward.reference import gdn2_token_serial_reference
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.options import L2NORM_EPS, Activations, GateMode, OpExtras, SegmentMode
from gdn2core.platform import default_platform, device_memory_bytes, is_tpu_available

__all__ = [
    "BACKENDS_GROUP",
    "FROM_NAN",
    "FROM_ZEROS",
    "L2NORM_EPS",
    "PAIRWISE_MAX",
    "TOOLS_GROUP",
    "YES",
    "Activations",
    "Backend",
    "Capabilities",
    "Command",
    "DecodeSpec",
    "GateMode",
    "KernelConfig",
    "KernelCost",
    "OpExtras",
    "OpSpec",
    "PoolRequests",
    "SegmentMode",
    "Verdict",
    "broadcast_gates",
    "count_at_most",
    "default_platform",
    "device_memory_bytes",
    "expand_heads",
    "gdn2_decode_reference",
    "gdn2_token_serial_reference",
    "group_state",
    "hookimpl",
    "is_tpu_available",
    "probe",
    "sanitize_slots",
    "segment_starts",
    "state_dtype",
    "varlen_layout",
]
