"""The fused activations (fla's names): validating the gate parameters, and the XLA path that
applies the activations for backends that do not fuse them.

With :class:`~gdn2core.options.Activations` ``act`` (``docs/operator.md``, section Activations),
``rate = exp(clip(A_log[h], *A_LOG_RANGE))`` and ``x = g + dt_bias[h]`` (``dt_bias`` absent: 0):

- ``act.qk_l2norm``: ``q = q / sqrt(sum(q^2 over dk) + L2NORM_EPS)``, the same for k;
- ``act.gate`` SOFTPLUS: ``g = -rate * softplus(x)`` (per channel; ``dt_bias`` required);
  LOWER_BOUND: ``g = lower_bound * sigmoid(rate * x)`` (fla's "safe gate"; ``dt_bias`` optional);
- ``act.bw_sigmoid``: ``b = sigmoid(b)`` (``2 * sigmoid(b)`` with ``act.neg_eigval``),
  ``w = sigmoid(w)``.

Exact at any input, infinities included: :func:`sigmoid` and :func:`softplus` exponentiate only
``-min(|x|, cut)`` (never an infinity; ``exp(-cut)`` is 0 in the dtype) and divide only by
``1 + t`` in ``[1, 2]``; ``sigmoid(+-inf) = 1, 0``, ``softplus(-inf) = 0``, ``softplus(inf) = inf``.
The rate is finite and nonzero, and the factor it multiplies is held finite (``softplus`` below
the dtype's largest float, ``x`` within it), so that no gradient is ``0 * inf``: where a gate is
flat (saturated, or a full erase ``g = -inf``) its gradients are 0, not NaN. The values are those
of the plain formulas (a held factor only turns an infinite ``g`` into one below any decay floor).

The XLA path (:func:`apply_activations`) computes in the state dtype (float32; float64 for
float64 inputs) and rounds each activated tensor to its input's dtype (a float32 ``g`` beside
bfloat16 inputs stays float32); it is differentiable in the raw inputs, ``A_log`` and ``dt_bias``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gdn2core.options import A_LOG_RANGE, L2NORM_EPS, Activations, GateMode, OpExtras


def check_gate_params(
    act: Activations, A_log: Any, dt_bias: Any, gate_heads: int, dk: int, per_head: bool = False
) -> None:
    """Validate ``A_log`` and ``dt_bias`` against the activations of a call.

    Args:
        act: the call's activations.
        A_log: None or an array.
        dt_bias: None or an array (required by the softplus gate, optional with
            ``lower_bound``).
        gate_heads: Hg, the heads of b and g.
        dk: the key size.
        per_head: ``dt_bias`` may also be ``(Hg,)``, one bias per head (a scalar ``g``, whose
            activation is then the same on every channel; :func:`per_channel_bias`).

    Raises:
        ValueError: a parameter missing for the fused gate, given without it, or of the wrong
            shape.
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
    mode = "softplus" if act.gate == GateMode.SOFTPLUS else "lower_bound"
    params = [("A_log", A_log, (gate_heads,), "(Hg,)")]
    if act.gate == GateMode.SOFTPLUS or dt_bias is not None:  # optional with lower_bound
        if per_head and getattr(dt_bias, "ndim", None) == 1:
            params.append(("dt_bias", dt_bias, (gate_heads,), "(Hg,) (one bias per head)"))
        else:
            params.append(("dt_bias", dt_bias, (gate_heads, dk), "(Hg, dk)"))
    for name, x, shape, axes in params:
        if x is None:
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


def per_channel_dt_bias(dt_bias: Any, dk: int) -> Any:
    """A per-head ``dt_bias`` ``(Hg,)`` broadcast to ``(Hg, dk)``; any other value as it is."""
    if dt_bias is None or dt_bias.ndim != 1:
        return dt_bias
    return jnp.broadcast_to(dt_bias[:, None], (dt_bias.shape[0], dk))


def per_channel_bias(extras: OpExtras, dk: int) -> OpExtras:
    """``extras`` with its ``dt_bias`` in the ``(Hg, dk)`` form every backend takes (the spec
    keeps that it was one per head: ``OpSpec.uniform_gate``)."""
    return dataclasses.replace(extras, dt_bias=per_channel_dt_bias(extras.dt_bias, dk))


