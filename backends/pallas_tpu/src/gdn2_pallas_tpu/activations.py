"""Gate activations and the q/k L2 norm inside the kernels (fla's ``use_*_in_kernel`` options).

The kernels read the raw q, k, b, w, g once, activate them in VMEM, and never write an activated
tensor to HBM or keep one as a residual: the backward reads the raw inputs again, re-activates
them, and turns the gradients of the activated values into gradients of the raw ones (and of
``A_log`` and ``dt_bias``, as per-step partial sums that XLA adds up).

With ``a = exp(clip(A_log[h], *A_LOG_RANGE))`` (``exp(A_log)`` comes in, the clip is applied to
it here), ``x = g_raw + dt_bias`` in the gates (``dt_bias`` absent: 0) and ``s = sigmoid``:

- L2 norm: ``y = x r``, ``r = (sum over dk of x^2 + eps)^(-1/2)``; ``dx = r (dy - y sum(y dy))``.
- ``b = s(b_raw)`` (``2 s(b_raw)`` with negative eigenvalues), ``w = s(w_raw)``;
  ``d raw = d s (1 - s)`` (times 2).
- softplus gate: ``g = -a softplus(x)``; ``dg_raw = -dg a s(x)``, ``d dt_bias = sum dg_raw``,
  ``dA_log = sum dg g`` (``dg/dA_log = g``).
- lower-bound gate (fla's safe gate): ``g = lb s(y)``, ``y = a x``; with ``dy = dg lb s'(y)``:
  ``dg_raw = dy a``, ``d dt_bias = sum dg_raw``, ``dA_log = sum dy y``.
- ``dA_log`` is 0 where ``exp(A_log)`` lies outside the clip (the rate is constant there).

Exact at any input, infinities included, without relying on how Mosaic lowers ``exp`` or a
division at an infinity (``exp(-inf)``, ``1 / inf``): :func:`_sigmoid` and :func:`_softplus`
exponentiate only ``-min(|x|, EXP_CUT)`` (``exp(-EXP_CUT)`` is 0 in float32) and divide only by
``1 + t`` in ``[1, 2]``, so ``s(+-inf) = 1, 0``, ``softplus(-inf) = 0``, ``softplus(inf) = inf``
(``g = -inf``: a full erase, floored by the chunk math). The rate is finite and nonzero, so no
product is ``0 * inf``, and the backward multiplies an infinite value (``g = -inf``, ``y = +-inf``)
only by a gradient that is then exactly 0 through a held factor (``max(g, G_FLOOR)``,
``clip(y, +-EXP_CUT)``, with ``s'(y) = t / (1 + t)^2`` exactly 0 from ``|y| = EXP_CUT``): the
gradients are 0 where a gate is flat, never NaN. A raw ``g = -inf`` (the padding of packed
sequences, vjp.py) activates to ``g = 0`` in both gates, whatever ``A_log`` (the rate is > 0).

Tokens past the end of the sequence (the padding of the last grid step) get ``g = 0`` so that
they leave the state unchanged (a fused gate would otherwise turn their zero input into a decay).
"""

from __future__ import annotations

import dataclasses
from typing import Final

import jax
import jax.numpy as jnp
import numpy as np

from gdn2_pallas_tpu.chunk_math import (
    G_FLOOR,
    ZERO,
    clamp_log_decay,
    decay_row_bound,
    heads_max,
    iota,
)
from gdn2core.plugin import Activations

F32 = jnp.float32
#: ``exp(-x)`` is exactly 0 in float32 from here on (below half the smallest subnormal, and a
#: flushed subnormal on the TPU): the largest exponent magnitude the activations form.
EXP_CUT: Final = np.float32(105.0)
#: The clip of the rate ``exp(A_log)`` (:data:`gdn2core.options.A_LOG_RANGE`), float32.
RATE_MIN: Final = np.float32(np.exp(Activations.A_LOG_RANGE[0]))
RATE_MAX: Final = np.float32(np.exp(Activations.A_LOG_RANGE[1]))
ONE: Final = np.float32(1.0)


def _neg_exp_abs(x: jax.Array) -> jax.Array:
    """``exp(-|x|)`` in ``[0, 1]`` from a finite exponent (NaN stays NaN)."""
    return jnp.exp(-jnp.minimum(jnp.abs(x), EXP_CUT))


def _sigmoid(x: jax.Array) -> jax.Array:
    """``1 / (1 + exp(-x))`` for any x: ``where(x >= 0, 1, t) / (1 + t)``, ``t = exp(-|x|)``."""
    t = _neg_exp_abs(x)
    return jnp.where(x >= 0, ONE, t) / (ONE + t)


def _sigmoid_slope(x: jax.Array) -> jax.Array:
    """``sigmoid'(x) = t / (1 + t)^2``, ``t = exp(-|x|)``, for any x: 0 at +-inf, and exactly 0
    wherever ``t`` underflows (``|x| >= EXP_CUT`` at the latest)."""
    t = _neg_exp_abs(x)
    u = ONE + t
    return t / (u * u)


def _softplus(x: jax.Array) -> jax.Array:
    """``log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|))`` for any x (log1p: ``log(1 + t)``
    would round ``softplus(-30) = 9e-14`` to 0, and a large rate ``exp(A_log)`` scales it)."""
    return jnp.maximum(x, ZERO) + jnp.log1p(_neg_exp_abs(x))


