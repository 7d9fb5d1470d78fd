"""Scalar gates: one value per head and token, the same on every channel.

KDA's beta and GDN's beta and decay are one number per head and token. ``gdn2_forward`` takes
them as they are: ``b``, ``g`` ``(B, T, Hg)`` and ``w`` ``(B, T, HV)`` mean the ``(B, T, Hg, dk)``
/ ``(B, T, HV, dv)`` arrays with that value on every channel (``OpSpec.scalar_gates`` names
them). A backend that declares ``Capabilities.scalar_gates`` receives them so (its kernels read
4 bytes per head and token, not ``d`` values, and write one gradient, not ``d``); for every other
backend, and where the core itself needs the full arrays (the activations in XLA, the ``G * dv``
value channels of grouped value heads), :func:`broadcast_gates` broadcasts them here, in XLA.
Sharded calls hand each shard its part of them (context parallelism too: sharding/run.py).
Either way the gradient of a scalar gate is the sum over its channels.

``gdn2_decode`` and ``gdn2_ragged`` take them the same way (``DecodeSpec.scalar_gates``, ``(N, S,
heads)``; ``RaggedSpec.scalar_gates``, ``(T, heads)``) and broadcast them before every backend
(their kernels take full gates: gdn2core.ops.decode.api says why).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from gdn2core.ops.decode.spec import DecodeSpec
from gdn2core.ops.forward.spec import SCALAR_GATE_NAMES, OpSpec
from gdn2core.ops.ragged.spec import RaggedSpec


def broadcast_gates[Spec: (OpSpec, DecodeSpec, RaggedSpec)](
    spec: Spec, w: jax.Array, b: jax.Array, g: jax.Array, names: Sequence[str] | None = None
) -> tuple[Spec, jax.Array, jax.Array, jax.Array]:
    """Broadcast scalar gates to their channels.

    Args:
        spec: the spec the gates belong to (``spec.scalar_gates`` names the scalar ones); the
            spec of the call the backend receives when its heads differ (grouped value heads).
            A decode call's spec likewise, its ``(N, S, ...)`` gates as ``(B, T, ...)``, and a
            ragged call's, its flat ``(T, ...)`` gates without the batch axis.
        w: ``(B, T, HV)`` when scalar, else ``(B, T, HV, dv)``.
        b, g: ``(B, T, Hg)`` when scalar, else ``(B, T, Hg, dk)``.
        names: the gates to broadcast (None: every scalar one).

    Returns:
        ``(spec, w, b, g)``: the spec without those names in ``scalar_gates``, and the gates,
        the named ones ``(..., d)`` with ``d = spec.dv`` for w, ``spec.dk`` for b and g.
    """
    names = spec.scalar_gates if names is None else tuple(names)
    sizes = {"w": spec.dv, "b": spec.dk, "g": spec.dk}
    out = {"w": w, "b": b, "g": g}
    for name in names:
        if name in spec.scalar_gates:
            x = out[name]
            out[name] = jnp.broadcast_to(x[..., None], (*x.shape, sizes[name]))  # [B, T, H, d]
    kept = tuple(n for n in spec.scalar_gates if n not in names)
    return dataclasses.replace(spec, scalar_gates=kept), out["w"], out["b"], out["g"]


__all__ = ["SCALAR_GATE_NAMES", "broadcast_gates"]
