"""Finding the mesh and the mesh axes that shard batch, heads and (opt-in) time for one call.

See the package docstring (:mod:`gdn2core.sharding`) for the rules; :func:`resolve_plan` is their
single implementation.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from gdn2core.ops.forward.spec import OpSpec

log = logging.getLogger("gdn2core")

AxisNames = tuple[str, ...]
AxesArg = str | Sequence[str] | None


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How one call is split: the mesh and the mesh axes of batch, heads and time."""

    mesh: Any  # jax.sharding.Mesh or AbstractMesh
    batch_axes: AxisNames
    head_axes: AxisNames
    context_axis: str | None = None

    def size(self, axes: AxisNames) -> int:
        return math.prod(int(self.mesh.shape[a]) for a in axes)

    @property
    def batch_shards(self) -> int:
        return self.size(self.batch_axes)

    @property
    def head_shards(self) -> int:
        return self.size(self.head_axes)

    @property
    def context_shards(self) -> int:
        return 1 if self.context_axis is None else int(self.mesh.shape[self.context_axis])

    @property
    def used_axes(self) -> frozenset[str]:
        """The mesh axes this plan splits (made manual in shard_map; the others stay automatic)."""
        ctx = () if self.context_axis is None else (self.context_axis,)
        return frozenset((*self.batch_axes, *self.head_axes, *ctx))

    @property
    def is_trivial(self) -> bool:
        """One shard in every direction: the plain (unsharded) path runs."""
        return self.batch_shards * self.head_shards * self.context_shards == 1

    def _entry(self, axes: AxisNames):
        if not axes:
            return None
        return axes[0] if len(axes) == 1 else axes

    @property
    def token_spec(self) -> PartitionSpec:
        """PartitionSpec of q, k, v, w, b, g and o ``(B, T, H, d)``."""
        return PartitionSpec(
            self._entry(self.batch_axes), self.context_axis, self._entry(self.head_axes), None
        )

    @property
    def state_spec(self) -> PartitionSpec:
        """PartitionSpec of h0 and h_final ``(B, H, dk, dv)`` (replicated over the time axis)."""
        return PartitionSpec(self._entry(self.batch_axes), self._entry(self.head_axes), None, None)

    def local_spec(self, spec: OpSpec) -> OpSpec:
        """The spec each device's backend call sees (heads of every kind split alike; with
        cu_seqlens, whose one row is never split over batch, the sequences all stay)."""
        return dataclasses.replace(
            spec,
            batch=spec.batch // self.batch_shards,
            heads=spec.heads // self.head_shards,
            value_heads=spec.value_heads // self.head_shards,
            gate_heads=spec.gate_heads // self.head_shards,
            seq_len=spec.seq_len // self.context_shards,
        )

    def describe(self) -> str:
        shape = dict(self.mesh.shape)
        return (
            f"mesh {shape}: batch over {self.batch_axes or '-'}, heads over "
            f"{self.head_axes or '-'}, time over {self.context_axis or '-'}"
        )


