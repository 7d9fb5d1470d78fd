"""The fused activations (fla's names): validating the gate parameters, and the XLA path that
applies the activations for backends that do not fuse them.

With :class:`~gdn2core.options.Activations` ``act`` (``docs/operator.md``, section Activations):

- ``act.qk_l2norm``: ``q = q / sqrt(sum(q^2 over dk) + L2NORM_EPS)``, the same for k;
- ``act.gate`` SOFTPLUS: ``g = -exp(A_log[h]) * softplus(g + dt_bias[h])`` (per channel);
  LOWER_BOUND: ``g = lower_bound * sigmoid(exp(A_log[h]) * g)`` (no dt_bias);
- ``act.bw_sigmoid``: ``b = sigmoid(b)`` (``2 * sigmoid(b)`` with ``act.neg_eigval``),
  ``w = sigmoid(w)``.

The XLA path (:func:`apply_activations`) computes in the state dtype (float32; float64 for
float64 inputs) and rounds the activated tensors to the input dtype, since a backend takes one
common dtype; it is differentiable in the raw inputs, ``A_log`` and ``dt_bias``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gdn2core.options import L2NORM_EPS, Activations, GateMode


def check_gate_params(act: Activations, A_log: Any, dt_bias: Any, gate_heads: int, dk: int) -> None:
    """Validate ``A_log`` and ``dt_bias`` against the activations of a call.

    Args:
        act: the call's activations.
        A_log: None or an array.
        dt_bias: None or an array.
        gate_heads: Hg, the heads of b and g.
        dk: the key size.

    Raises:
        ValueError: a parameter missing for the fused gate, given without it (or, ``dt_bias``,
            with ``lower_bound``, which does not use it), or of the wrong shape.
        TypeError: a non-array or a non-floating dtype.
    """
    if act.gate == GateMode.NONE:
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if x is not None:
                raise ValueError(
                    f"{name}: given but use_gate_in_kernel=False (it is a parameter of the fused "
                    "gate); pass use_gate_in_kernel=True or leave it None"
                )
        return
    needs_bias = act.gate == GateMode.SOFTPLUS
    params = [("A_log", A_log, (gate_heads,), "(Hg,)")]
    if needs_bias:
        params.append(("dt_bias", dt_bias, (gate_heads, dk), "(Hg, dk)"))
    elif dt_bias is not None:
        raise ValueError(
            "dt_bias: given with lower_bound, whose gate lower_bound * sigmoid(exp(A_log) * g) "
            "does not use it; add it to g before the call, or leave it None"
        )
    for name, x, shape, axes in params:
        if x is None:
            mode = "lower_bound" if not needs_bias else "softplus"
            raise ValueError(
                f"{name}: expected an array of shape {axes} = {shape} with use_gate_in_kernel=True "
                f"({mode} gate), got None"
            )
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
        if not jnp.issubdtype(jnp.dtype(x.dtype), jnp.floating):
            raise TypeError(f"{name}: expected a floating dtype, got {jnp.dtype(x.dtype).name}")
        actual = tuple(int(s) for s in x.shape)
        if actual != shape:
            raise ValueError(
                f"{name}: expected shape {axes} = {shape} (Hg = heads of b and g), got {actual}"
            )


def l2norm(x: jax.Array) -> jax.Array:
    """``x / sqrt(sum(x^2 over the last axis) + L2NORM_EPS)``.

    Args:
        x: ``(..., dk)``.

    Returns:
        The normalised ``x``, same shape and dtype.
    """
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def gate(act: Activations, g: jax.Array, A_log: jax.Array, dt_bias: jax.Array | None) -> jax.Array:
    """The fused gate of ``act`` on raw ``g`` ``(..., Hg, dk)``.

    Args:
        act: the activations (``act.gate`` not NONE).
        g: the raw gate input ``(..., Hg, dk)``.
        A_log: ``(Hg,)``.
        dt_bias: ``(Hg, dk)`` (softplus gate) or None.

    Returns:
        The log decay, shape of ``g``.
    """
    rate = jnp.exp(A_log)[:, None]  # [Hg, 1]
    if act.gate == GateMode.SOFTPLUS:
        return -rate * jax.nn.softplus(g + dt_bias)
    return act.lower_bound * jax.nn.sigmoid(rate * g)


def apply_activations(
    act: Activations, q, k, w, b, g, A_log=None, dt_bias=None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """The activated ``(q, k, w, b, g)`` of raw inputs, in XLA (the core's path for backends
    without ``Capabilities.fused_activations``).

    Args:
        act: the activations.
        q, k: ``(B, T, H, dk)``; w: ``(B, T, HV, dv)``; b, g: ``(B, T, Hg, dk)``; one dtype.
        A_log, dt_bias: the gate parameters (as :func:`check_gate_params` admits).

    Returns:
        ``(q, k, w, b, g)`` activated, in the input dtype (computed in the state dtype).
    """
    dtype = q.dtype
    acc = jnp.float64 if dtype == jnp.float64 else jnp.float32

    def up(x):
        return x.astype(acc)

    if act.qk_l2norm:
        q, k = l2norm(up(q)).astype(dtype), l2norm(up(k)).astype(dtype)
    if act.bw_sigmoid:
        b = ((2.0 if act.neg_eigval else 1.0) * jax.nn.sigmoid(up(b))).astype(dtype)
        w = jax.nn.sigmoid(up(w)).astype(dtype)
    if act.gate != GateMode.NONE:
        bias = None if dt_bias is None else up(dt_bias)
        g = gate(act, up(g), up(A_log), bias).astype(dtype)
    return q, k, w, b, g
