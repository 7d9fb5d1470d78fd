"""Token-serial references of KDA and GDN, written from their own definitions (fla's naive
recurrences), independent of the GDN-2 reference and of convert.py: one token at a time::

    S <- S * exp(g_t)            (per key channel; GDN: one factor per head)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = scale * S^T q_t

in float32 (``jax.default_matmul_precision("highest")`` around a call makes them exact to float32
rounding), with the gate and beta activations and grouped value heads as fla applies them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def _softplus(x):
    return jnp.logaddexp(x, 0.0)


def _gate(g, A_log, dt_bias, lower_bound):
    """fla's gate on the raw ``g`` (``(B, T, Hg, ...)``), ``A_log`` ``(Hg,)`` and ``dt_bias``
    (broadcastable to g without its batch and time axes)."""
    a = jnp.exp(A_log.astype(F32)).reshape((-1,) + (1,) * (g.ndim - 3))
    x = g + (0.0 if dt_bias is None else dt_bias.astype(F32))
    if lower_bound is None:
        return -a * _softplus(x)
    return lower_bound * jax.nn.sigmoid(a * x)


def _run(q, k, v, g, beta, scale, initial_state, scalar_gate):
    """The recurrence on float32 arrays, every one on the HV value heads."""
    B, _, HV, dk = q.shape
    dv = v.shape[-1]
    S0 = jnp.zeros((B, HV, dk, dv), F32) if initial_state is None else initial_state.astype(F32)

    def step(S, x):
        q_t, k_t, v_t, g_t, b_t = x  # [B, HV, dk], [B, HV, dk], [B, HV, dv], g, [B, HV]
        decay = jnp.exp(g_t)[..., None, None] if scalar_gate else jnp.exp(g_t)[..., None]
        S = S * decay
        pred = jnp.einsum("bhk,bhkv->bhv", k_t, S)
        S = S + jnp.einsum("bhk,bhv->bhkv", k_t, b_t[..., None] * (v_t - pred))
        return S, scale * jnp.einsum("bhk,bhkv->bhv", q_t, S)

    xs = tuple(jnp.swapaxes(a, 0, 1) for a in (q, k, v, g, beta))
    S, o = lax.scan(step, S0, xs)
    return jnp.swapaxes(o, 0, 1), S


def _family(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, A_log,
            dt_bias, scalar_gate):  # fmt: skip
    dk = q.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.astype(F32) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q = q / jnp.sqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6)
        k = k / jnp.sqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
    if use_gate_in_kernel:
        g = _gate(g, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = jax.nn.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    H, HV = q.shape[2], v.shape[2]
    q, k = (jnp.repeat(x, HV // H, axis=2) for x in (q, k))  # value head j reads key head j // G
    if beta.shape[2] != HV:  # gates on the key heads: every value head of a group shares them
        g, beta = (jnp.repeat(x, HV // H, axis=2) for x in (g, beta))
    o, S = _run(q, k, v, g, beta, scale, initial_state, scalar_gate)
    return o, (S if output_final_state else None)


def naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False,
                        use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                        allow_neg_eigval=False, lower_bound=None, A_log=None, dt_bias=None):  # fmt: skip
    """KDA token by token.

    Args:
        q, k: ``(B, T, H, dk)``; v ``(B, T, HV, dv)``.
        g: ``(B, T, Hg, dk)`` log decay, or the raw gate with ``use_gate_in_kernel``.
        beta: ``(B, T, Hg)``; raw with ``use_beta_sigmoid_in_kernel``.
        scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound: fla's meaning
            (:func:`gdn2core.chunk_kda`).
        A_log: ``(Hg,)``; dt_bias: ``(Hg * dk,)`` or ``(Hg, dk)``, or None.

    Returns:
        ``(o, final_state)``: o float32 ``(B, T, HV, dv)``; the state, or None unless
        ``output_final_state``.
    """
    if dt_bias is not None:
        dt_bias = dt_bias.reshape(g.shape[2], g.shape[3])
    return _family(q, k, v, g, beta, scale, initial_state, output_final_state,
                   use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                   allow_neg_eigval, lower_bound, A_log, dt_bias, scalar_gate=False)  # fmt: skip


def naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                                     allow_neg_eigval=False, A_log=None, dt_bias=None):  # fmt: skip
    """GDN token by token.

    Args:
        q, k: ``(B, T, H, dk)``; v ``(B, T, HV, dv)``.
        g: ``(B, T, Hg)`` log decay per head, or the raw gate with ``use_gate_in_kernel``.
        beta: ``(B, T, Hg)``; raw with ``use_beta_sigmoid_in_kernel``.
        scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval: fla's meaning
            (:func:`gdn2core.chunk_gated_delta_rule`).
        A_log, dt_bias: ``(Hg,)`` each, or None.

    Returns:
        ``(o, final_state)`` as :func:`naive_recurrent_kda`.
    """
    return _family(q, k, v, g, beta, scale, initial_state, output_final_state,
                   use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                   allow_neg_eigval, None, A_log, dt_bias, scalar_gate=True)  # fmt: skip