def axis_names_of(entry: Any) -> AxisNames:
    """Axis names of one PartitionSpec entry or keyword value (None, a name, or a sequence)."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry)


def visible_sharding(x: Any) -> tuple[Any, PartitionSpec | None, frozenset[str]] | None:
    """(mesh, spec, authoritative axes) of what JAX lets us see of ``x``'s sharding, or None.

    A concrete ``jax.Array`` shows its ``NamedSharding``: the spec is authoritative for every mesh
    axis. A tracer (inside ``jax.jit``) shows the sharding of its type: the mesh always (when the
    call's arguments are on one), the spec only for mesh axes of type ``Explicit``.
    """
    if isinstance(x, jax.core.Tracer):
        try:
            sharding = jax.typeof(x).sharding
        except Exception:  # pragma: no cover - avals without sharding
            return None
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or mesh.empty:
            return None
        explicit = frozenset(
            n
            for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
            if t == AxisType.Explicit
        )
        return mesh, sharding.spec, explicit
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return sharding.mesh, sharding.spec, frozenset(sharding.mesh.axis_names)
    return None


def context_mesh() -> Any:
    """The mesh of ``jax.set_mesh`` (concrete outside jit, abstract inside), or None."""
    for get in ("get_mesh", "get_abstract_mesh"):
        getter = getattr(jax.sharding, get, None)
        if getter is None:
            continue
        try:
            ctx = getter()
        except ValueError:  # get_mesh inside jax.jit
            continue
        if ctx is not None and not ctx.empty:
            return ctx
    return None


def find_mesh(q: Any, mesh: Any, asked: bool, keywords: str) -> tuple[Any, Any]:
    """``(mesh, visible)``: the mesh of a call and what JAX shows of q's sharding
    (:func:`visible_sharding`). The mesh is ``mesh``, else q's, else, only when some axis keyword
    was ``asked`` for, the mesh of ``jax.set_mesh``; None: no mesh.

    Raises:
        ValueError: axis keywords (``keywords`` names them) given and no mesh anywhere.
    """
    visible = visible_sharding(q)
    if mesh is None and visible is not None:
        mesh = visible[0]
    if mesh is None and asked:
        mesh = context_mesh()
        if mesh is None:
            raise ValueError(
                f"{keywords} given but no mesh: pass mesh=, put the inputs on a NamedSharding, "
                "or call inside `with jax.set_mesh(mesh):`"
            )
    return mesh, visible


def manual_axes(mesh: Any) -> frozenset[str]:
    """The mesh axes already manual (inside someone's shard_map): never ours to split."""
    return frozenset(
        n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Manual
    )


def check_axes(mesh: Any, kind: str, axes: AxisNames) -> None:
    for a in axes:
        if a not in mesh.axis_names:
            raise ValueError(f"{kind}: {a!r} is not an axis of the mesh {dict(mesh.shape)}")


def resolve_plan(
    spec: OpSpec,
    q: Any,
    *,
    mesh: Any = None,
    batch_axes: AxesArg = None,
    head_axes: AxesArg = None,
    context_axis: str | None = None,
) -> ShardPlan | None:
    """The plan of one call, or None for the plain (single-shard) path.

    Raises ``ValueError`` naming the problem when the sharding cannot be honoured (an unknown axis,
    a size not divisible by its shards, the time or channel axis sharded without ``context_axis``).
    """
    asked = any(a is not None for a in (batch_axes, head_axes, context_axis))
    mesh, visible = find_mesh(q, mesh, asked, "gdn2: batch_axes/head_axes/context_axis")
    if mesh is None or mesh.size == 1:
        return None

    manual = manual_axes(mesh)
    if context_axis is not None:
        check_axes(mesh, "context_axis", (context_axis,))

    # What the inputs' sharding says, when it is visible and on this very mesh.
    seen_b: AxisNames = ()
    seen_h: AxisNames = ()
    authoritative: frozenset[str] = frozenset()
    if visible is not None and tuple(visible[0].axis_names) == tuple(mesh.axis_names):
        vspec = tuple(visible[1]) + (None,) * (4 - len(tuple(visible[1])))
        authoritative = visible[2]
        seen_b, seen_t, seen_h, seen_c = (tuple(axis_names_of(e)) for e in vspec[:4])
        if seen_c:
            raise ValueError(
                f"gdn2: the channel axis of q is sharded over {seen_c}; shard batch, heads or "
                "(with context_axis) time instead"
            )
        if seen_t and context_axis is None:
            raise ValueError(
                f"gdn2: the time axis of q is sharded over {seen_t}; pass context_axis="
                f"{seen_t[0]!r} for context parallelism (or replicate time)"
            )
        if seen_t and seen_t != (context_axis,):
            raise ValueError(
                f"gdn2: the time axis of q is sharded over {seen_t} but context_axis="
                f"{context_axis!r}"
            )

    b_axes = axis_names_of(batch_axes) if batch_axes is not None else seen_b
    h_axes = axis_names_of(head_axes) if head_axes is not None else seen_h
    check_axes(mesh, "batch_axes", b_axes)
    check_axes(mesh, "head_axes", h_axes)

    # Axes nobody assigned and whose role the inputs do not show: batch first, then heads, while
    # the sizes divide (a guess for Auto meshes under jit; pass batch_axes/head_axes to be exact).
    if batch_axes is None or head_axes is None:
        taken = set(b_axes) | set(h_axes) | {context_axis} | authoritative | manual
        free = [a for a in mesh.axis_names if a not in taken]
        for a in free:
            n = int(mesh.shape[a])
            if (
                batch_axes is None
                and spec.batch % (math.prod(mesh.shape[x] for x in b_axes) * n) == 0
            ):
                b_axes = (*b_axes, a)
            elif (
                head_axes is None
                and spec.heads % (math.prod(mesh.shape[x] for x in h_axes) * n) == 0
            ):
                h_axes = (*h_axes, a)

    used = [*b_axes, *h_axes, *([context_axis] if context_axis else [])]
    if len(set(used)) != len(used):
        raise ValueError(
            f"gdn2: a mesh axis is used twice: batch {b_axes}, heads {h_axes}, "
            f"time {context_axis!r}"
        )
    bad = [a for a in used if a in manual]
    if bad:
        raise ValueError(f"gdn2: mesh axes {bad} are already manual (inside a shard_map)")

    plan = ShardPlan(mesh, tuple(b_axes), tuple(h_axes), context_axis)
    for what, n, total in (
        ("B", plan.batch_shards, spec.batch),
        ("H", plan.head_shards, spec.heads),
        ("T", plan.context_shards, spec.seq_len),
    ):
        if total % n:
            raise ValueError(
                f"gdn2: {what}={total} is not divisible by its {n} shards ({plan.describe()}); "
                + (
                    "pad the sequence with k = 0, g = 0 tokens (they leave the state unchanged)"
                    if what == "T"
                    else "choose other mesh axes"
                )
            )
    if plan.is_trivial:
        return None
    log.debug("gdn2: sharded call, %s", plan.describe())
    return plan
