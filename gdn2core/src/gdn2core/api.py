"""The public functions: validate, pick the backend, run it."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn2core.config import DEFAULT_CONFIG, KernelConfig
from gdn2core.reference import state_dtype
from gdn2core.selection import AUTO, resolve_backend
from gdn2core.sharding.plan import AxesArg, resolve_plan
from gdn2core.sharding.run import sharded_call
from gdn2core.spec import OpSpec

Out = tuple[Float[Array, "B T H dv"], Float[Array, "B H dk dv"]]


def _prepare(q, k, v, w, b, g, scale, h0, config, backend, trainable):
    spec = OpSpec.from_inputs(q, k, v, w, b, g, scale, h0)
    if config is None:
        config = DEFAULT_CONFIG
    elif not isinstance(config, KernelConfig):
        raise TypeError(f"config: expected a KernelConfig or None, got {type(config).__name__}")
    chosen = resolve_backend(spec, config, backend, trainable=trainable)
    acc = state_dtype(q.dtype)
    h0 = jnp.zeros((spec.batch, spec.heads, spec.dk, spec.dv), acc) if h0 is None else h0
    return spec, config, chosen, h0.astype(acc)


def _run(method, chosen, spec, config, q, k, v, w, b, g, h0, sharding):
    """The backend call, per shard when the inputs (or the keywords) ask for a mesh."""
    plan = resolve_plan(spec, q, **sharding)
    if plan is None:
        return method(q, k, v, w, b, g, h0, spec=spec, config=config)
    return sharded_call(
        method, plan, q, k, v, w, b, g, h0,
        spec=spec, config=config,
        supports=lambda local: chosen.supports(local, config),
        check_vma=getattr(chosen, "shard_map_check_vma", False),
    )  # fmt: skip


def gdn2_forward(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T H dv"],
    w: Float[Array, "B T H dv"],
    b: Float[Array, "B T H dk"],
    g: Float[Array, "B T H dk"],
    scale: float | None = None,
    h0: Float[Array, "B H dk dv"] | None = None,
    config: KernelConfig | None = None,
    backend: str = AUTO,
    *,
    mesh=None,
    batch_axes: AxesArg = None,
    head_axes: AxesArg = None,
    context_axis: str | None = None,
) -> Out:
    """GDN-2 forward (inference). Returns ``(o, h_final)``; see OPERATOR.md for the contract.

    ``backend``: a name from ``list_backends()``, or ``"auto"`` (the ``GDN2_BACKEND`` environment
    variable, else the highest-priority backend that supports the call).

    Sharding (see :mod:`gdn2core.sharding`): with the inputs on a multi-device mesh, or given
    ``mesh=``, the backend runs once per device on its own shard inside ``shard_map``: batch over
    ``batch_axes``, heads over ``head_axes`` (default: read from the inputs' ``NamedSharding``)
    and, opt-in, time over ``context_axis`` (context parallelism; ``T`` must divide evenly).
    """
    spec, config, chosen, h0 = _prepare(q, k, v, w, b, g, scale, h0, config, backend, False)
    sharding = dict(
        mesh=mesh, batch_axes=batch_axes, head_axes=head_axes, context_axis=context_axis
    )
    return _run(chosen.forward, chosen, spec, config, q, k, v, w, b, g, h0, sharding)


def gdn2_forward_trainable(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T H dv"],
    w: Float[Array, "B T H dv"],
    b: Float[Array, "B T H dk"],
    g: Float[Array, "B T H dk"],
    scale: float | None = None,
    h0: Float[Array, "B H dk dv"] | None = None,
    config: KernelConfig | None = None,
    backend: str = AUTO,
    *,
    mesh=None,
    batch_axes: AxesArg = None,
    head_axes: AxesArg = None,
    context_axis: str | None = None,
) -> Out:
    """GDN-2 forward, differentiable in q, k, v, w, b, g and h0 (cotangents on o and h_final).

    Sharding keywords as for :func:`gdn2_forward`; gradients flow through the per-shard calls and
    the (small) context-parallel collectives.
    """
    spec, config, chosen, h0 = _prepare(q, k, v, w, b, g, scale, h0, config, backend, True)
    sharding = dict(
        mesh=mesh, batch_axes=batch_axes, head_axes=head_axes, context_axis=context_axis
    )
    return _run(chosen.forward_trainable, chosen, spec, config, q, k, v, w, b, g, h0, sharding)


def which_backend(
    q, k, v, w, b, g, scale=None, h0=None, config=None, backend: str = AUTO, trainable=True
) -> str:
    """The name of the backend a call with these arguments would run (nothing is computed)."""
    *_, chosen, _ = _prepare(q, k, v, w, b, g, scale, h0, config, backend, trainable)
    return chosen.name


__all__ = ["gdn2_forward", "gdn2_forward_trainable", "which_backend"]
