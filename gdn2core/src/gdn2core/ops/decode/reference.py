"""The token-serial reference of the decode op: the ground truth of every decode backend.

The same recurrence as :func:`gdn2core.gdn2_token_serial_reference` (one ``lax.scan`` step per
token, :func:`gdn2core.ops.forward.reference.token_step`), started from the pool slots the sequences name and
written back to them, with the pool semantics of ``docs/operator.md``: the state is float32 (float64
for float64 inputs) from the slot's value to the last token and rounded to the pool's dtype once,
when it is written back; a skipped sequence (an index out of range, or a slot named twice, under
``jax.jit``) reads and writes nothing and its outputs are NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from gdn2core.checks import state_dtype
from gdn2core.features.scalar_gates import broadcast_gates
from gdn2core.ops.decode.spec import DecodeSpec, expand_heads, sanitize_slots
from gdn2core.ops.forward.reference import token_step


def gdn2_decode_reference(
    q: Float[Array, "N S H dk"],
    k: Float[Array, "N S H dk"],
    v: Float[Array, "N S HV dv"],
    w: Float[Array, "N S HV dv"] | Float[Array, "N S HV"],
    b: Float[Array, "N S Hg dk"] | Float[Array, "N S Hg"],
    g: Float[Array, "N S Hg dk"] | Float[Array, "N S Hg"],
    state: Float[Array, "P HV dk dv"],
    state_indices: Int[Array, " N"] | None = None,
    scale: float | None = None,
    return_token_states: bool = False,
):
    """Token-serial decode: ``S`` tokens of ``N`` sequences against a state pool.

    Args:
        q, k, v, w, b, g, state, state_indices, scale, return_token_states: as for
            :func:`gdn2core.gdn2_decode`.

    Returns:
        ``(o, new_state)``, or ``(o, new_state, token_states)`` with ``return_token_states``:
        o ``(N, S, HV, dv)`` in v's dtype, the pool ``(P, HV, dk, dv)`` and the state after every
        token ``(N, S, HV, dk, dv)``, both in the pool's dtype.

    Raises:
        ValueError, TypeError: as :func:`gdn2core.gdn2_decode` for bad inputs.
    """
    spec = DecodeSpec.from_inputs(
        q, k, v, w, b, g, state, state_indices, scale, return_token_states
    )
    spec, w, b, g = broadcast_gates(spec, w, b, g)  # scalar gates: the same on every channel
    acc = state_dtype(q.dtype)
    slots = sanitize_slots(state_indices, spec.n_seqs, spec.pool_size)  # [N] int32, -1: skip
    valid = slots >= 0
    S0 = jnp.take(state, jnp.where(valid, slots, 0), axis=0).astype(acc)  # [N, HV, dk, dv]
    S0 = jnp.where(valid[:, None, None, None], S0, jnp.nan)
    heads = spec.heads
    # [S, N, HV, d] in the accumulation dtype: the scan runs over the tokens.
    xs = tuple(jnp.swapaxes(expand_heads(x, heads), 0, 1).astype(acc) for x in (q, k, v, w, b, g))

    def step(S, x):  # S: [N, HV, dk, dv] acc
        S_new, o = token_step(S, *x, spec.scale)
        return S_new, (o, S_new if return_token_states else None)

    S_last, (o, states) = jax.lax.scan(step, S0, xs)  # o: [S, N, HV, dv]
    write = jnp.where(valid, slots, spec.pool_size)  # out of range: dropped
    new_state = state.at[write].set(S_last.astype(state.dtype), mode="drop")
    o = jnp.swapaxes(o, 0, 1).astype(v.dtype)
    if not return_token_states:
        return o, new_state
    return o, new_state, jnp.swapaxes(states, 0, 1).astype(state.dtype)
