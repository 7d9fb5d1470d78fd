"""The decode op around its kernel: the slots it is given, sanitised; the block each grid step
maps; the platform guard.

Slots. Two sequences naming one slot would race in the kernel (kernels_decode.py: each valid step
writes its slot by its own DMAs), and a slot out of range would be a DMA out of the pool. The
core's ``gdn2_decode`` hands a backend sanitised slots, but the backend's ``decode`` may be called
directly, so the op sanitises them again with the core's own rule (``gdn2core.plugin.
sanitize_slots``: a slot out of ``[0, P)``, or named by several sequences, skips every sequence
naming it; docs/operator.md, decode). On slots the core already sanitised it changes nothing.

Blocks. The kernel's pool BlockSpec needs a slot for every step, skipped sequences included: a
skipped sequence maps the slot of the nearest valid sequence before it (after it, before the
first valid one; slot 0 when none is valid), so that it revisits a block its neighbour maps
instead of fetching one (:func:`step_sources`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from gdn2_pallas_tpu.decode_plan import DecodePlan
from gdn2_pallas_tpu.kernels_decode import decode_call
from gdn2_pallas_tpu.vjp import _on_tpu_only
from gdn2core.plugin import PAIRWISE_MAX, sanitize_slots


def step_sources(slots: jax.Array) -> jax.Array:
    """``(N,)`` int32: the sequence whose slot each step maps: its own when valid (``>= 0``),
    for a skipped one the nearest valid one before it, or after it for the skipped ones before
    the first valid one (0 when none is valid). A cumulative max and an argmax: no gather."""
    n = slots.shape[0]
    valid = slots >= 0
    pos = jnp.arange(n, dtype=jnp.int32)
    before = lax.cummax(jnp.where(valid, pos, -1))  # the last valid position <= n, or -1
    first = jnp.argmax(valid).astype(jnp.int32)  # the first valid position (0 if none)
    return jnp.where(before >= 0, before, first).astype(jnp.int32)


def step_slots(slots: jax.Array, pool_size: int) -> tuple[jax.Array, jax.Array]:
    """``(slots, sources)``, both ``(N,)`` int32: the slots after the core's rule
    (``sanitize_slots``) and each step's source sequence (:func:`step_sources`).

    Up to ``PAIRWISE_MAX`` sequences both come from comparisons of every pair of sequences, two
    fused reductions over ``[N, N]``: a decode step runs them once per layer, and the sort,
    gather, scatter and cumulative max of the general rule, each a small op of about 1 us, cost
    as much as the kernel at N = 8 (static cycle estimate of the whole step's XLA ops, v5e,
    ``gdn2 bench --decode --tpu v5e``: 20.7 us, 10.0 us with this and the core's pairwise rule;
    the kernel 28 us)."""
    n = slots.shape[0]
    if n > PAIRWISE_MAX:
        slots = sanitize_slots(slots, n, pool_size)  # [N] int32, -1: skip
        return slots, step_sources(slots)
    pos = jnp.arange(n, dtype=jnp.int32)
    idx = jnp.where((slots >= 0) & (slots < pool_size), slots, -1).astype(jnp.int32)  # [N]
    mine, other = pos[:, None], pos[None, :]  # [N, 1], [1, N]: row n, column m
    repeated = jnp.any((idx[:, None] == idx[None, :]) & (mine != other), axis=1)  # [N]
    valid = (idx >= 0) & ~repeated  # [N]
    # A valid m at or before n ranks by n - m (the nearest first), one after n after all of them
    # (the nearest first): the argmin is the source; with none valid, 0.
    rank = jnp.where(other <= mine, mine - other, n + other)  # [N, N]
    rank = jnp.where(valid[None, :], rank, 2 * n)
    return jnp.where(valid, idx, -1), jnp.argmin(rank, axis=1).astype(jnp.int32)


def gdn2_pallas_decode(
    q, k, v, w, b, g, state, slots, plan: DecodePlan
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``(o, new_state, token_states | None)`` (see :meth:`gdn2core.plugin.Backend.decode`);
    ``slots`` ``(N,)`` integers of any value: each sequence's slot, or a skip (``-1``, out of
    range, or named twice: module docstring)."""
    slots, sources = step_slots(slots, plan.pool_size)  # [N] int32, -1: skip; [N]
    call = functools.partial(decode_call, plan=plan)
    outs = _on_tpu_only(call, plan, q, k, v, w, b, g, state, slots, sources)
    return outs[0], outs[1], outs[2] if plan.token_states else None
