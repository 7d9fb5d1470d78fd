"""Grouped keys: grouped value heads with b, g on the value heads, q and k not repeated.

The core hands this backend (``Capabilities.grouped_keys``) such a call as the plain call of
``HV`` heads whose spec says ``key_groups = G``, with q and k of their own ``H = HV / G`` heads.
The kernels read them in place (blocks.py, section Grouped keys) when each step's key heads lie in
one token block of ``hb`` key heads: the TOKEN_MAJOR layout (``hb = 8`` heads of every token per
DMA), ``G`` dividing ``hb`` and ``hb`` dividing ``H``; the backward then writes dq, dk per value
head and XLA sums each group (vjp.py). Any other call (HEAD_MAJOR blocking, ``G`` = 3...) has
them repeated here, as the core would.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gdn2_pallas_tpu.plan import Layout, Plan
from gdn2core.plugin import OpSpec


def plain_spec(spec: OpSpec) -> OpSpec:
    """The spec the plan is made for: the plain call of ``spec.heads`` heads."""
    return spec if spec.key_groups == 1 else dataclasses.replace(spec, key_groups=1)


def readable(plan: Plan, groups: int) -> bool:
    """Whether the kernels of ``plan`` can read q, k of ``plan.heads / groups`` key heads."""
    key_heads = plan.heads // groups
    return plan.layout is Layout.TOKEN_MAJOR and plan.hb % groups == 0 and key_heads % plan.hb == 0


def read_grouped(
    plan: Plan, q: jax.Array, k: jax.Array, groups: int
) -> tuple[Plan, jax.Array, jax.Array]:
    """``(plan, q, k)`` of the kernels for q, k of ``plan.heads / groups`` heads: the plan reading
    them grouped where it can, else q, k repeated to ``plan.heads`` heads (``(B, T, HV, dk)``)."""
    if groups == 1:
        return plan, q, k
    if readable(plan, groups):
        return dataclasses.replace(plan, key_groups=groups), q, k
    return plan, jnp.repeat(q, groups, axis=2), jnp.repeat(k, groups, axis=2)
