"""The ragged op on a mesh: heads, and the pool's value heads, split over mesh axes.

A serving step's requests share every head, so the step splits by heads, as tpu-inference splits
its GDN layers: each device runs the whole ragged call (every request, every token) on its
``H / n`` key heads, ``HV / n`` value heads and the pool's ``HV / n`` value heads, inside
``jax.shard_map``, with no collective. The metadata (offsets, slots, flags, checkpoint and draft
slots) is replicated. Grouped value heads stay grouped: value head ``j`` reads key head
``j // (HV / H)``, and contiguous blocks of both keep that map on every device.

How a call finds its mesh follows the other ops (:mod:`gdn2core.sharding`): ``mesh=``, else the
mesh of q's sharding (a concrete array's ``NamedSharding``, or the sharding in q's type under
``jax.jit``), else, only with ``head_axes=``, the mesh of ``jax.set_mesh``. The head axes are
``head_axes=``, else those q's sharding shows on its head dimension, else every free mesh axis
whose size divides the heads. A token or channel dimension sharded over the mesh is refused, so is
a head count its shards do not divide; a mesh of one device, or one that splits nothing, runs the
single-device call.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
from jax.sharding import PartitionSpec

from gdn2core.ops.ragged.spec import RaggedSpec
from gdn2core.sharding.plan import (
    AxesArg,
    AxisNames,
    axis_names_of,
    check_axes,
    find_mesh,
    manual_axes,
)
from gdn2core.sharding.run import reshard_explicit, shard_map

#: The metadata keywords of :func:`gdn2core.gdn2_ragged`, replicated on every device.
METADATA = (
    "cu_seqlens", "state_indices", "has_initial_state", "context_lens", "checkpoint_slots",
    "draft_slots",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """The mesh of a ragged call and the mesh axes its heads are split over."""

    mesh: Any  # jax.sharding.Mesh or AbstractMesh
    head_axes: AxisNames

    @property
    def shards(self) -> int:
        return math.prod(int(self.mesh.shape[a]) for a in self.head_axes)

    @property
    def heads(self) -> Any:
        """The PartitionSpec entry of a head dimension."""
        return self.head_axes[0] if len(self.head_axes) == 1 else self.head_axes

    def describe(self) -> str:
        return f"mesh {dict(self.mesh.shape)}: heads over {self.head_axes}"


def head_plan(spec: RaggedSpec, q: Any, *, mesh: Any, head_axes: AxesArg) -> HeadPlan | None:
    """The plan of one ragged call, or None for the single-device call.

    Raises:
        ValueError: no mesh for ``head_axes``; an axis not on the mesh, or already manual; the
            tokens or channels of q sharded; a head count not divisible by its shards.
    """
    mesh, visible = find_mesh(q, mesh, head_axes is not None, "head_axes:")
    if mesh is None or mesh.size == 1:
        return None
    manual = manual_axes(mesh)
    seen: AxisNames = ()
    shown: frozenset[str] = frozenset()
    if visible is not None and tuple(visible[0].axis_names) == tuple(mesh.axis_names):
        entries = (*tuple(visible[1]), None, None, None)[:3]
        shown = visible[2]
        tokens, seen, channels = (axis_names_of(e) for e in entries)
        for what, axes in (("token (first)", tokens), ("channel (last)", channels)):
            if axes:
                raise ValueError(
                    f"q: its {what} dimension is sharded over {axes}; gdn2_ragged splits heads "
                    "only (replicate the tokens, shard the heads)"
                )
    axes = axis_names_of(head_axes) if head_axes is not None else seen
    check_axes(mesh, "head_axes", axes)
    if head_axes is None:  # free axes the inputs do not show: heads, while the sizes divide
        for a in mesh.axis_names:
            if a in (*axes, *manual) or a in shown:
                continue
            if spec.key_heads % (math.prod(mesh.shape[x] for x in axes) * mesh.shape[a]) == 0:
                axes = (*axes, a)
    bad = [a for a in axes if a in manual]
    if bad:
        raise ValueError(f"head_axes: mesh axes {bad} are already manual (inside a shard_map)")
    plan = HeadPlan(mesh, tuple(axes))
    for name, heads in (("H", spec.key_heads), ("HV", spec.heads), ("Hg", spec.gate_heads)):
        if heads % plan.shards:
            raise ValueError(
                f"head_axes: {name}={heads} is not divisible by its {plan.shards} shards "
                f"({plan.describe()}); choose other mesh axes"
            )
    return None if plan.shards == 1 else plan


def sharded_ragged(fn, plan: HeadPlan, x, pool, metadata: dict, features: dict):
    """``fn(*x, pool, metadata, features)`` on every device's heads; the global ``(o, pool)``.

    Args:
        fn: the single-device call (keywords besides these bound).
        plan: the plan.
        x: ``(q, k, v, w, b, g)``, the global tokens.
        pool: ``(P, HV, dk, dv)``.
        metadata: the :data:`METADATA` keywords (None when absent), replicated.
        features: the feature keywords: ``A_log (Hg,)`` and ``dt_bias (Hg, dk)`` are split by
            heads, the rest (flags, ``lower_bound``) passed to every device as they are.
    """
    h = plan.heads
    tok, slots = PartitionSpec(None, h, None), PartitionSpec(None, h, None, None)
    meta_names = [n for n in METADATA if metadata.get(n) is not None]
    meta = [jnp.asarray(metadata[n]) for n in meta_names]
    per_head = {"A_log": PartitionSpec(h), "dt_bias": PartitionSpec(h, None)}
    head_names = [n for n in per_head if features.get(n) is not None]
    rest = {n: v for n, v in features.items() if n not in head_names}
    args = (*x, pool, *meta, *(jnp.asarray(features[n]) for n in head_names))
    gates = [tok if len(a.shape) == 3 else PartitionSpec(None, h) for a in x]  # scalar: (T, H)
    specs = (
        *gates, slots, *(PartitionSpec(),) * len(meta), *(per_head[n] for n in head_names)
    )  # fmt: skip
    args = reshard_explicit(plan.mesh, args, specs)

    def body(*local):
        xs, pool_ = local[:6], local[6]
        given = dict(zip(meta_names, local[7 : 7 + len(meta)], strict=True))
        meta_ = {n: given.get(n) for n in METADATA}
        heads_ = dict(zip(head_names, local[7 + len(meta) :], strict=True))
        return fn(*xs, pool_, meta_, heads_ | rest)

    mapped = shard_map(
        body, mesh=plan.mesh, in_specs=specs, out_specs=(tok, slots), check_vma=False,
        axis_names=frozenset(plan.head_axes),
    )  # fmt: skip
    return mapped(*args)
