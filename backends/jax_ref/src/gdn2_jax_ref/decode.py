"""The decode op in pure JAX: ``S`` tokens of ``N`` sequences against a state pool.

The slots are gathered from the pool, the tokens run one after another (a decode step is a few
tokens, so the recurrence itself is the algorithm), and the new states are scattered back; slots
not named are never touched. Per token, the decay is folded into the two vectors that read the
state, so both reads share one pass over the old state ``S`` and the update is a second
(``d = exp(g)``, ``e = b * k``, ``z = w * v``)::

    r   = S^T (d * e)                    read along the erase direction, after the decay   [dv]
    u   = z - r                          what the rank-one edit writes                      [dv]
    S_t = d * S + k u^T                  decay and edit                                 [dk, dv]
    o_t = scale (S^T (d * q) + (k . q) u)   = scale S_t^T q                                 [dv]

This is the form of the Pallas decode kernel. The contractions are elementwise products and
sums, exact float32 (float64 for float64 inputs) on every platform (no MXU pass rounding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from gdn2core.plugin import DecodeSpec, state_dtype


def decode_token(S, q, k, v, w, b, g, scale: float):
    """One token for every sequence and head: ``S [N, HV, K, V]``, q, k, b, g ``[N, HV, K]``,
    v, w ``[N, HV, V]`` in the accumulation dtype. Returns ``(S_t, o_t [N, HV, V])``."""
    d = jnp.exp(g)  # [N, HV, K]
    r = jnp.sum(S * (d * b * k)[..., None], axis=-2)  # [N, HV, V]
    oq = jnp.sum(S * (d * q)[..., None], axis=-2)  # [N, HV, V]
    u = w * v - r  # [N, HV, V]
    S_new = d[..., None] * S + k[..., None] * u[..., None, :]  # [N, HV, K, V]
    o = scale * (oq + jnp.sum(k * q, axis=-1, keepdims=True) * u)  # [N, HV, V]
    return S_new, o


@functools.partial(jax.jit, static_argnames="spec")
def gdn2_jax_decode(q, k, v, w, b, g, state, slots, spec: DecodeSpec):
    """``(o, new_state, token_states | None)`` (see :meth:`gdn2core.plugin.Backend.decode`).
    Jitted, so that an eager call is one program (inside a caller's jit it is inlined, and a
    donated pool is updated in place)."""
    acc = state_dtype(q.dtype)
    valid = slots >= 0  # [N]
    S0 = jnp.take(state, jnp.where(valid, slots, 0), axis=0).astype(acc)  # [N, HV, K, V]
    S0 = jnp.where(valid[:, None, None, None], S0, jnp.nan)  # skipped: NaN outputs
    xs = tuple(jnp.swapaxes(x, 0, 1).astype(acc) for x in (q, k, v, w, b, g))  # [S, N, HV, d]

    def step(S, x):
        S_new, o = decode_token(S, *x, spec.scale)
        return S_new, (o, S_new.astype(state.dtype) if spec.token_states else None)

    if spec.tokens == 1:  # no loop for the common case
        S_last, (o, states) = step(S0, tuple(x[0] for x in xs))
        o, states = o[None], None if states is None else states[None]
    else:
        S_last, (o, states) = lax.scan(step, S0, xs)  # o: [S, N, HV, V]
    write = jnp.where(valid, slots, spec.pool_size)  # skipped: out of range, dropped
    new_state = state.at[write].set(S_last.astype(state.dtype), mode="drop")
    token_states = None if states is None else jnp.swapaxes(states, 0, 1)
    return jnp.swapaxes(o, 0, 1).astype(v.dtype), new_state, token_states
