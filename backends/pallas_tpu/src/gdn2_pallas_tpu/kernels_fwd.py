"""The forward ``pallas_call``: phase A (F1-F6) and the state pass (F7-F9), fused.

Grid ``(B, H / hb, n_steps)``, the step axis last and "arbitrary" (the state is carried in VMEM
scratch from step to step), the others "parallel". A step takes ``nc`` chunks of ``hb`` heads (see
plan.py): phase A for all ``U = hb nc`` units at once, then ``nc`` state updates per head. The
training forward also writes the backward's residuals: ``T`` and ``A_qk`` of every chunk (packed into
one matrix), and the state entering every step but the first (that one is h0); with
``plan.chunk_states`` (prefix caching) the inference forward writes the state entering every chunk.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2_pallas_tpu import activations as act
from gdn2_pallas_tpu import blocks, flat_tokens, pooled, refs, state_writes, varlen
from gdn2_pallas_tpu import chunk_math as cm
from gdn2_pallas_tpu.cost import cost_forward
from gdn2_pallas_tpu.matmul import mm, mm_tn, traced_for
from gdn2_pallas_tpu.plan import Plan

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ForwardRefs:
    """The kernel's refs by name, as :func:`forward_call`'s table (refs.py) lists them."""

    table: object | None  # SMEM [3, n_chunks] int32 chunk table (plan.varlen, varlen.py), or
    #   [8, n_chunks] (plan.pooled, pooled.py); scalar-prefetched: the index maps may read it
    steps: object | None  # SMEM [2, n_steps] int32: each step's input window and whole output
    #   (plan.flat_tokens, flat_tokens.step_table); scalar-prefetched
    q: tuple  # the step's tiles (blocks.TokenIO): hb x [nc C, K], or one [nc C, hb, K] (of key
    #   heads with plan.key_groups), or nc x [C, hb, K] (plan.flat_tokens, flat_tokens.py)
    k: tuple
    v: tuple  # ... V; G x [nc C, hb, V / G] with plan.value_groups = G (blocks.py)
    w: tuple  # ... V, or one [hb, nc C] f32 block of a scalar gate (plan.scalar("w"))
    b: tuple  # ... K, or a scalar gate's block
    g: tuple  # ... K, or a scalar gate's block
    starts: object | None  # [nc C, 1] f32 sequence starts (plan.segments)
    gate_params: object | None  # [hb, 2, K] f32 exp(A_log), dt_bias (plan.gate)
    seq_h0: object | None  # [N, H, K, V] f32 in HBM: per-sequence initial states (plan.varlen),
    #   or the pool [P, H, G K, V / G] in its dtype (plan.pooled)
    h0: object  # [hb, K, V] f32
    o: object  # [B, H, t_pad, V] in HBM (HEAD_MAJOR) or [B, t_pad, G H, V / G] in HBM (grouped
    #   values), written by DMAs; else the [nc C, hb, V] block
    h_final: object  # [hb, K, V] f32
    seq_h_final: object | None  # [N, H, K, V] f32 in HBM: per-sequence final states (plan.varlen),
    #   or the pool (plan.pooled, aliased to seq_h0)
    TA_out: object | None  # [U / pack, C, pack C] residual: T (lower), A_qk^T (upper), lane-packed
    state_out: object | None  # [hb, K, V] plan.saved_state_dtype: the state entering this step
    #   (steps >= 1; plan.saved_states)
    chunks_out: object | None  # [nc, hb, K, V] f32: the state entering each chunk of the step
    #   (plan.chunk_states; [nc, hb G, K, V / G] with plan.value_groups = G)
    # Scratch.
    S: object  # [hb, K, V] f32 the carried state
    seq_buf: object | None  # [hb, K, V] f32 staging of per-sequence states (plan.varlen), or of
    #   slots [hb, G K, V / G] in the pool's dtype (plan.pooled)
    seq_sem: object | None  # its DMA semaphore (the reads)
    writes: tuple | None  # (buffers [2, *seq_buf], DMA semaphores [2], SMEM counters [2]) of the
    #   state writes (plan.varlen, state_writes.py)
    o_stage: object | None  # [hb, nc C, V] output staging for the DMAs (HEAD_MAJOR), or
    #   [G, nc C, hb, V / G] (plan.value_groups = G; blocks.TokenIO.store)
    o_flat: object | None  # [G, nc C, hb, V / G] o staged for its DMAs to the flat tokens
    #   (plan.flat_tokens, flat_tokens.FlatOutput)
    o_flat_sem: object | None  # their DMA semaphore
    o_sems: object | None  # DMA semaphores (1, hb) (HEAD_MAJOR), or (1, G) (grouped values)


def pack_residual(T: jax.Array, A_qk: jax.Array) -> jax.Array:
    """One [U, C, C] matrix for both: ``A_qk^T`` (upper, diagonal included) and the strictly lower
    ``T`` (T's diagonal is the constant ``1 / (1 + wy_eps)``). The backward multiplies by ``T``,
    ``T^T`` and ``A_qk^T``: two of the three read the packed matrix as it is (``mm``), one
    transposes it (``mm_tn``); packed as ``A_qk`` and ``T^T``, two of them transposed it."""
    C = T.shape[-1]
    lower = cm.iota((C, C), 0) > cm.iota((C, C), 1)
    return jnp.where(lower, T, jnp.swapaxes(A_qk, 1, 2))


def _forward_kernel(r: ForwardRefs, *, plan: Plan, save: bool):
    step = pl.program_id(2)

    @pl.when(step == 0)
    def _():
        r.S[...] = r.h0[...]

    if r.state_out is not None:  # step 0's entry state is h0: the backward reads it itself

        @pl.when(step > 0)
        def _():
            r.state_out[...] = r.S[...].astype(r.state_out.dtype)

    if not plan.flat_tokens:
        if not plan.runtime_merged_blocks:
            _step(r, plan, save, None, plan.merged_block)
            return
        io = blocks.TokenIO(plan, blocks.forward_step)
        g = blocks.load_gate(r.g, io, plan.dk, "g")  # [U, C, K] as given (raw with a gate)
        gp = None if r.gate_params is None else blocks.load_gate_params(r.gate_params, plan)
        cm.by_decay_bound(
            act.step_decay_bound(g, gp, plan),
            plan.runtime_merged_blocks,
            lambda m: _step(r, plan, save, None, m),
        )
        return
    # Two copies of the step: one rolls the chunks' rows (a window clamped near an end of the
    # flat tokens, flat_tokens.py), the other, nearly every step, has no roll at all.
    flat = flat_tokens.FlatTokens(plan, r.table, r.steps, step)
    needs = flat.needs_roll()

    @pl.when(needs)
    def _():
        _step(r, plan, save, flat.rolled(True), plan.merged_block)

    @pl.when(jnp.logical_not(needs))
    def _():
        _step(r, plan, save, flat.rolled(False), plan.merged_block)


def _step(r: ForwardRefs, plan: Plan, save: bool, flat: flat_tokens.FlatTokens | None, merged: int):
    """One grid step after its entry state: phase A, the state pass, the outputs; ``flat``: the
    step's chunks from the flat tokens (plan.flat_tokens), else None; ``merged``: the rows of
    the blocks whose levels merge (1: none; chunk_math.decay_levels)."""
    io = blocks.TokenIO(plan, blocks.forward_step)
    vio = io.values()  # v, w, o: the caller's grouped values with plan.value_groups
    batch, head_group, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    K, V, p = plan.dk, plan.dv, plan.precisions
    if flat is None:
        q, k = (io.load_keys(x, K, head_group) for x in (r.q, r.k))  # [U, C, K]
        b, g = (blocks.load_gate(x, io, K, n) for n, x in (("b", r.b), ("g", r.g)))
        v, w = vio.load(r.v, V), blocks.load_gate(r.w, vio, V, "w")  # [U, C, V]
    else:  # v, w as (T, HV, dv): G value heads per kernel head; scalar gates from the row

        def gate(name, ref, tio, d, groups=1):  # a scalar gate's block of the row, else flat
            scalar = plan.scalar(name)
            return blocks.load_gate(ref, tio, d, name) if scalar else flat.load(ref, d, groups)

        q, k = (flat.load_keys(x, K, head_group) for x in (r.q, r.k))  # [U, C, K]
        b, g = gate("b", r.b, io, K), gate("g", r.g, io, K)  # [U, C, K]
        # a scalar w only without value groups (the core broadcasts it with them)
        v, w = flat.load(r.v, V, plan.pool_groups), gate("w", r.w, vio, V, plan.pool_groups)
    valid = None  # [U, C, 1]: the rows of requests (flat tokens) or of the sequence (fused)
    if flat is not None:
        valid = flat.valid()
    elif plan.fused:
        valid = act.valid_rows(plan, step)
    if plan.fused:  # raw inputs -> activated, in VMEM only
        gp = None if r.gate_params is None else blocks.load_gate_params(r.gate_params, plan)
        x = act.activate(q, k, b, w, g, gp, plan.activations, plan.l2norm_eps, valid)
        q, k, b, w, g = x.q, x.k, x.b, x.w, x.g
    if flat is not None:  # rows of other requests or none: zero tokens
        q, k, v, w, b, g = flat.mask(valid, q, k, v, w, b, g)
    g = cm.clamp_log_decay(g)  # [U, C, K]
    seg = None if r.starts is None else cm.Segments.from_starts(blocks.load_starts(r.starts, plan))
    L = cm.chunk_local(q, k, v, w, b, g, seg, merged, plan.scalar_decay)
    A_kk, A_qk = cm.scores(L.E, q, k, L.levels, p.scores)  # [U, C, C] F4
    T = cm.wy_inverse(A_kk, plan.wy_eps, p.inverse)  # [U, C, C] F5
    if save:
        TA = blocks.pack_lanes(pack_residual(T, A_qk), plan)  # [U / pack, C, pack C]
        r.TA_out[...] = TA.astype(r.TA_out.dtype)
    YU = mm(T, jnp.concatenate([L.E_bar, L.Z], axis=2), p.wy)  # [U, C, K + V] F6
    Y, U = YU[:, :, :K], YU[:, :, K:]

    seqs = slots = writes = None
    if plan.varlen:  # states written to HBM without waiting (state_writes.py)
        like = r.seq_h_final.at[0, pl.ds(0, plan.hb)]  # the staged shape, in HBM
        writes = state_writes.StateWrites(*r.writes, like)
    if plan.pooled:  # the requests' states are slots of the pool
        slots = pooled.PoolStates(plan, r.table, r.seq_h0, r.seq_h_final, r.seq_buf, r.seq_sem,
                                  writes, head_group, step)  # fmt: skip
    elif plan.varlen:
        seqs = varlen.SequenceStates(plan, r.table, None, r.seq_buf, r.seq_sem, writes,
                                     head_group, step)  # fmt: skip
    outs = []
    for j in range(plan.nc):  # the state pass, all heads of the step at once
        if slots is not None:  # a request's first chunk starts from its slot, zeros or NaN
            slots.enter(j, r.S)
        if seqs is not None:  # a sequence's first chunk starts from its own h0
            seqs.hbm = r.seq_h0
            seqs.read(j, seqs.is_first(j), r.S)
        S = r.S[...]  # [hb, K, V] entering chunk j
        if r.chunks_out is not None:  # grouped values: [hb G, K, V / G] (blocks.py)
            r.chunks_out[j] = blocks.split_groups(S, plan.value_groups)
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
        if slots is not None:  # its final and checkpoint states to their slots
            slots.leave(j, S_next)
        if seqs is not None:  # a sequence's last chunk gives its h_final
            seqs.hbm = r.seq_h_final
            seqs.write(j, seqs.is_last(j), S_next)
    o = blocks.stack_chunks(outs, plan)  # [U, C, V]
    if flat is not None:  # each chunk's own rows, at the flat tokens
        out = flat_tokens.FlatOutput(
            plan, r.table, r.steps, r.o, r.o_flat, r.o_flat_sem, head_group, step
        )
        out.store(o)
    else:
        sems = None if r.o_sems is None else r.o_sems.at[jnp.int32(0)]
        vio.store(o, r.o, r.o_stage, sems, batch, head_group, step)

    @pl.when(step == pl.num_programs(2) - 1)
    def _():
        r.h_final[...] = r.S[...]

    if writes is not None:  # the last step waits for the writes still in flight
        writes.close()


def forward_call(
    q, k, v, w, b, g, starts, gate_params, table, seq_h0, h0, *, plan: Plan, save: bool
):
    """Kernel-layout inputs (blocks.TokenIO), sequence starts ``(B, t_pad, 1)`` (None without
    segments), gate parameters ``(H, 2, K)`` (None without a fused gate), the chunk table and the
    per-sequence initial states (None without cu_seqlens, varlen.py) and h0 ``(B, H, K, V)``
    f32 ->
    ``(o, h_final)``, plus the residuals when ``save`` (``T | A_qk^T``, and the states entering
    steps 1 to ``n_steps - 1`` unless there is one step), plus the chunk-entry
    states ``(B, t_pad / C, H, K, V)`` f32 with ``plan.chunk_states``."""
    B, H, K, V, hb = plan.batch, plan.heads, plan.dk, plan.dv, plan.hb
    step_of = blocks.forward_step
    io = blocks.TokenIO(plan, step_of)
    vio = io.values()  # v, w, o (grouped values: the caller's layout)
    G = plan.pool_groups
    o_spec, flat_stage = vio.out_spec(V), None
    if plan.flat_tokens:  # nc element windows of the flat tokens per step; v, w (T, HV, dv)
        keys, vals = flat_tokens.in_specs(plan, K), flat_tokens.in_specs(plan, V, G)
        o_spec = blocks.hbm_any()  # o at the flat tokens, (1, T, HV, dv), by manual DMAs
        flat_stage = pltpu.VMEM((G, plan.step_len, hb, V // G), v.dtype)  # FlatOutput's staging
    else:
        keys, vals = io.in_specs(K), vio.in_specs(V)
    # q, k: of the key heads (key_groups)
    qk = flat_tokens.key_specs(plan, K) if plan.flat_tokens else io.key_specs(K)
    state = blocks.state_spec(plan)
    on = lambda flag, x: x if flag else None  # noqa: E731  (None: absent)
    scalar = [blocks.scalar_spec(plan, step_of)]  # a scalar gate's (hb, nc C) block
    gate = lambda name, specs: scalar if plan.scalar(name) else specs  # noqa: E731
    res = (B, plan.head_groups, plan.n_steps)  # residuals: one block per grid step
    stage = (hb, G * K, V // G) if plan.pooled else (hb, K, V)  # a state's DMA staging
    slot_dtype = seq_h0.dtype if plan.pooled else F32  # the pool's dtype, or f32 states
    packed = blocks.residual_spec(plan, plan.residual_block, step_of)  # T | A_qk^T
    entry = blocks.saved_state_spec(plan, step_of)  # step entry states but step 0's
    saved_states = save and plan.saved_states > 0
    Gv = plan.value_groups  # chunk states in the caller's grouped layout (blocks.py)
    chunk_states_shape = (B, plan.t_pad // plan.C, H * Gv, K, V // Gv)
    kernel_refs = refs.Table(
        refs.Prefetch("table", table if plan.varlen else None),  # SMEM, seen by the index maps
        refs.Prefetch("steps", flat_tokens.step_table(table, plan) if plan.flat_tokens else None),
        refs.Input("q", qk, q),
        refs.Input("k", qk, k),
        refs.Input("v", vals, v),
        refs.Input("w", gate("w", vals), w),
        refs.Input("b", gate("b", keys), b),
        refs.Input("g", gate("g", keys), g),
        refs.Input("starts", blocks.starts_spec(plan, step_of), on(plan.segments, starts)),
        refs.Input("gate_params", blocks.gate_params_spec(plan), on(plan.gate, gate_params)),
        refs.Input("seq_h0", blocks.hbm_any(), on(plan.varlen, seq_h0)),
        refs.Input("h0", state, h0),
        # o, in v's kernel layout
        refs.Output("o", o_spec, jax.ShapeDtypeStruct(v.shape, v.dtype)),
        refs.Output("h_final", state, jax.ShapeDtypeStruct((B, H, K, V), F32)),
        refs.Output(  # per-sequence final states, written by DMAs
            "seq_h_final",
            blocks.hbm_any(),
            jax.ShapeDtypeStruct(seq_h0.shape, slot_dtype) if plan.varlen else None,
        ),
        refs.Output(
            "TA_out",
            packed,
            on(save, jax.ShapeDtypeStruct((*res, *plan.residual_block), plan.residual_dtype)),
        ),
        refs.Output(
            "state_out",
            entry,
            on(
                saved_states,
                jax.ShapeDtypeStruct(
                    (B, plan.head_groups, plan.saved_states, hb, K, V), plan.saved_state_dtype
                ),
            ),
        ),
        refs.Output(  # the chunk-entry states (B, n_steps nc, H, K, V)
            "chunks_out",
            blocks.chunk_states_spec(plan),
            on(plan.chunk_states, jax.ShapeDtypeStruct(chunk_states_shape, F32)),
        ),
        refs.Scratch("S", pltpu.VMEM((hb, K, V), F32)),
        # a state's DMA staging: [hb, K, V] f32, or a slot [hb, G K, V / G] in the pool's dtype
        refs.Scratch("seq_buf", on(plan.varlen, pltpu.VMEM(stage, slot_dtype))),
        refs.Scratch("seq_sem", on(plan.varlen, pltpu.SemaphoreType.DMA(()))),
        refs.Scratch("writes", on(plan.varlen, state_writes.scratch_shapes(stage, slot_dtype))),
        refs.Scratch("o_stage", vio.out_stage(V, v.dtype)),  # o staging
        refs.Scratch("o_sems", vio.out_sems(1)),
        refs.Scratch("o_flat", flat_stage),
        refs.Scratch("o_flat_sem", on(plan.flat_tokens, pltpu.SemaphoreType.DMA(()))),
        aliases={"seq_h0": "seq_h_final"} if plan.pooled else None,  # the pool, in place
    )
    return pl.pallas_call(
        kernel_refs.kernel(
            traced_for(
                functools.partial(_forward_kernel, plan=plan, save=save),
                plan.interpret is not None,
                plan.mxu_depth,
            ),
            ForwardRefs,
        ),
        out_shape=kernel_refs.out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=kernel_refs.num_scalar_prefetch,
            grid=plan.grid(),
            in_specs=kernel_refs.in_specs,
            out_specs=kernel_refs.out_specs,
            scratch_shapes=kernel_refs.scratch_shapes,
        ),
        input_output_aliases=kernel_refs.input_output_aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=plan.vmem_limit_bytes,
        ),
        cost_estimate=pl.CostEstimate(**cost_forward(plan, save)),
        interpret=blocks.interpret_params(plan),
        name="gdn2_fwd_train" if save else ("gdn2_fwd_pooled" if plan.pooled else "gdn2_fwd"),
    )(*kernel_refs.operands)
