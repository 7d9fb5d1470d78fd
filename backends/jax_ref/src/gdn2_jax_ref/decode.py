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

This is the form of the Pallas decode kernel. The two reads are one batched product at the
highest precision (exact float32, float64 for float64 inputs, on every platform).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from gdn2_jax_ref.params import einsum
from gdn2core.plugin import DecodeSpec, state_dtype


def decode_token(S, q, k, v, w, b, g, scale: float):
    """One token for every sequence and head: ``S [N, HV, K, V]``, q, k, b, g ``[N, HV, K]``,
    v, w ``[N, HV, V]`` in the accumulation dtype. Returns ``(S_t, o_t [N, HV, V])``."""
    d = jnp.exp(g)  # [N, HV, K]
    reads = einsum("nhck,nhkv->nhcv", jnp.stack([d * b * k, d * q], axis=2), S)  # [N, HV, 2, V]
    r, oq = reads[:, :, 0], reads[:, :, 1]  # [N, HV, V]
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
    if spec.indexed:
        S0 = jnp.take(state, jnp.where(valid, slots, 0), axis=0)  # [N, HV, K, V]
        # materialised once: XLA on a CPU otherwise fuses the gather into every reader (2x slower)
        S0 = lax.optimization_barrier(S0)
    else:  # sequence n owns slot n: the whole pool, no gather
        S0 = state
    xs = tuple(jnp.swapaxes(x, 0, 1).astype(acc) for x in (q, k, v, w, b, g))  # [S, N, HV, d]

    def step(S, x):
        S_new, o = decode_token(S, *x, spec.scale)
        return S_new, (o, S_new.astype(state.dtype) if spec.token_states else None)

    if spec.tokens == 1:  # no loop for the common case
        S_last, (o, states) = step(S0.astype(acc), tuple(x[0] for x in xs))
        o, states = o[None], None if states is None else states[None]
    else:
        S_last, (o, states) = lax.scan(step, S0.astype(acc), xs)  # o: [S, N, HV, V]
    if spec.indexed:
        write = jnp.where(valid, slots, spec.pool_size)  # skipped: out of range, dropped
        S_last = lax.optimization_barrier(S_last.astype(state.dtype))
        new_state = state.at[write].set(S_last, mode="drop")
    else:
        new_state = S_last.astype(state.dtype)
    o = jnp.swapaxes(o, 0, 1).astype(v.dtype)  # [N, S, HV, V]
    o = jnp.where(valid[:, None, None, None], o, jnp.nan)  # skipped: NaN
    if states is None:
        return o, new_state, None
    states = jnp.swapaxes(states, 0, 1)  # [N, S, HV, K, V]
    return o, new_state, jnp.where(valid[:, None, None, None, None], states, jnp.nan)
