"""Blocking plan, VMEM byte model and cost formulas of the pallas_tpu kernels.

Every number the kernels and the report need is derived here from ``(OpSpec, KernelConfig)``:

- ``C = config.bt`` (chunk), ``c = config.bc = C / 2`` (score sub-chunk), ``mb`` (WY micro-block);
- ``ckpt``: the forward saves the state entering every ``ckpt``-th chunk (a "superchunk" of
  ``ckpt * C`` tokens) as the backward residual, ``ckpt = max(1, 128 // C)`` capped at the number of
  chunks. The backward recomputes the ``ckpt - 1`` states inside a superchunk in VMEM. At the train
  shape (B=8, T=4096, H=6, d=128, C=64) this halves the saved states to 96 MiB (float32).

The VMEM model counts the double-buffered pipeline blocks, the scratch buffers and the live float32
intermediates of one grid step (an upper-bound estimate: Mosaic reuses buffers).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Final

from gdn2core.config import KernelConfig
from gdn2core.spec import OpSpec

F32: Final = 4
#: v5e default scoped VMEM limit (the kernels set no vmem_limit_bytes).
VMEM_LIMIT_BYTES: Final = 16 * 2**20
#: What the byte model may plan for: the limit minus headroom for Mosaic's own temporaries.
VMEM_BUDGET_BYTES: Final = 14 * 2**20
SUPPORTED_HEAD_SIZES: Final = (64, 128, 256)
SUPPORTED_DTYPES: Final = ("float32", "bfloat16")
#: Superchunk length the checkpoint stride aims for (tokens).
CKPT_TOKENS: Final = 128


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """Static description of one call of the kernels (hashable: a custom_vjp nondiff argument)."""

    batch: int
    seq_len: int  # T of the caller
    heads: int
    dk: int
    dv: int
    dtype: str
    scale: float
    C: int  # chunk length (config.bt)
    c: int  # score sub-chunk (config.bc), C == 2 c
    mb: int  # WY micro-block
    wy_eps: float
    ckpt: int  # chunks per saved state (superchunk = ckpt * C tokens)
    interpret: bool
    layout: str  # "bhtd" (one head per grid step) or "bthd" (8 heads per step), layout.py
    hb: int  # heads per grid step: 1 ("bhtd") or 8 ("bthd")

    @property
    def n_chunks(self) -> int:
        """Chunks after padding T to a whole number of superchunks."""
        return self.n_super * self.ckpt

    @property
    def n_super(self) -> int:
        return max(1, math.ceil(self.seq_len / (self.ckpt * self.C)))

    @property
    def t_pad(self) -> int:
        return self.n_chunks * self.C

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype == "bfloat16" else 4

    @property
    def staged(self) -> bool:
        """bfloat16 (C, 8, d) tiles are converted to float32 VMEM scratch for per-head access."""
        return self.layout == "bthd" and self.dtype == "bfloat16"


def make_plan(spec: OpSpec, config: KernelConfig) -> Plan:
    """The plan of one call. Layout "bthd" (8 heads per step, in place) when H % 8 == 0 and its
    VMEM fits the budget, else "bhtd" (one head per step on the swapped (B, H, T, d) view)."""
    C = config.bt
    n = max(1, math.ceil(spec.seq_len / C))
    ckpt = max(1, min(CKPT_TOKENS // C, n))
    hb = 1
    if spec.heads % 8 == 0:
        s = 2 if spec.dtype == "bfloat16" else 4
        need = max(
            vmem_bytes_fwd(C, spec.dk, spec.dv, s, 8)["total"],
            vmem_bytes_bwd(C, spec.dk, spec.dv, s, ckpt, 8)["total"],
        )
        hb = 8 if need <= VMEM_BUDGET_BYTES else 1
    return Plan(
        batch=spec.batch,
        seq_len=spec.seq_len,
        heads=spec.heads,
        dk=spec.dk,
        dv=spec.dv,
        dtype=spec.dtype,
        scale=float(spec.scale),
        C=C,
        c=config.bc,
        mb=config.mb,
        wy_eps=float(config.wy_eps),
        ckpt=ckpt,
        interpret=bool(config.interpret),
        layout="bthd" if hb > 1 else "bhtd",
        hb=hb,
    )


# ----------------------------------------------------------------------------------------------
# VMEM byte model (one grid step)
# ----------------------------------------------------------------------------------------------
def vmem_bytes_fwd(C: int, K: int, V: int, itemsize: int, hb: int = 1) -> dict[str, int]:
    """Forward kernel: blocks (x2 pipeline buffers), scratch, live float32 intermediates.
    ``hb``: heads per grid step (8 in the "bthd" layout, whose bfloat16 tiles are staged)."""
    blocks = 2 * hb * C * (4 * K + 3 * V) * itemsize  # q, k, b, g [C, K]; v, w, o [C, V]
    blocks += 3 * 2 * hb * K * V * F32  # h0 in, h_final out, saved state out [K, V] f32
    scratch = hb * K * V * F32 + 2 * C * K * F32  # S [K, V]; gamma_cum, k rows [C, K]
    if hb > 1 and itemsize != F32:
        scratch += hb * C * (4 * K + 3 * V) * F32  # float32 staging of the bf16 tiles
    # live: A_kk, A_qk, T, T_bd, A_bd, A_off, masks [C, C]; gamma_cum, E, Ē, Q̃, K̃, Y, decay
    # factors, loop temporaries [C, K] (~12); Z, U, R, O [C, V]; S, update [K, V]
    live = F32 * (8 * C * C + 12 * C * K + 4 * C * V + 2 * K * V)
    return {"blocks": blocks, "scratch": scratch, "live": live, "total": blocks + scratch + live}


def vmem_bytes_bwd(C: int, K: int, V: int, itemsize: int, ckpt: int, hb: int = 1) -> dict[str, int]:
    """Backward kernel: chunk blocks + superchunk blocks (x2), scratch, live intermediates."""
    blocks = 2 * hb * C * (4 * K + 3 * V) * itemsize  # q, k, b, g [C, K]; v, w, dO [C, V]
    blocks += 2 * hb * C * (4 * K + 2 * V) * itemsize  # dq, dk, db, dg [C, K]; dv, dw [C, V]
    if ckpt > 1:
        blocks += 2 * hb * ckpt * C * (3 * K + 2 * V) * itemsize  # k, b, g, v, w superchunk
    blocks += 3 * 2 * hb * K * V * F32  # saved state in, dh_final in, dh0 out [K, V] f32
    scratch = hb * (ckpt + 1) * K * V * F32 + 2 * C * K * F32  # states, dS; gamma_cum, k rows
    if hb > 1 and itemsize != F32:
        scratch += hb * C * (8 * K + 5 * V) * F32  # float32 staging of the bf16 tiles
    # live: ~10 [C, C] (A's, T, P's, masks); ~24 [C, K] (recompute, dq..dg, ρ/κ carries);
    # ~8 [C, V] (Z, U, R, dO, dR, dZ, ...); S, dS, update [K, V]
    live = F32 * (10 * C * C + 24 * C * K + 8 * C * V + 3 * K * V)
    return {"blocks": blocks, "scratch": scratch, "live": live, "total": blocks + scratch + live}


def check_vmem(spec: OpSpec, config: KernelConfig) -> str | None:
    """``None`` if both kernels fit the budget, else the reason."""
    plan = make_plan(spec, config)
    fwd = vmem_bytes_fwd(plan.C, plan.dk, plan.dv, plan.itemsize, plan.hb)["total"]
    bwd = vmem_bytes_bwd(plan.C, plan.dk, plan.dv, plan.itemsize, plan.ckpt, plan.hb)["total"]
    for name, used in (("forward", fwd), ("backward", bwd)):
        if used > VMEM_BUDGET_BYTES:
            return (
                f"{name} kernel needs ~{used / 2**20:.1f} MiB of VMEM at bt={plan.C}, "
                f"dk={plan.dk}, dv={plan.dv} (budget {VMEM_BUDGET_BYTES / 2**20:.0f} MiB of the "
                f"{VMEM_LIMIT_BYTES / 2**20:.0f} MiB scoped limit); use a smaller bt"
            )
    return None


# ----------------------------------------------------------------------------------------------
# Cost formulas (ALGORITHM.md section 9), per pallas_call
# ----------------------------------------------------------------------------------------------
def flops_fwd_per_token(C: int, K: int, V: int) -> float:
    """6CK + 4CV + C^2/3 + 6KV (section 9)."""
    return 6 * C * K + 4 * C * V + C * C / 3 + 6 * K * V


def flops_bwd_per_token(C: int, K: int, V: int) -> float:
    """Backward core 12CK + 8CV + 12KV plus the recompute 6CK + 2CV + C^2/3 + 4KV (section 9)."""
    return 12 * C * K + 8 * C * V + 12 * K * V + 6 * C * K + 2 * C * V + C * C / 3 + 4 * K * V


def cost_fwd(plan: Plan, save_states: bool) -> dict[str, int]:
    bh, t = plan.batch * plan.heads, plan.t_pad
    K, V, C, s = plan.dk, plan.dv, plan.C, plan.itemsize
    flops = bh * t * flops_fwd_per_token(C, K, V)
    # exps: Γ-factors (~3 per key element) + pairwise diagonal blocks (c per key element)
    trans = bh * t * K * (4 + plan.c)
    io = bh * t * (4 * K + 3 * V) * s + 2 * bh * K * V * F32
    if save_states:
        io += bh * plan.n_super * K * V * F32
    return {"flops": int(flops), "transcendentals": int(trans), "bytes_accessed": int(io)}


def cost_bwd(plan: Plan) -> dict[str, int]:
    bh, t = plan.batch * plan.heads, plan.t_pad
    K, V, C, s = plan.dk, plan.dv, plan.C, plan.itemsize
    recompute_states = (plan.ckpt - 1) / plan.ckpt  # superchunk state recompute
    flops = (
        bh * t * (flops_bwd_per_token(C, K, V) + recompute_states * flops_fwd_per_token(C, K, V))
    )
    trans = bh * t * K * (8 + 2 * plan.c) * (1 + recompute_states)
    io = bh * t * (8 * K + 5 * V) * s + 3 * bh * K * V * F32 + bh * plan.n_super * K * V * F32
    if plan.ckpt > 1:
        io += bh * t * (3 * K + 2 * V) * s  # superchunk re-read for the state recompute
    return {"flops": int(flops), "transcendentals": int(trans), "bytes_accessed": int(io)}
