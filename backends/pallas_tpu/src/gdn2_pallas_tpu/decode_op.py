"""The decode op around its kernel: the slots it is given, sanitised; the block each grid step
maps; the heads it reads grouped; the platform guard.

Slots. Two sequences naming one slot would race in the kernel (kernels_decode.py: each valid step
writes its slot by its own DMAs), and a slot out of range would be a DMA out of the pool. The
core's ``gdn2_decode`` hands a backend sanitised slots (``spec.sanitized_slots``), but the
backend's ``decode`` may be called directly, so the op sanitises the slots of any other call with
the core's own rule (``gdn2core.plugin.sanitize_slots``: a slot out of ``[0, P)``, or named by
several sequences, skips every sequence naming it; docs/operator.md, decode). Doing it again on
the core's slots would change nothing and cost the step two small XLA ops.

Grouped heads (``Capabilities.grouped_decode``): q, k come with their own key heads and b, g with
their own gate heads; the kernel reads them so where its blocks tile (``plan.key_groups``,
``plan.gate_groups``: decode_plan.grouped_rows), else they are repeated to the value heads here.

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
from gdn2core.plugin import PAIRWISE_MAX, expand_heads, sanitize_slots


def step_sources(slots: jax.Array) -> jax.Array:
    """``(N,)`` int32: the sequence whose slot each step maps: its own when valid (``>= 0``),
    for a skipped one the nearest valid one before it, or after it for the skipped ones before
    the first valid one (0 when none is valid).

    Up to ``PAIRWISE_MAX`` sequences (as ``sanitize_slots``) one fused reduction over every pair
    of sequences; above, a cumulative max and an argmax. A decode step runs this once per layer,
    and small XLA ops cost about 1 us each in the static estimate: with the core's sort-based
    slot rule and the cumulative max, the step's XLA ops took as long as the kernel at N = 8
    (``gdn2 bench --decode --tpu v5e``: 20.7 us; 7.6 us with both pairwise; the kernel 28 us)."""
    n = slots.shape[0]
    valid = slots >= 0
    pos = jnp.arange(n, dtype=jnp.int32)
    if n <= PAIRWISE_MAX:
        # A valid m at or before n ranks by n - m (the nearest first), one after n after all of
        # them (the nearest first): the argmin is the source; with none valid, 0.
        mine, other = pos[:, None], pos[None, :]  # [N, 1], [1, N]: row n, column m
        rank = jnp.where(other <= mine, mine - other, n + other)  # [N, N]
        rank = jnp.where(valid[None, :], rank, 2 * n)
        return jnp.argmin(rank, axis=1).astype(jnp.int32)
    before = lax.cummax(jnp.where(valid, pos, -1))  # the last valid position <= n, or -1
    first = jnp.argmax(valid).astype(jnp.int32)  # the first valid position (0 if none)
    return jnp.where(before >= 0, before, first).astype(jnp.int32)


def gate_params(A_log, dt_bias, plan: DecodePlan) -> jax.Array | None:
    """The fused gate's ``(HV / hb, 2, hb / G, K)`` float32 parameters, ``exp(A_log)`` and
    ``dt_bias`` (zeros when absent) of the gate rows the kernel reads (``G = plan.gate_groups``:
    one per gate head, the value heads' given values being repeated), one contiguous ``(2, hb /
    G, K)`` block per head block (such a block of a ``(2, HV, K)`` array would be a strided DMA,
    which the TPU compiler's static profile prices at 0 with the whole kernel); None without a
    fused gate. ``A_log`` ``(HV,)``, ``dt_bias`` ``(HV, K)``: per value head."""
    if not plan.gate:
        return None
    G = plan.gate_groups
    rows = plan.heads // G
    a = jnp.exp(A_log.astype(jnp.float32)[::G])  # [HV / G]
    a = jnp.broadcast_to(a[:, None], (rows, plan.dk))
    dt = jnp.zeros_like(a) if dt_bias is None else dt_bias.astype(jnp.float32)[::G]
    blocks = (plan.head_blocks, plan.hb // G, plan.dk)
    return jnp.stack([a.reshape(blocks), dt.reshape(blocks)], axis=1)


def gdn2_pallas_decode(
    q, k, v, w, b, g, state, slots, plan: DecodePlan, A_log=None, dt_bias=None
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``(o, new_state, token_states | None)`` (see :meth:`gdn2core.plugin.Backend.decode`);
    q, k ``(N, S, H or HV, K)``, b, g ``(N, S, Hg or HV, K)`` (module docstring, grouped heads);
    ``slots`` ``(N,)`` integers of any value: each sequence's slot, or a skip (``-1``, out of
    range, or named twice: module docstring); ``A_log`` ``(HV,)``, ``dt_bias`` ``(HV, K)``: a
    fused gate's parameters (``plan.gate``)."""
    if not plan.sanitized_slots:  # a direct call (module docstring)
        slots = sanitize_slots(slots, plan.n_seqs, plan.pool_size)  # [N] int32, -1: skip
    if plan.key_groups == 1:  # not read grouped: repeated to the value heads (no-op if they are)
        q, k = expand_heads(q, plan.heads), expand_heads(k, plan.heads)
    if plan.gate_groups == 1:
        b, g = expand_heads(b, plan.heads), expand_heads(g, plan.heads)
    call = functools.partial(decode_call, plan=plan)
    params = gate_params(A_log, dt_bias, plan)  # [HV / hb, 2, hb, K] f32, or None
    outs = _on_tpu_only(call, plan, q, k, v, w, b, g, params, state, slots, step_sources(slots))
    return outs[0], outs[1], outs[2] if plan.token_states else None
