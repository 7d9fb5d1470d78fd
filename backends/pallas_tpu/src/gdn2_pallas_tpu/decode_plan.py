"""The static plan of one decode call: heads per grid step, VMEM, cost.

A decode step reads every named pool slot once and writes it once; that traffic bounds it (a few
FLOPs per state element per token). A grid step takes ``hb`` heads of one sequence: the pool's
BlockSpec maps the ``(hb, K, V)`` block of the sequence's slot (a scalar-prefetched index) and
Pallas's pipeline reads the next step's block while a step computes; the step writes each head's
new state back by a DMA of its own as soon as it is computed, so the HBM traffic overlaps the
compute both ways (kernels_decode.py).

Block choice (static cycle estimate, ``gdn2 bench --decode --tpu v5e,v6e --no-timing``, HV = 32,
d = 128, float32 tokens): about :data:`STEP_STATE_BYTES` of float32 state per step, 32 heads of
128 x 128. Against 16 heads (1 MiB, the choice until the kernel's reads and activations were
cut): at N = 64 the kernel 202.9 -> 172.9 us (float32 pool) and 186.5 -> 154.4 us (bfloat16) on
v5e, 196.1 -> 172.0 and 139.4 -> 111.0 us on v6e; at N = 8 26.4 -> 23.0 us (v5e, bfloat16):
each grid step has a fixed cost (its scalar work and the latency of its first products), which
fewer, larger steps pay less often. (8 heads a step were slower still.) But at least
:data:`MIN_STEPS` steps: the first read of a call is not overlapped, and each head block waits
for its last writes at its end; at N = 1 (every slot valid) 32 heads in 2 steps of 16 took
7.7 us, 4 steps of 8 8.7 us, 1 step of 32 8.5 us (an earlier kernel). And fewer heads where a
step's VMEM (:func:`vmem_bytes`) would exceed the planning share of the chip's: 16 float32 token
states of 32 heads need about 76 MiB, so such a call takes 16 heads a step on a 64 MiB chip.
``hb`` is a divisor of HV that tiles the token blocks (a multiple of 8
sublanes, 16 for bfloat16 inputs, or HV itself), at most :data:`MAX_HEADS_PER_STEP` (the head
loop is unrolled).

VMEM per step: the pool block read (double-buffered by the pipeline) and the new state being
written back (two buffers, by sequence parity), ``4 hb K V`` in the pool's dtype; a
float32 working copy when the pool is bfloat16 and S > 1 (the state stays float32 across the
tokens of a call); double-buffered token blocks ``2 S hb (4 K + 3 V)`` (a float32 ``g`` beside
bfloat16 inputs: ``2 K`` more bytes); the token states ``2 S hb K V``; live float32 temporaries of
one head (a few ``[K, V]``) and the transposed rows ``4 hb K``; with a fused gate its
parameters ``2 hb 2 K`` float32. At 32 heads of 128 x 128, float32, S = 1: about 8.8 MiB.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Final

import jax.numpy as jnp

from gdn2_pallas_tpu.config import InterpretMode, PallasTpuConfig
from gdn2_pallas_tpu.plan import (
    DEFAULT_VMEM_CAPACITY,
    F32_BYTES,
    NUM_SUBLANES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_SIZES,
    VMEM_PLAN_SHARE,
    planned_cores,
    vmem_capacity_bytes,
)
from gdn2_pallas_tpu.plan import vmem_limit as kernel_vmem_limit
from gdn2core.plugin import L2NORM_EPS, Activations, DecodeSpec, KernelConfig

#: Float32 state bytes a grid step aims at (32 heads of 128 x 128; see the module docstring).
STEP_STATE_BYTES: Final = 2 * 1024 * 1024
#: Grid steps a call should have at least (the first read does not overlap; module docstring).
MIN_STEPS: Final = 2
#: Heads of a step at most (the head loop is unrolled in the kernel).
MAX_HEADS_PER_STEP: Final = 32
#: Tokens per call at most: a chunk of the chunked kernels (speculative verification).
MAX_TOKENS: Final = 128
POOL_DTYPES: Final = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, slots=True)
class DecodePlan:
    """Static description of one decode call (hashable: a jit static)."""

    n_seqs: int  # N
    tokens: int  # S
    heads: int  # HV
    dk: int
    dv: int
    dtype: str  # token inputs
    state_dtype: str  # the pool
    pool_size: int  # P
    scale: float
    token_states: bool
    hb: int  # heads per step
    vmem_limit_bytes: int
    interpret: InterpretMode | None  # None: compiled; else how interpret mode runs (config.py)
    float32_decay: bool = False  # g float32 beside bfloat16 inputs (DecodeSpec.float32_decay)
    activations: Activations | None = None  # applied in the kernel (DecodeSpec.activations)
    l2norm_eps: float = L2NORM_EPS
    key_groups: int = 1  # value heads per head of q, k as the kernel reads them (1: repeated)
    gate_groups: int = 1  # likewise for b, g
    sanitized_slots: bool = False  # the core's slots (DecodeSpec.sanitized_slots)

    @property
    def gate(self) -> bool:
        """Whether the kernel takes the fused gate's parameters (``exp(A_log)``, ``dt_bias``)."""
        return self.activations is not None and self.activations.gate != "none"

    @property
    def head_blocks(self) -> int:
        return self.heads // self.hb

    @property
    def n_steps(self) -> int:
        return self.head_blocks * self.n_seqs

    @property
    def staged_f32(self) -> bool:
        """A float32 working copy of the step's state: a bfloat16 pool with several tokens."""
        return self.state_dtype != "float32" and self.tokens > 1

    @property
    def state_itemsize(self) -> int:
        return jnp.dtype(self.state_dtype).itemsize

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one value head's inputs of one token: q, k, b, g (``K`` each, shared by
        ``key_groups`` / ``gate_groups`` value heads) and v, w, o (``V`` each); ``g`` float32
        with ``float32_decay``."""
        g_bytes = 4 if self.float32_decay else self.itemsize
        keys = 2 * self.dk * self.itemsize / self.key_groups
        gates = self.dk * (self.itemsize + g_bytes) / self.gate_groups
        return int(keys + gates + 3 * self.dv * self.itemsize)

    def grid(self) -> tuple[int, int]:
        """(head block, sequence): the sequences sequential (a skipped sequence revisits its
        neighbour's block; a step reuses the write buffer of the step two before), the head
        blocks parallel (disjoint memory; each waits for its own DMAs)."""
        return (self.head_blocks, self.n_seqs)


def _sublanes(dtype: str) -> int:
    """Rows of a token block's (heads, d) tile: 8 for float32, 16 for bfloat16 (packed)."""
    return NUM_SUBLANES * (4 // jnp.dtype(dtype).itemsize)


def grouped_rows(plan: DecodePlan, heads: int, dtype: str) -> int:
    """The value heads per head of a token input of ``heads`` heads (q and k: the key heads; b
    and g: the gate heads) that the kernel reads as it is (its block: the ``hb / G`` rows of a
    step's value heads, each value head taking row ``h // G``; kernels_decode.py), or 1: it is
    repeated to the value heads in XLA first (decode_op.py). The block must tile: ``hb / G`` all
    the heads, or a multiple of the sublanes of ``dtype``."""
    G = plan.heads // heads
    if G == 1 or plan.hb % G:
        return 1
    rows = plan.hb // G
    return G if rows == heads or rows % _sublanes(dtype) == 0 else 1


def head_block(
    spec: DecodeSpec, fits: Callable[[int], bool] = lambda hb: True, cores: int = 1
) -> int:
    """The heads of a step: among the divisors of HV that tile the token blocks (at most
    :data:`MAX_HEADS_PER_STEP`), the smallest with at least :data:`STEP_STATE_BYTES` of float32
    state, or a smaller one while the call would have fewer than :data:`MIN_STEPS` steps or
    ``fits(hb)`` is false (its VMEM: :func:`make_decode_plan`). With ``cores`` TensorCores per
    device (2 on v5p), which split the head blocks (the grid's parallel axis) between them: the
    largest smaller block that gives each core as many, where the choice does not."""
    head_bytes = spec.dk * spec.dv * F32_BYTES
    tiling = [
        h
        for h in range(1, min(spec.heads, MAX_HEADS_PER_STEP) + 1)
        if spec.heads % h == 0 and (h == spec.heads or h % _sublanes(spec.dtype) == 0)
    ]
    if not tiling:
        return spec.heads
    big = [h for h in tiling if h * head_bytes >= STEP_STATE_BYTES]
    hb = min(big) if big else max(tiling)
    smaller = [h for h in tiling if h < hb]
    while smaller and (spec.n_seqs * (spec.heads // hb) < MIN_STEPS or not fits(hb)):
        hb = smaller.pop()
    if (spec.heads // hb) % cores:
        hb = max((h for h in smaller if (spec.heads // h) % cores == 0), default=hb)
    return hb


def vmem_bytes(plan: DecodePlan) -> dict[str, int]:
    """The VMEM byte model of one grid step (module docstring)."""
    K, V, hb, S = plan.dk, plan.dv, plan.hb, plan.tokens
    blocks = 4 * hb * K * V * plan.state_itemsize
    work = hb * K * V * F32_BYTES if plan.staged_f32 else 0
    tokens = 2 * S * hb * plan.token_bytes
    states = 2 * S * hb * K * V * plan.state_itemsize if plan.token_states else 0
    live = F32_BYTES * (6 * K * V + 8 * hb * max(K, V))
    gate = 2 * hb * 2 * K * F32_BYTES if plan.gate else 0  # exp(A_log), dt_bias, double-buffered
    total = blocks + work + tokens + states + live + gate
    return {"blocks": blocks, "work": work, "tokens": tokens, "token_states": states,
            "live": live, "gate": gate, "total": total}  # fmt: skip


def vmem_limit(plan_bytes: int, capacity: int) -> int:
    """The scoped VMEM limit of the call: twice the byte model, at least 16 MiB, at most
    ``VMEM_LIMIT_SHARE`` of the capacity (plan.py: the whole capacity would leave Mosaic's
    internal scratch and XLA's own ops none)."""
    return int(min(kernel_vmem_limit(capacity), max(16 * 2**20, 2 * plan_bytes)))


def make_decode_plan(
    spec: DecodeSpec,
    config: KernelConfig,
    vmem_capacity: int | None = None,
    cores: int | None = None,
) -> DecodePlan:
    """The plan of one call (module docstring); ``cores``: the TensorCores that share the head
    blocks (None: ``tensor_cores()`` of the target; interpret mode: the simulated cores).

    Raises:
        TypeError: ``config`` is another backend's config class (:class:`PallasTpuConfig`).
    """
    config = PallasTpuConfig.from_config(config)
    capacity = vmem_capacity_bytes() if vmem_capacity is None else vmem_capacity
    plan = DecodePlan(
        n_seqs=spec.n_seqs,
        tokens=spec.tokens,
        heads=spec.heads,
        dk=spec.dk,
        dv=spec.dv,
        dtype=spec.dtype,
        state_dtype=spec.state_dtype,
        pool_size=spec.pool_size,
        scale=float(spec.scale),
        token_states=spec.token_states,
        hb=spec.heads,
        vmem_limit_bytes=capacity,
        interpret=config.interpret_mode(),
        float32_decay=spec.float32_decay,
        activations=spec.activations if spec.activations.any else None,
        sanitized_slots=spec.sanitized_slots,
    )
    budget = int(VMEM_PLAN_SHARE * capacity)  # fewer heads a step where more would not fit
    fits = lambda hb: vmem_bytes(dataclasses.replace(plan, hb=hb))["total"] <= budget  # noqa: E731
    plan = dataclasses.replace(plan, hb=head_block(spec, fits, planned_cores(config, cores)))
    g_dtype = "float32" if spec.float32_decay else spec.dtype
    key_groups = grouped_rows(plan, spec.key_heads, spec.dtype)
    # b (and g, perhaps float32) must tile too, and are read grouped only with q, k
    gates = [grouped_rows(plan, spec.gate_heads, d) for d in (spec.dtype, g_dtype)]
    plan = dataclasses.replace(plan, key_groups=key_groups, gate_groups=min(*gates, key_groups))
    limit = vmem_limit(vmem_bytes(plan)["total"], capacity)
    return dataclasses.replace(plan, vmem_limit_bytes=limit)


def check_decode_plan(spec: DecodeSpec, config: KernelConfig) -> str | None:
    """``None`` when the decode kernel can run this call, else the reason."""
    refusal = PallasTpuConfig.refusal(config)
    if refusal:
        return refusal
    if spec.dtype not in SUPPORTED_DTYPES:
        return f"dtype {spec.dtype} not in {SUPPORTED_DTYPES}"
    if spec.dk not in SUPPORTED_HEAD_SIZES or spec.dv not in SUPPORTED_HEAD_SIZES:
        return f"dk={spec.dk}, dv={spec.dv}: head sizes {SUPPORTED_HEAD_SIZES} only"
    if spec.state_dtype not in POOL_DTYPES:
        return f"state dtype {spec.state_dtype} not in {POOL_DTYPES}"
    if spec.tokens > MAX_TOKENS:
        return (
            f"S={spec.tokens} tokens per call: at most {MAX_TOKENS} (a chunk; prefill longer runs)"
        )
    plan = make_decode_plan(spec, config, DEFAULT_VMEM_CAPACITY)
    need, budget = vmem_bytes(plan)["total"], int(VMEM_PLAN_SHARE * DEFAULT_VMEM_CAPACITY)
    if need > budget:
        return (
            f"decode kernel needs ~{need / 2**20:.1f} MiB of VMEM per grid step ({plan.hb} heads, "
            f"S={spec.tokens}, token states {spec.token_states}; budget {budget / 2**20:.0f} MiB)"
        )
    return None


def cost_decode(plan: DecodePlan) -> dict[str, int]:
    """``pl.CostEstimate`` of the decode call: per head and token, two reads of the state and its
    update (``~10 K V`` flops on the VPU), ``K`` exponentials (and with fused activations about
    ``3 K + V`` more: the sigmoids, the softplus, the norms' square roots); the pool slots once
    each way, the token blocks, o and the token states."""
    K, V, S = plan.dk, plan.dv, plan.tokens
    unit_tokens = plan.n_seqs * plan.heads * S
    state = plan.n_seqs * plan.heads * K * V * plan.state_itemsize
    io = 2 * state + unit_tokens * plan.token_bytes
    if plan.token_states:
        io += unit_tokens * K * V * plan.state_itemsize
    return {
        "flops": int(unit_tokens * 10 * K * V),
        "transcendentals": int(unit_tokens * (K + (3 * K + V if plan.activations else 0))),
        "bytes_accessed": int(io),
    }
