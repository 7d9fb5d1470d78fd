"""The decode op around its kernel: the block each grid step maps, the platform guard.

The kernel's pool BlockSpec needs a slot for every step, skipped sequences included. A skipped
sequence takes the slot of the nearest valid sequence before it (after it, before the first valid
one; slot 0 when none is valid), so that it revisits a block its neighbour owns instead of touching
another slot (kernels_decode.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from gdn2_pallas_tpu.decode_plan import DecodePlan
from gdn2_pallas_tpu.kernels_decode import decode_call
from gdn2_pallas_tpu.vjp import _on_tpu_only


def step_blocks(slots: jax.Array) -> jax.Array:
    """``(N,)`` int32: each sequence's slot, or for a skipped one (``-1``) its neighbour's."""
    n = slots.shape[0]
    valid = slots >= 0
    pos = jnp.arange(n, dtype=jnp.int32)
    before = lax.cummax(jnp.where(valid, pos, -1))  # the last valid position <= n, or -1
    first = jnp.argmax(valid).astype(jnp.int32)  # the first valid position (0 if none)
    source = jnp.where(before >= 0, before, first)
    return jnp.where(valid[source], slots[source], 0).astype(jnp.int32)


def gdn2_pallas_decode(
    q, k, v, w, b, g, state, slots, plan: DecodePlan, *, indexed: bool
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``(o, new_state, token_states | None)`` (see :meth:`gdn2core.plugin.Backend.decode`);
    ``indexed``: the caller named slots (without, every sequence is valid and maps its own)."""
    slots = slots.astype(jnp.int32)
    blocks = step_blocks(slots) if indexed else slots
    call = functools.partial(decode_call, plan=plan)
    outs = _on_tpu_only(call, plan, q, k, v, w, b, g, state, slots, blocks)
    return outs[0], outs[1], outs[2] if plan.token_states else None