def exp_cut(dtype: Any) -> float:
    """The ``|x|`` from which ``exp(-|x|)`` is exactly 0 in ``dtype`` (past half its smallest
    subnormal): 105 for float32, 746 for float64."""
    return float(np.ceil(-np.log(np.finfo(dtype).smallest_subnormal))) + 1.0


def _neg_exp_abs(x: jax.Array) -> jax.Array:
    """``exp(-|x|)`` in ``[0, 1]``, from a finite exponent (NaN stays NaN)."""
    return jnp.exp(-jnp.minimum(jnp.abs(x), exp_cut(x.dtype)))


@jax.custom_jvp
def sigmoid(x: jax.Array) -> jax.Array:
    """``1 / (1 + exp(-x))``, stable and exact at any input (module docstring)."""
    t = _neg_exp_abs(x)
    return jnp.where(x >= 0, jnp.ones_like(t), t) / (1.0 + t)


@sigmoid.defjvp
def _sigmoid_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    t = _neg_exp_abs(x)
    return sigmoid(x), t / ((1.0 + t) * (1.0 + t)) * dx  # sigmoid' = t / (1 + t)^2, finite


@jax.custom_jvp
def softplus(x: jax.Array) -> jax.Array:
    """``log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|))``, stable and exact at any input."""
    return jnp.maximum(x, 0.0) + jnp.log1p(_neg_exp_abs(x))


@softplus.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    return softplus(x), sigmoid(x) * dx


def l2norm(x: jax.Array) -> jax.Array:
    """``x / sqrt(sum(x^2 over the last axis) + L2NORM_EPS)``.

    Args:
        x: ``(..., dk)``.

    Returns:
        The normalised ``x``, same shape and dtype.
    """
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def gate(act: Activations, g: jax.Array, A_log: jax.Array, dt_bias: jax.Array | None) -> jax.Array:
    """The fused gate of ``act`` on raw ``g`` ``(..., Hg, dk)`` (module docstring).

    Args:
        act: the activations (``act.gate`` not NONE).
        g: the raw gate input ``(..., Hg, dk)``.
        A_log: ``(Hg,)``.
        dt_bias: ``(Hg, dk)``, or None (with ``lower_bound`` only: a bias of 0).

    Returns:
        The log decay, shape of ``g``.
    """
    big = jnp.finfo(g.dtype).max
    rate = jnp.exp(jnp.clip(A_log, *A_LOG_RANGE))[:, None]  # [Hg, 1], finite and > 0
    x = g if dt_bias is None else g + dt_bias
    if act.gate == GateMode.SOFTPLUS:
        return -rate * jnp.minimum(softplus(x), big)  # -inf only by overflow: no 0 * inf
    return act.lower_bound * sigmoid(rate * jnp.clip(x, -big, big))


def apply_activations(
    act: Activations, q, k, w, b, g, A_log=None, dt_bias=None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """The activated ``(q, k, w, b, g)`` of raw inputs, in XLA (the core's path for backends
    without ``Capabilities.fused_activations``).

    Args:
        act: the activations.
        q, k: ``(B, T, H, dk)``; w: ``(B, T, HV, dv)``; b, g: ``(B, T, Hg, dk)``; one dtype
            (g may be float32 beside bfloat16 inputs).
        A_log, dt_bias: the gate parameters (as :func:`check_gate_params` admits).

    Returns:
        ``(q, k, w, b, g)`` activated, computed in the state dtype; q, k, w, b in their input
        dtype, and an activated g in the state dtype: a float32 decay beside bfloat16 inputs
        (``checks.is_float32_decay``), as fla's kernels compute the gate and keep it (and as
        pallas_tpu's fused gate does in VMEM). A g not activated keeps its dtype.
    """
    dtype = q.dtype
    acc = jnp.float64 if dtype == jnp.float64 else jnp.float32

    def up(x):
        return x.astype(acc)

    if act.qk_l2norm:
        q, k = l2norm(up(q)).astype(dtype), l2norm(up(k)).astype(dtype)
    if act.bw_sigmoid:
        b = ((2.0 if act.neg_eigval else 1.0) * sigmoid(up(b))).astype(dtype)
        w = sigmoid(up(w)).astype(dtype)
    if act.gate != GateMode.NONE:
        bias = None if dt_bias is None else up(dt_bias)
        g = gate(act, up(g), up(A_log), bias)  # [..., Hg, dk] acc
    return q, k, w, b, g
