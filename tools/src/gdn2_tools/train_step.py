"""The train step every tool compiles, and its sharded input specs. Plain functions of arrays, to
be wrapped in ``jax.jit``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from gdn2_conformance.checks import cotangent_loss
from gdn2core.ops.forward.api import gdn2_forward_trainable


def train_step(*, gates: Callable | None = None, **op_kwargs: Any):
    """``step(q, k, v, w, b, g, h0, do, dh) -> (loss, (o, h_final), grads)``.

    Args:
        gates: ``(w, b, g) -> (w, b, g)`` applied inside the differentiated function before the
            op (e.g. scalar gates broadcast in XLA: their gradients then flow back through it);
            None: the gates go to the op as they are.
        **op_kwargs: keywords of :func:`gdn2core.gdn2_forward_trainable` (``backend``,
            ``config``, ``mesh``, ``batch_axes``, ``head_axes``, ``context_axis``, ``scale``).

    Returns:
        The step: ``loss = sum(o * do) + sum(h_final * dh)`` and its gradients in the seven
        arguments q, k, v, w, b, g, h0.
    """

    def loss(q, k, v, w, b, g, h0, do, dh):
        if gates is not None:
            w, b, g = gates(w, b, g)
        o, h = gdn2_forward_trainable(q, k, v, w, b, g, h0=h0, **op_kwargs)
        return cotangent_loss(o, h, do, dh), (o, h)

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
    scalar_gates: tuple[str, ...] = (),
    decay_dtype: Any = None,
) -> tuple[jax.ShapeDtypeStruct, ...]:
    """``ShapeDtypeStruct`` of ``(q, k, v, w, b, g, h0, do, dh)`` with their ``NamedSharding``.

    Args:
        mesh: the mesh.
        B, T, H, dk, dv: the shape.
        dtype: the input dtype, and do's: the upstream gradient of o arrives in o's dtype in a
            model, as ``gdn2 bench`` passes it (h0 and dh are float32, the state's dtype).
        batch_axes, head_axes, context_axis: mesh axes sharding batch, heads and time (None or
            ``()``: replicated).
        scalar_gates: the gates (of ``"w"``, ``"b"``, ``"g"``) given as ``(B, T, H)`` scalar
            gates, one value per head and token.
        decay_dtype: g's dtype (None: ``dtype``; float32 beside bfloat16 as fla's layers pass it).

    Returns:
        The nine specs.
    """

    def entry(axes):
        return None if axes is None or axes == () else axes

    tok = NamedSharding(
        mesh, PartitionSpec(entry(batch_axes), context_axis, entry(head_axes), None)
    )
    st = NamedSharding(mesh, PartitionSpec(entry(batch_axes), entry(head_axes), None, None))
    key = jax.ShapeDtypeStruct((B, T, H, dk), dtype, sharding=tok)
    val = jax.ShapeDtypeStruct((B, T, H, dv), dtype, sharding=tok)
    state = jax.ShapeDtypeStruct((B, H, dk, dv), jnp.float32, sharding=st)
    dout = jax.ShapeDtypeStruct((B, T, H, dv), dtype, sharding=tok)
    per_token = NamedSharding(
        mesh, PartitionSpec(entry(batch_axes), context_axis, entry(head_axes))
    )
    scalar = jax.ShapeDtypeStruct((B, T, H), dtype, sharding=per_token)
    w, b, g = (scalar if n in scalar_gates else x for n, x in (("w", val), ("b", key), ("g", key)))
    if decay_dtype is not None:
        g = jax.ShapeDtypeStruct(g.shape, decay_dtype, sharding=g.sharding)
    return (key, key, val, w, b, g, state, dout, state)
