"""The forward ``pallas_call``: phase A (F1-F6) and the state pass (F7-F9), fused.

Grid ``(B, H / hb, n_steps)``, the step axis last and "arbitrary" (the state is carried in VMEM
scratch from step to step), the others "parallel". A step takes ``nc`` chunks of ``hb`` heads (see
plan.py): phase A for all ``U = hb nc`` units at once, then ``nc`` state updates per head. The
training forward also writes the backward's residuals: ``T`` and ``A_qk`` of every chunk (packed into
one matrix), and the state entering every step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2_pallas_tpu import activations as act
from gdn2_pallas_tpu import blocks, varlen
from gdn2_pallas_tpu import chunk_math as cm
from gdn2_pallas_tpu.cost import cost_forward
from gdn2_pallas_tpu.matmul import mm, mm_tn
from gdn2_pallas_tpu.plan import Plan

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ForwardRefs:
    """The kernel's refs by role (each token input: one ``(nc C, d)`` ref per head)."""

    q: tuple  # the step's tiles (blocks.TokenIO): hb x [nc C, K], or one [nc C, hb, K]
    k: tuple
    v: tuple  # ... V
    w: tuple
    b: tuple
    g: tuple
    starts: object | None  # [nc C, 1] f32 sequence starts (plan.segments)
    gate_params: object | None  # [hb, 2, K] f32 exp(A_log), dt_bias (plan.gate)
    table: object | None  # SMEM [3, n_chunks] int32 chunk table (plan.varlen, varlen.py)
    seq_h0: object | None  # [N, H, K, V] f32 in HBM: per-sequence initial states (plan.varlen)
    h0: object  # [hb, K, V] f32
    o: object  # [B, H, t_pad, V] in HBM (HEAD_MAJOR), or the [nc C, hb, V] block
    h_final: object  # [hb, K, V] f32
    seq_h_final: object | None  # [N, H, K, V] f32 in HBM: per-sequence final states (plan.varlen)
    TA_out: object | None  # [U / pack, C, pack C] residual: A_qk (lower), T^T (upper), lane-packed
    state_out: object | None  # [hb, K, V] f32: the state entering this step
    # Scratch.
    S: object  # [hb, K, V] f32 the carried state
    seq_buf: object | None  # [hb, K, V] f32 staging of per-sequence states (plan.varlen)
    seq_sem: object | None  # its DMA semaphore
    o_stage: object | None  # [hb, nc C, V] output staging for the DMAs (HEAD_MAJOR)
    o_sems: object | None  # DMA semaphores (1, hb) (HEAD_MAJOR)

    @classmethod
    def unpack(cls, refs, io: blocks.TokenIO, save: bool) -> ForwardRefs:
        plan, n = io.plan, io.refs_per_array
        tiles = [tuple(refs[i * n : (i + 1) * n]) for i in range(6)]
        rest = list(refs[6 * n :])
        take = lambda on: rest.pop(0) if on else None  # noqa: E731
        starts, gate_params = take(plan.segments), take(plan.gate)
        table, seq_h0 = take(plan.varlen), take(plan.varlen)
        h0, o, h_final = rest.pop(0), rest.pop(0), rest.pop(0)
        seq_h_final = take(plan.varlen)
        TA_out, state_out = take(save), take(save)
        S = rest.pop(0)
        seq_buf, seq_sem = take(plan.varlen), take(plan.varlen)
        o_stage, o_sems = (rest[0], rest[1]) if rest else (None, None)
        return cls(
            *tiles, starts, gate_params, table, seq_h0, h0, o, h_final, seq_h_final, TA_out,
            state_out, S, seq_buf, seq_sem, o_stage, o_sems,
        )  # fmt: skip


def pack_residual(T: jax.Array, A_qk: jax.Array) -> jax.Array:
    """One [U, C, C] matrix for both: ``A_qk`` (lower, diagonal included) and the strictly upper
    ``T^T`` (T's diagonal is the constant ``1 / (1 + wy_eps)``). The backward multiplies by ``T``
    and ``T^T``, both of which read ``T^T`` directly (``mm_tn`` / ``mm``)."""
    C = T.shape[-1]
    upper = cm.iota((C, C), 1) > cm.iota((C, C), 0)
    return jnp.where(upper, jnp.swapaxes(T, 1, 2), A_qk)