def _rate(gate_params: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(a, dt, clipped)`` [U, 1, K] from ``gate_params`` [U, 2, K]: the clipped rate, the bias,
    and where ``exp(A_log)`` was outside the clip (there the gradient of A_log is 0)."""
    e, dt = gate_params[:, 0:1, :], gate_params[:, 1:2, :]
    return _clipped(e), dt, (e < RATE_MIN) | (e > RATE_MAX)


def _clipped(e: jax.Array) -> jax.Array:
    """The rate ``exp(A_log)`` clipped to ``[RATE_MIN, RATE_MAX]``."""
    return jnp.minimum(jnp.maximum(e, RATE_MIN), RATE_MAX)


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
    a = dt = None
    if act.gate != "none":
        a, dt, _ = _rate(gate_params)  # [U, 1, K]
    x = _activated(q, k, b, w, g, a, dt, act, eps)
    if act.gate != "none":
        x = dataclasses.replace(x, g=jnp.where(valid, x.g, ZERO))
    return x


def activate_rows(q, k, b, w, g, gate_params, act, eps: float) -> Activated:
    """:func:`activate` for rows: raw ``[R, d]`` float32 inputs, one row per head (the decode
    kernel's token), and ``gate_params`` ``[2, R, K]`` (``exp(A_log)``, ``dt_bias`` of each
    row's head; None without a gate). Two-dimensional, so that ``R`` rows of ``d`` channels fill
    ``R / 8`` vregs (a ``[R, 1, d]`` unit form would take one vreg per row)."""
    a = dt = None
    if act.gate != "none":
        a, dt = _clipped(gate_params[0]), gate_params[1]  # [R, K]
    return _activated(q, k, b, w, g, a, dt, act, eps)


def _activated(q, k, b, w, g, a, dt, act, eps: float) -> Activated:
    """The activations on inputs of any leading shape, channels last; ``a``, ``dt``: the clipped
    rate and the bias, broadcastable to ``g`` (None without a gate)."""
    q_r = k_r = None
    if act.qk_l2norm:
        q_r = jax.lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + eps)  # [..., 1]
        k_r = jax.lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + eps)
        q, k = q * q_r, k * k_r
    if act.bw_sigmoid:
        b = _sigmoid(b) * (2.0 if act.neg_eigval else 1.0)
        w = _sigmoid(w)
    if act.gate != "none":
        z = g + dt  # [..., K]
        g = -a * _softplus(z) if act.gate == "softplus" else act.lower_bound * _sigmoid(a * z)
    return Activated(q, k, b, w, g, q_r, k_r)


def softplus_decay_bound(g_raw: jax.Array, gate_params: jax.Array, nc: int) -> jax.Array:
    """[nc, C, K]: a bound on the heads' largest ``|g|`` of each chunk, row and channel under
    the softplus gate, for chunk_math.by_decay_bound, without activating every unit: ``|g| = a
    softplus(z)`` with ``a > 0`` and softplus increasing, so ``(max a) softplus(max z)`` over the
    heads bounds it. ``g_raw`` [U, C, K], ``gate_params`` [U, 2, K] (:func:`activate`'s; units
    ``head * nc + chunk``); the padding rows of the last step (``g = 0`` once activated) are
    bounded as tokens, which only raises it."""
    a, dt, _ = _rate(gate_params)  # [U, 1, K]
    return heads_max(a, nc) * _softplus(heads_max(g_raw + dt, nc))  # [nc, C, K]


def step_decay_bound(g: jax.Array, gate_params: jax.Array | None, plan) -> jax.Array:
    """[nc, C, K]: the bound by which a grid step picks its copy (chunk_math.by_decay_bound),
    from its ``g`` [U, C, K] as loaded: with the softplus gate the raw one and ``gate_params``
    [U, 2, K] (:func:`softplus_decay_bound`), else the log decay itself, clamped."""
    if plan.gate:
        return softplus_decay_bound(g, gate_params, plan.nc)
    return decay_row_bound(clamp_log_decay(g), plan.nc)


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
        a, dt, clipped = _rate(gate_params)  # [U, 1, K]
        z = raw_g + dt  # [U, C, K]
        if act.gate == "softplus":
            d_raw = -dg * a * _sigmoid(z)
            # dg/dA_log = g. At g = -inf (a full erase) dg is 0 (the floor's gradient): g held at
            # the floor keeps that product 0 rather than 0 * inf.
            d_log_a = dg * jnp.maximum(x.g, G_FLOOR)
        else:
            y = a * z
            # sigmoid'(y) from t = exp(-|y|) itself, exactly 0 once t is: not s (1 - s) from
            # the forward's g / lb, whose 1 - s a fused multiply-add leaves at 3e-8, not 0.
            dy = dg * act.lower_bound * _sigmoid_slope(y)
            d_raw = dy * a
            d_log_a = dy * jnp.clip(y, -EXP_CUT, EXP_CUT)  # dy/dA_log = y, held: no 0 * inf
        d_dt = d_raw
        d_log_a = jnp.where(clipped, ZERO, d_log_a)
        d_raw = jnp.where(valid, d_raw, ZERO)
        d_log_a = jnp.where(valid, d_log_a, ZERO)
        d_dt = jnp.where(valid, d_dt, ZERO)
        dg = d_raw
        partial = jnp.concatenate(
            [jnp.sum(d_log_a, axis=1, keepdims=True), jnp.sum(d_dt, axis=1, keepdims=True)],
            axis=1,
        )  # [U, 2, K]
    return dq, dk, db, dw, dg, partial
