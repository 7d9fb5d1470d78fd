"""``shard_map`` across the supported JAX versions (``jax.shard_map`` since 0.7; the experimental
module before), with the replication check switched by one keyword."""

from __future__ import annotations

from typing import Any

import jax

try:  # JAX >= 0.7 (0.11.2 and 0.12 both have it)
    _public_shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - older JAX
    _public_shard_map = None


def shard_map(
    f,
    *,
    mesh: Any,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool = True,
    axis_names: frozenset[str] | None = None,
):
    """``jax.shard_map(f, mesh=..., in_specs=..., out_specs=..., check_vma=..., axis_names=...)``
    on any JAX. ``axis_names``: the mesh axes made manual (None: all); the others stay automatic."""
    names = frozenset(mesh.axis_names if axis_names is None else axis_names)
    if _public_shard_map is not None:
        kw = {} if names == frozenset(mesh.axis_names) else {"axis_names": names}
        return _public_shard_map(
            f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma, **kw
        )
    from jax.experimental.shard_map import shard_map as legacy  # pragma: no cover

    auto = frozenset(mesh.axis_names) - names  # pragma: no cover
    return legacy(  # pragma: no cover
        f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_vma, auto=auto
    )
