"""Grouped values: grouped value heads with b, g on the key heads, v, w and o not relaid out.

The core hands such a call to a backend as the plain call of ``H`` heads of ``G dv`` value
channels, v and w reshaped from the caller's ``(B, T, HV, dv)`` to ``(B, T, H, G dv)`` and o
back (``OpSpec.value_groups = G``). On a TPU those reshapes are relayout copies: a tile of the
caller's arrays holds 8 consecutive value heads, one of the view's 8 key heads. The kernels read
and write the caller's layout instead (blocks.py, section Grouped values) when a step's ``hb G``
value heads are ``G`` token blocks of ``hb`` heads and each value head fills whole lanes: the
TOKEN_MAJOR layout and ``dv`` a multiple of 128. The backend's reshape back to ``(B, T, HV, dv)``
then cancels the core's in XLA. Other calls (the HEAD_MAJOR layout, ``dv`` = 64, ``cu_seqlens``)
keep the view (the core gives calls on a mesh the view too).
"""

from __future__ import annotations

import dataclasses

from gdn2_pallas_tpu.plan import NUM_LANES, Layout, Plan


def readable(plan: Plan, groups: int) -> bool:
    """Whether the kernels of ``plan`` can read v, w as ``groups`` value heads per head."""
    return (
        plan.layout is Layout.TOKEN_MAJOR
        and plan.dv % groups == 0
        and (plan.dv // groups) % NUM_LANES == 0
        and not plan.varlen
    )


def read_grouped(plan: Plan, groups: int) -> Plan:
    """The plan reading v, w (writing o) in the caller's grouped layout where it can."""
    if groups > 1 and readable(plan, groups):
        return dataclasses.replace(plan, value_groups=groups)
    return plan
