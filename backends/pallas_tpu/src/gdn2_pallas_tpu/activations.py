"""Gate activations and the q/k L2 norm inside the kernels (fla's ``use_*_in_kernel`` options).

The kernels read the raw q, k, b, w, g once, activate them in VMEM, and never write an activated
tensor to HBM or keep one as a residual: the backward reads the raw inputs again, re-activates
them, and turns the gradients of the activated values into gradients of the raw ones (and of
``A_log`` and ``dt_bias``, as per-step partial sums that XLA adds up).

With ``a = exp(A_log[h])`` and ``s(x) = sigmoid(x)``:

- L2 norm: ``y = x r``, ``r = (sum over dk of x^2 + eps)^(-1/2)``; ``dx = r (dy - y sum(y dy))``.
- ``b = s(b_raw)`` (``2 s(b_raw)`` with negative eigenvalues), ``w = s(w_raw)``;
  ``d raw = d s (1 - s)`` (times 2).
- softplus gate: ``g = -a softplus(g_raw + dt_bias)``; ``dg_raw = -dg a s(g_raw + dt_bias)``,
  ``d dt_bias = sum dg_raw``, ``dA_log = sum dg g`` (``dg/dA_log = g``).
- lower-bound gate: ``g = lb s(a g_raw)``; ``dg_raw = dg lb s (1 - s) a``,
  ``dA_log = sum dg lb s (1 - s) a g_raw``.

Tokens past the end of the sequence (the padding of the last grid step) get ``g = 0`` so that
they leave the state unchanged (a fused gate would otherwise turn their zero input into a decay).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gdn2_pallas_tpu.chunk_math import ZERO, iota

F32 = jnp.float32


def _sigmoid(x: jax.Array) -> jax.Array:
    return 1.0 / (1.0 + jnp.exp(-x))


def _softplus(x: jax.Array) -> jax.Array:
    return jnp.maximum(x, ZERO) + jnp.log(1.0 + jnp.exp(-jnp.abs(x)))


@dataclasses.dataclass(frozen=True)
class Activated:
    """The activated inputs of a batch of units, and what their backward needs."""

    q: jax.Array  # [U, C, K]
    k: jax.Array  # [U, C, K]
    b: jax.Array  # [U, C, K]
    w: jax.Array  # [U, C, V]
    g: jax.Array  # [U, C, K] log decay (before the G_FLOOR clamp)
    q_rnorm: jax.Array | None  # [U, C, 1] 1 / ||q_raw|| (L2 norm)
    k_rnorm: jax.Array | None  # [U, C, 1]


def valid_rows(plan, step) -> jax.Array:
    """[U, C, 1] bool: rows that are tokens of the sequence (not the padding of the last step)."""
    shape = (plan.hb, plan.nc, plan.C, 1)
    token = step * plan.step_len + iota(shape, 1) * plan.C + iota(shape, 2)
    return (token < plan.seq_len).reshape(plan.units, plan.C, 1)


def activate(q, k, b, w, g, gate_params, act, eps: float, valid) -> Activated:
    """Apply ``act`` (gdn2core.plugin.Activations) to raw [U, C, d] float32 inputs.
    ``gate_params`` [U, 2, K]: row 0 ``exp(A_log)``, row 1 ``dt_bias`` (None without a gate)."""
    q_r = k_r = None
    if act.qk_l2norm:
        q_r = jax.lax.rsqrt(jnp.sum(q * q, axis=2, keepdims=True) + eps)  # [U, C, 1]
        k_r = jax.lax.rsqrt(jnp.sum(k * k, axis=2, keepdims=True) + eps)
        q, k = q * q_r, k * k_r
    if act.bw_sigmoid:
        b = _sigmoid(b) * (2.0 if act.neg_eigval else 1.0)
        w = _sigmoid(w)
    if act.gate != "none":
        a, dt = gate_params[:, 0:1, :], gate_params[:, 1:2, :]  # [U, 1, K]
        softplus = act.gate == "softplus"
        g = -a * _softplus(g + dt) if softplus else act.lower_bound * _sigmoid(a * g)
        g = jnp.where(valid, g, ZERO)
    return Activated(q, k, b, w, g, q_r, k_r)


def raw_gradients(x: Activated, raw_g, gate_params, act, valid, dq, dk, db, dw, dg):
    """Gradients of the raw inputs from those of the activated ones; plus the per-unit partial
    sums ``[U, 2, K]`` of ``dA_log`` (row 0, still to be summed over K) and ``d dt_bias`` (row 1),
    or None without a gate. ``valid`` [U, C, 1]: padding rows contribute nothing."""
    if act.qk_l2norm:
        dq = x.q_rnorm * (dq - x.q * jnp.sum(x.q * dq, axis=2, keepdims=True))
        dk = x.k_rnorm * (dk - x.k * jnp.sum(x.k * dk, axis=2, keepdims=True))
    if act.bw_sigmoid:
        scale = 2.0 if act.neg_eigval else 1.0
        s_b = x.b / scale  # sigmoid(b_raw)
        db = db * scale * s_b * (1.0 - s_b)
        dw = dw * x.w * (1.0 - x.w)
    partial = None
    if act.gate != "none":
        a, dt = gate_params[:, 0:1, :], gate_params[:, 1:2, :]  # [U, 1, K]
        if act.gate == "softplus":
            d_raw = -dg * a * _sigmoid(raw_g + dt)  # [U, C, K]
            d_log_a = dg * x.g  # dg/dA_log = g
            d_dt = d_raw
        else:
            s = _sigmoid(a * raw_g)
            d_raw = dg * act.lower_bound * s * (1.0 - s) * a
            d_log_a = jnp.where(d_raw == 0, ZERO, d_raw * raw_g)  # raw_g = -inf pads (varlen.py)
            d_dt = jnp.zeros_like(d_raw)
        d_raw = jnp.where(valid, d_raw, ZERO)
        d_log_a = jnp.where(valid, d_log_a, ZERO)
        d_dt = jnp.where(valid, d_dt, ZERO)
        dg = d_raw
        partial = jnp.concatenate(
            [jnp.sum(d_log_a, axis=1, keepdims=True), jnp.sum(d_dt, axis=1, keepdims=True)],
            axis=1,
        )  # [U, 2, K]
    return dq, dk, db, dw, dg, partial
