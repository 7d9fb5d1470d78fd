"""What the kernels compute and move: the ``pl.CostEstimate`` of each ``pallas_call`` and the rows
of ``gdn2 tpu-report``.

FLOPs are the kernels' own products (``2 m n k`` each, counted once whatever the MXU precision),
per token and head, with ``L = log2 C`` levels:

- forward: scores ``4 L C K``, WY inverse ``4 L C^2``, ``Y|U`` ``2 C (K + V)``, state pass
  ``6 K V + 2 C V``;
- backward: ``Y|U`` again, the recomputed state pass ``4 K V``, the reverse state pass
  ``4 K V + 2 C V``, the gradient products ``8 K V + 2 C V + 4 C (K + V)``, and the score
  backward ``8 L C K``.

The level scheme does more multiply-adds than the minimum of docs/algorithm.md section 9 (masked
products are full-size), which the MXU absorbs; the minimum is the ``roofline`` row of the report.
"""

from __future__ import annotations

import math

from gdn2_pallas_tpu.plan import F32_BYTES, Plan, gate_savings


def _levels(plan: Plan) -> int:
    return int(math.log2(plan.C))


def flops_forward_per_token(plan: Plan) -> float:
    C, K, V, L = plan.C, plan.dk, plan.dv, _levels(plan)
    return 4 * L * C * K + 4 * L * C * C + 2 * C * (K + V) + 6 * K * V + 2 * C * V


def flops_backward_per_token(plan: Plan) -> float:
    C, K, V, L = plan.C, plan.dk, plan.dv, _levels(plan)
    recompute = 2 * C * (K + V) + 4 * K * V
    reverse = 4 * K * V + 2 * C * V
    grads = 8 * K * V + 2 * C * V + 4 * C * (K + V)
    return recompute + reverse + grads + 8 * L * C * K


def residual_bytes(plan: Plan) -> int:
    """HBM bytes the training forward saves besides the inputs: ``T`` and ``A_qk`` per chunk (one
    packed matrix) and the entry state of every grid step but the first (``h0``)."""
    import jax.numpy as jnp

    rs = jnp.dtype(plan.residual_dtype).itemsize
    units = plan.batch * plan.heads * plan.n_steps * plan.nc
    ss = jnp.dtype(plan.saved_state_dtype).itemsize
    states = plan.batch * plan.heads * plan.saved_states * plan.dk * plan.dv * ss
    return units * plan.C * plan.C * rs + states


def cost_forward(plan: Plan, save_residuals: bool) -> dict[str, int]:
    tokens = plan.batch * plan.heads * plan.t_pad
    K, V, s = plan.dk, plan.dv, plan.itemsize
    io = tokens * ((4 * K + 3 * V) * s - gate_savings(plan))
    io += 2 * plan.batch * plan.heads * K * V * F32_BYTES
    if save_residuals:
        io += residual_bytes(plan)
    if plan.chunk_states:  # the f32 state entering every chunk
        io += plan.batch * plan.heads * (plan.t_pad // plan.C) * K * V * F32_BYTES
    return {
        "flops": int(tokens * flops_forward_per_token(plan)),
        "transcendentals": int(tokens * K * (2 + _levels(plan))),
        "bytes_accessed": int(io),
    }


def cost_backward(plan: Plan) -> dict[str, int]:
    tokens = plan.batch * plan.heads * plan.t_pad
    K, V, s = plan.dk, plan.dv, plan.itemsize
    io = tokens * ((8 * K + 5 * V) * s - 2 * gate_savings(plan))  # a gate and its gradient
    io += 3 * plan.batch * plan.heads * K * V * F32_BYTES
    io += residual_bytes(plan)
    return {
        "flops": int(tokens * flops_backward_per_token(plan)),
        "transcendentals": int(tokens * K * (2 + _levels(plan))),
        "bytes_accessed": int(io),
    }
