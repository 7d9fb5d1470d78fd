"""Which copy of the grid step each step of a call runs for given log decays: the kernels' own
merge rule (chunk_math.by_decay_bound, ``Plan.runtime_merged_blocks``) applied outside them, so
that a model's decays can be checked for it (``python -m gdn2_tools.merged_steps``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from gdn2_pallas_tpu import chunk_math as cm
from gdn2_pallas_tpu.plan import Plan


def step_blocks(g: Float[Array, "B T H K"], plan: Plan) -> np.ndarray:
    """The merged block of every grid step of ``plan`` for the log decays ``g`` (the call's,
    after any activation; padded with zeros to ``plan.t_pad`` as the core pads): 16 or 8 where
    the step's copy merges that many rows, 1 where it keeps the levels.

    Args:
        g: the call's log decays, ``(B, T, H, K)``, ``H`` the kernels' heads.
        plan: the call's plan (``make_plan``; the training plan for the training forward and
            the backward).

    Returns:
        ``(B, H / hb, n_steps)`` int blocks, in the grid's order.

    Raises:
        ValueError: ``g``'s shape is not the plan's ``(B, T, H, K)``, or the plan fuses a gate
            (its steps are picked by a bound from the raw inputs and the gate's parameters).
    """
    if plan.gate:
        raise ValueError("plan: expected one without a fused gate (g as the kernels take it)")
    expected = (plan.batch, plan.seq_len, plan.heads, plan.dk)
    if tuple(g.shape) != expected:
        raise ValueError(f"g: expected shape {expected} (B, T, H, K) of the plan, got {g.shape}")
    blocks = plan.runtime_merged_blocks
    if not blocks:
        return np.full(plan.grid(), plan.merged_block, np.int32)
    g = cm.clamp_log_decay(jnp.asarray(g, jnp.float32))
    g = jnp.pad(g, ((0, 0), (0, plan.t_pad - plan.seq_len), (0, 0), (0, 0)))
    B, groups, steps = plan.grid()
    # [B, steps, nc, C, groups, hb, K] -> [B, groups, steps, hb * nc units, C, K] (the kernels'
    # units: head * nc + chunk)
    units = g.reshape(B, steps, plan.nc, plan.C, groups, plan.hb, plan.dk)
    units = units.transpose(0, 4, 1, 5, 2, 3, 6).reshape(B, groups, steps, -1, plan.C, plan.dk)
    widths = tuple(block // 2 for block in blocks)
    roll = functools.partial(jnp.roll, axis=1)  # roll_rows' rule on an [nc, C, K] array

    def step_maxima(step_units):  # [U, C, K] -> {width: scalar}, as by_decay_bound
        return cm.window_maxima(cm.decay_row_bound(step_units, plan.nc), widths, roll)

    maxima = jax.vmap(jax.vmap(jax.vmap(step_maxima)))(units)
    chosen = np.ones(plan.grid(), np.int32)
    for block in reversed(blocks):  # the largest block that merges wins, as in by_decay_bound
        chosen = np.where(np.asarray(cm.mergeable(maxima[block // 2])), block, chosen)
    return chosen
