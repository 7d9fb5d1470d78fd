"""The sharded train step and its input specs: what tests, ``gdn2 mesh-report`` and benchmarks
compile. Everything here is a plain function of arrays, to be wrapped in ``jax.jit``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

#: The seven differentiable arguments, in order.
GRAD_NAMES = ("q", "k", "v", "w", "b", "g", "h0")


def train_step(**op_kwargs: Any):
    """``step(q, k, v, w, b, g, h0, do, dh) -> (loss, (o, h_final), grads)``.

    ``loss = sum(o * do) + sum(h_final * dh)`` (float32); ``grads`` are the gradients in the
    seven arguments. ``op_kwargs`` go to :func:`gdn2core.gdn2_forward_trainable` (``backend``,
    ``config``, ``mesh``, ``batch_axes``, ``head_axes``, ``context_axis``, ``scale``).
    """
    from gdn2core.api import gdn2_forward_trainable

    def loss(q, k, v, w, b, g, h0, do, dh):
        o, h = gdn2_forward_trainable(q, k, v, w, b, g, h0=h0, **op_kwargs)
        val = jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(h * dh)
        return val, (o, h)

    def step(q, k, v, w, b, g, h0, do, dh):
        (val, aux), grads = jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True)(
            q, k, v, w, b, g, h0, do, dh
        )
        return val, aux, grads

    return step


def input_specs(
    mesh: Any,
    B: int,
    T: int,
    H: int,
    dk: int,
    dv: int,
    *,
    dtype: Any = jnp.bfloat16,
    batch_axes: Any = None,
    head_axes: Any = None,
    context_axis: str | None = None,
) -> tuple[jax.ShapeDtypeStruct, ...]:
    """``ShapeDtypeStruct`` of ``(q, k, v, w, b, g, h0, do, dh)`` with their ``NamedSharding``."""

    def entry(axes):
        if axes is None or axes == ():
            return None
        return axes

    tok = NamedSharding(
        mesh, PartitionSpec(entry(batch_axes), context_axis, entry(head_axes), None)
    )
    st = NamedSharding(mesh, PartitionSpec(entry(batch_axes), entry(head_axes), None, None))
    key = jax.ShapeDtypeStruct((B, T, H, dk), dtype, sharding=tok)
    val = jax.ShapeDtypeStruct((B, T, H, dv), dtype, sharding=tok)
    state = jax.ShapeDtypeStruct((B, H, dk, dv), jnp.float32, sharding=st)
    dout = jax.ShapeDtypeStruct((B, T, H, dv), jnp.float32, sharding=tok)
    return (key, key, val, val, key, key, state, dout, state)