def _forward_kernel(*refs, plan: Plan, save: bool):
    io = blocks.TokenIO(plan, blocks.forward_step)
    r = ForwardRefs.unpack(refs, io, save)
    batch, head_group, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    K, V, p = plan.dk, plan.dv, plan.precisions

    @pl.when(step == 0)
    def _():
        r.S[...] = r.h0[...]

    if save:
        r.state_out[...] = r.S[...]

    q, k, b, g = (io.load(x, K) for x in (r.q, r.k, r.b, r.g))  # [U, C, K]
    v, w = (io.load(x, V) for x in (r.v, r.w))  # [U, C, V]
    if plan.fused:  # raw inputs -> activated, in VMEM only
        gp = None if r.gate_params is None else blocks.load_gate_params(r.gate_params, plan)
        valid = act.valid_rows(plan, step)  # [U, C, 1]
        x = act.activate(q, k, b, w, g, gp, plan.activations, plan.l2norm_eps, valid)
        q, k, b, w, g = x.q, x.k, x.b, x.w, x.g
    g = cm.clamp_log_decay(g)  # [U, C, K]
    seg = None if r.starts is None else cm.Segments.from_starts(blocks.load_starts(r.starts, plan))
    L = cm.chunk_local(q, k, v, w, b, g, seg)
    A_kk, A_qk = cm.scores(L.E, q, k, L.levels, p.scores)  # [U, C, C] F4
    T = cm.wy_inverse(A_kk, plan.wy_eps, p.inverse)  # [U, C, C] F5
    if save:
        TA = blocks.pack_lanes(pack_residual(T, A_qk), plan)  # [U / pack, C, pack C]
        r.TA_out[...] = TA.astype(r.TA_out.dtype)
    YU = mm(T, jnp.concatenate([L.E_bar, L.Z], axis=2), p.wy)  # [U, C, K + V] F6
    Y, U = YU[:, :, :K], YU[:, :, K:]

    seqs = None
    if plan.varlen:
        seqs = varlen.SequenceStates(plan, r.table, None, r.seq_buf, r.seq_sem, head_group, step)
    outs = []
    for j in range(plan.nc):  # the state pass, all heads of the step at once
        if seqs is not None:  # a sequence's first chunk starts from its own h0
            seqs.hbm = r.seq_h0
            seqs.read(j, seqs.is_first(j), r.S)
        S = r.S[...]  # [hb, K, V] entering chunk j
        R = blocks.chunk_of(U, j, plan) - mm(
            blocks.chunk_of(Y, j, plan), S, p.state
        )  # [hb, C, V] F7
        O = mm(blocks.chunk_of(L.Q_tilde, j, plan), S, p.state) + mm(
            blocks.chunk_of(A_qk, j, plan), R, p.state
        )  # [hb, C, V] F8
        outs.append(plan.scale * O)
        S_next = blocks.chunk_of(L.decay_C_col, j, plan) * S + mm_tn(
            blocks.chunk_of(L.K_tilde, j, plan), R, p.state
        )  # [hb, K, V] F9
        r.S[...] = S_next
        if seqs is not None:  # a sequence's last chunk gives its h_final
            seqs.hbm = r.seq_h_final
            seqs.write(j, seqs.is_last(j), S_next)
    o = blocks.stack_chunks(outs, plan)  # [U, C, V]
    sems = None if r.o_sems is None else r.o_sems.at[jnp.int32(0)]
    copies = io.store(o, r.o, r.o_stage, sems, batch, head_group, step)

    @pl.when(step == pl.num_programs(2) - 1)
    def _():
        r.h_final[...] = r.S[...]

    for copy in copies:
        copy.wait()


def forward_call(
    q, k, v, w, b, g, starts, gate_params, table, seq_h0, h0, *, plan: Plan, save: bool
):
    """Kernel-layout inputs (blocks.TokenIO), sequence starts ``(B, t_pad, 1)`` (None without
    segments), gate parameters ``(H, 2, K)`` (None without a fused gate), the chunk table and the
    per-sequence initial states (None without cu_seqlens, varlen.py) and h0 ``(B, H, K, V)``
    f32 ->
    ``(o, h_final)``, plus ``(T, A_qk, states)`` residuals when ``save``."""
    B, H, K, V, hb = plan.batch, plan.heads, plan.dk, plan.dv, plan.hb
    step_of = blocks.forward_step
    io = blocks.TokenIO(plan, step_of)
    keys, vals = io.in_specs(K), io.in_specs(V)
    state = blocks.state_spec(plan)
    seg_specs = [blocks.starts_spec(plan, step_of)] if plan.segments else []
    seg_args = [starts] if plan.segments else []
    if plan.gate:
        seg_specs.append(blocks.gate_params_spec(plan))
        seg_args.append(gate_params)
    if plan.varlen:
        seg_specs += [pl.BlockSpec(memory_space=pltpu.SMEM), blocks.hbm_any()]
        seg_args += [table, seq_h0]
    out_shape = [
        jax.ShapeDtypeStruct(v.shape, v.dtype),  # o, in v's kernel layout
        jax.ShapeDtypeStruct((B, H, K, V), F32),  # h_final
    ]
    out_specs = [io.out_spec(V), state]
    if plan.varlen:  # per-sequence final states, written by DMAs
        out_shape.append(jax.ShapeDtypeStruct(seq_h0.shape, F32))
        out_specs.append(blocks.hbm_any())
    if save:
        res = (B, plan.head_groups, plan.n_steps)
        out_shape += [
            jax.ShapeDtypeStruct((*res, *plan.residual_block), plan.residual_dtype),  # T^T | A_qk
            jax.ShapeDtypeStruct((*res, hb, K, V), F32),  # step entry states
        ]
        out_specs += [
            blocks.residual_spec(plan, plan.residual_block, step_of),
            blocks.residual_spec(plan, (hb, K, V), step_of),
        ]
    scratch = [pltpu.VMEM((hb, K, V), F32)]  # S
    if plan.varlen:
        scratch += [pltpu.VMEM((hb, K, V), F32), pltpu.SemaphoreType.DMA(())]
    scratch += io.out_scratch([V], v.dtype)  # o staging
    return pl.pallas_call(
        functools.partial(_forward_kernel, plan=plan, save=save),
        out_shape=out_shape,
        grid=plan.grid(),
        in_specs=[*keys, *keys, *vals, *vals, *keys, *keys, *seg_specs, state],
        out_specs=out_specs,
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=plan.vmem_limit_bytes,
        ),
        cost_estimate=pl.CostEstimate(**cost_forward(plan, save)),
        interpret=blocks.interpret_params(plan),
        name="gdn2_fwd_train" if save else "gdn2_fwd",
    )(*io.args(q), *io.args(k), *io.args(v), *io.args(w), *io.args(b), *io.args(g), *seg_args, h0)
