"""One call, from validated inputs to the backend's result: the fused activations (in XLA when the
backend does not fuse them), grouped value heads, the backend's extras, and the plain or per-shard
call. The public functions (:mod:`gdn2core.ops.forward.api`) validate and choose the backend; this runs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gdn2core.backend import Backend, Verdict
from gdn2core.checks import is_float32_decay, state_dtype
from gdn2core.config import KernelConfig
from gdn2core.features.activations import apply_activations
from gdn2core.features.gva import group_call, repeat_keys_of, ungroup_outputs, ungroup_state
from gdn2core.features.scalar_gates import broadcast_gates
from gdn2core.features.segments import as_int32_ids
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.options import OpExtras, SegmentMode
from gdn2core.sharding.plan import resolve_plan
from gdn2core.sharding.run import sharded_call


def run_backend(
    backend: Backend,
    spec: OpSpec,
    config: KernelConfig,
    args: tuple[jax.Array, ...],
    h0: jax.Array,
    extras: OpExtras,
    sharding: dict[str, Any],
    supports: Callable[[OpSpec], Verdict],
    *,
    trainable: bool,
    chunk_states: bool = False,
) -> tuple[jax.Array, ...]:
    """Run one validated call on its backend: ``forward``, ``forward_trainable`` or, with
    ``chunk_states``, ``forward_chunk_states``; once, or once per shard on a multi-device mesh.
    A call without tokens (``T = 0``) runs no backend: :func:`empty_call` answers it.

    Args:
        backend: the chosen backend.
        spec: the validated spec of the call (user layout: GVA, activations).
        config: the kernel config.
        args: the raw ``(q, k, v, w, b, g)``.
        h0: the initial state ``(L, HV, dk, dv)`` in the state dtype.
        extras: the user's feature arrays (segment_ids, cu_seqlens, A_log, dt_bias or None).
        sharding: the mesh keywords of the call (``mesh``, ``batch_axes``, ``head_axes``,
            ``context_axis``).
        supports: the verdict of the backend on a per-shard spec.
        trainable: call ``forward_trainable`` (gradients) rather than ``forward``.
        chunk_states: call ``forward_chunk_states`` (single device only).

    Returns:
        ``(o, h_final)``, or ``(o, h_final, chunk_states)``, in the user layout.

    Raises:
        ValueError: ``chunk_states`` on a multi-device mesh.
    """
    placed = args[0]  # the user's q: its sharding locates the mesh
    user_h0 = h0
    view, inputs, h0, backend_extras = backend_inputs(backend, spec, args, h0, extras)
    plan = resolve_plan(view, placed, **sharding)
    if plan is not None and view.key_groups > 1:  # and q, k repeated to the value heads
        q, k, v, w, b, g = inputs
        inputs = (*repeat_keys_of(q, k, view.key_groups), v, w, b, g)
        view = dataclasses.replace(view, key_groups=1)
    if plan is not None and view.value_groups > 1:  # per-shard calls get the plain view
        view = dataclasses.replace(view, value_groups=1)
    more = {} if backend_extras is None else {"extras": backend_extras}
    if chunk_states and plan is not None:
        raise ValueError(
            "return_chunk_states: expected a single-device call, got a multi-device mesh "
            "(chunk states are not gathered across shards)"
        )
    if spec.seq_len == 0:
        return empty_call(spec, args[2].dtype, user_h0, chunk_states)
    if chunk_states:
        o, h, chunks = backend.forward_chunk_states(*inputs, h0, spec=view, config=config, **more)
        return (*ungroup_outputs(spec, o, h), ungroup_state(spec, chunks))
    method = backend.forward_trainable if trainable else backend.forward
    if plan is None:
        o, h = method(*inputs, h0, spec=view, config=config, **more)
    else:
        o, h = sharded_call(
            method, plan, *inputs, h0,
            spec=view, config=config, extras=backend_extras, supports=supports,
            check_vma=backend.shard_map_check_vma,
        )  # fmt: skip
    return ungroup_outputs(spec, o, h)


def empty_call(
    spec: OpSpec, v_dtype, h0: jax.Array, chunk_states: bool = False
) -> tuple[jax.Array, ...]:
    """The result of a call without tokens (``T = 0``), for every backend alike: no backend runs.

    Nothing happens to the state, so ``o`` is empty and ``h_final`` is ``h0`` (per sequence with
    ``cu_seqlens``, whose sequences are all empty); gradients follow by autodiff: zero-size ones
    for q..g, ``A_log`` and ``dt_bias`` zero, ``dh0 = dh_final``. There is no chunk, so
    ``chunk_states`` (``ceil(0 / bt)`` entries) is empty too (docs/operator.md, "Edges").

    Args:
        spec: the validated spec of the call (user layout), ``spec.seq_len == 0``.
        v_dtype: the dtype of v (that of ``o``).
        h0: the initial state ``(L, HV, dk, dv)`` in the state dtype.
        chunk_states: also return the (empty) chunk states ``(B, 0, HV, dk, dv)``.

    Returns:
        ``(o, h_final)`` or ``(o, h_final, chunk_states)``.
    """
    o = jnp.zeros((spec.batch, 0, spec.value_heads, spec.dv), v_dtype)  # [B, 0, HV, dv]
    if not chunk_states:
        return o, h0
    return o, h0, jnp.zeros((spec.batch, 0, *h0.shape[1:]), h0.dtype)  # [B, 0, HV, dk, dv]


def backend_inputs(
    backend: Backend, spec: OpSpec, args, h0, extras: OpExtras, pooled: bool = False
):
    """What the backend receives for a call: ``(view, (q, k, v, w, b, g), h0, extras | None)``:
    scalar gates broadcast unless it takes them (and w's always under grouped value heads, whose
    kernel heads have ``G * dv`` value channels), the activations applied in XLA unless it fuses
    them, a float32 ``g`` beside bfloat16 inputs cast to their dtype unless it takes it, grouped
    value heads resolved (q, k not repeated for a backend that reads them grouped,
    ``view.key_groups``, which is not done with ``cu_seqlens`` unless ``pooled``: the ragged op's
    pooled forward; with b, g on the key heads ``view.value_groups`` says how v, w were grouped),
    and the extras (None when the call has no packed sequences and no fused activations)."""
    q, k, v, w, b, g = args
    caps = backend.capabilities
    in_xla = spec.activations.any and not caps.fused_activations
    if not caps.scalar_gates or in_xla:
        spec, w, b, g = broadcast_gates(spec, w, b, g)
    elif spec.groups > 1 and spec.gate_heads == spec.heads:  # shared keys (features/gva.py)
        spec, w, b, g = broadcast_gates(spec, w, b, g, ("w",))
    view = caps.view(spec)
    A_log, dt_bias = extras.A_log, extras.dt_bias
    acc = state_dtype(q.dtype)
    if in_xla:  # an activated g is float32 beside bfloat16 inputs (apply_activations)
        q, k, w, b, g = apply_activations(spec.activations, q, k, w, b, g, A_log, dt_bias)
        A_log = dt_bias = None
        view = dataclasses.replace(view, float32_decay=is_float32_decay(g.dtype, q.dtype))
    if view.float32_decay and not caps.float32_decay:  # g in the inputs' dtype (differentiable)
        g = g.astype(q.dtype)
        view = dataclasses.replace(view, float32_decay=False)
    A_log = None if A_log is None else A_log.astype(acc)
    dt_bias = None if dt_bias is None else dt_bias.astype(acc)
    grouped = (  # repeated keys that the backend reads grouped (Capabilities.grouped_keys)
        caps.grouped_keys
        and spec.groups > 1
        and spec.gate_heads == spec.value_heads
        and (spec.segments != SegmentMode.CU_SEQLENS or pooled)
    )
    gq, gk, gv, gw, gh0 = group_call(spec, q, k, v, w, h0, repeat_keys=not grouped)
    if grouped:
        view = dataclasses.replace(view, key_groups=spec.groups)
    elif spec.groups > 1 and spec.gate_heads == spec.heads:  # v, w as G value heads per head
        view = dataclasses.replace(view, value_groups=spec.groups)

    backend_extras = None
    if view.segments != SegmentMode.NONE or view.activations.any:
        seg = None if extras.segment_ids is None else as_int32_ids(extras.segment_ids)
        cu = None if extras.cu_seqlens is None else jnp.asarray(extras.cu_seqlens, jnp.int32)
        backend_extras = OpExtras(seg, cu, A_log, dt_bias, extras.continues)
    return view, (gq, gk, gv, gw, b, g), gh0, backend_extras
