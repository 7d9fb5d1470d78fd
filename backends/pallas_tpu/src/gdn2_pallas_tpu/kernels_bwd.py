"""The backward ``pallas_call``: the reverse state pass (Pass 1) and the chunk-parallel
gradients (B1-B10), fused.

Grid ``(B, H / hb, n_steps)``, the step axis last, "arbitrary", visited last step first; the
gradient of the state leaving the step, dS ``[hb, K, V]`` float32, is carried in VMEM scratch.
A step recomputes phase A of its ``U = hb nc`` units from the inputs and the saved ``T``, ``A_qk``
(no score or inverse products), the entry states of its chunks from the saved step entry state
(h0 at step 0; ``nc - 1`` updates), then runs the reverse state pass over its ``nc`` chunks and
the chunk-parallel gradients of all units at once. A plan with ``loop_heads`` runs its step's
heads in a loop of head-major steps of ``loop_heads`` heads instead (:func:`_head_loop`), so that
the program holds one iteration's code (plan.py, "Training steps").

dg has no exact self-pair terms (factor exp(0)): the diagonal of ``A_qk`` carries no gradient to Γ,
and ``K̃`` enters dg through an exclusive forward cumsum. Adding such terms to dΓ only to cancel
them through the reverse cumsum leaves rounding noise larger than the true dg under strong decay.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2_pallas_tpu import activations as act
from gdn2_pallas_tpu import blocks, refs, state_writes, varlen
from gdn2_pallas_tpu import chunk_math as cm
from gdn2_pallas_tpu.cost import cost_backward
from gdn2_pallas_tpu.matmul import MatmulPrecision, mm, mm_nt, mm_tn, traced_for
from gdn2_pallas_tpu.plan import Layout, Plan

F32 = jnp.float32
GRAD_NAMES = ("dq", "dk", "dv", "dw", "db", "dg")
GATE_OF_GRAD = {"dw": "w", "db": "b", "dg": "g"}  # the gradients a scalar gate may take
VALUE_GRADS = ("dv", "dw")  # in v's layout (grouped values: the caller's, blocks.TokenIO.values)


@dataclasses.dataclass(frozen=True)
class BackwardRefs:
    """The kernel's refs by name, as :func:`backward_call`'s table (refs.py) lists them."""

    q: tuple  # the step's tiles (blocks.TokenIO): hb x [nc C, K], or one [nc C, hb, K]
    k: tuple
    v: tuple  # ... V; G x [nc C, hb, V / G] with plan.value_groups = G (blocks.py)
    w: tuple  # ... V, or one [hb, nc C] f32 block of a scalar gate (plan.scalar("w"))
    b: tuple  # ... K, or a scalar gate's block
    g: tuple  # ... K, or a scalar gate's block
    dO: tuple  # ... V, as v
    starts: object | None  # [nc C, 1] f32 sequence starts (plan.segments)
    gate_params: object | None  # [hb, 2, K] f32 exp(A_log), dt_bias (plan.gate)
    table: object | None  # SMEM [3, n_chunks] int32 chunk table (plan.varlen, varlen.py)
    seq_h0: object | None  # [N, H, K, V] f32 in HBM: per-sequence initial states (plan.varlen)
    seq_dh_final: object | None  # [N, H, K, V] f32 in HBM (plan.varlen)
    TA: object  # [U / pack, C, pack C] saved T (strictly lower), A_qk^T (upper, diagonal),
    #   lane-packed
    state_in: object | None  # [hb, K, V] saved state entering the step (plan.saved_state_dtype;
    #   step 0 reads h0 instead; None with one step)
    h0: object  # [hb, K, V] f32: the state entering step 0
    dh_final: object  # [hb, K, V] f32
    grads: tuple  # dq, dk, dv, dw, db, dg: in HBM (HEAD_MAJOR; dv, dw with grouped values), or
    #   [nc C, hb, d] blocks; a scalar gate's gradient: its [hb, nc C] f32 block; dq, dk with
    #   plan.key_groups: [nc C, hb / G * K]
    dh0: object  # [hb, K, V] f32
    d_gate: object | None  # [hb, 2, K] f32 this step's sums for dA_log, d dt_bias (plan.gate)
    seq_dh0: object | None  # [N, H, K, V] f32 in HBM: per-sequence dh0 (plan.varlen)
    # Scratch.
    dS: object  # [hb, K, V] f32 gradient of the state leaving the step
    seq_buf: object | None  # [hb, K, V] f32 staging of per-sequence states (plan.varlen)
    seq_tmp: object | None  # [hb, K, V] f32 a state that a DMA may replace (plan.varlen)
    seq_sem: object | None  # its DMA semaphore (the reads)
    writes: tuple | None  # (buffers [2, hb, K, V] f32, DMA semaphores [2], SMEM counters [2]) of
    #   the dh0 writes (plan.varlen, state_writes.py)
    stages: tuple | None  # [hb, nc C, d] gradient staging for the DMAs (HEAD_MAJOR), one per
    #   gradient but a scalar gate's; [G, nc C, hb, V / G] for dv, dw (grouped values)
    sems: object | None  # DMA semaphores (6, hb) (HEAD_MAJOR), or (6, G) (grouped values)
    looped_in: tuple | None  # [hb, nc C, d] the step's q, k, v, w, b, g, dO head-major, in their
    #   dtype (a scalar gate's broadcast to d; plan.loop_heads, _head_loop)
    looped_out: tuple | None  # [hb, nc C, d] f32 the step's six gradients (plan.loop_heads)


def _backward_kernel(r: BackwardRefs, *, plan: Plan):
    @pl.when(pl.program_id(2) == 0)
    def _():
        r.dS[...] = r.dh_final[...]

    if plan.loop_heads:
        _head_loop(r, plan)
    else:
        _blocked_step(r, plan)


def _blocked_step(r: BackwardRefs, plan: Plan, sink=None):
    """:func:`_step` at the plan's blocking, or at the one its own decays allow
    (``plan.runtime_merged_blocks``: chunk_math.by_decay_bound)."""
    if not plan.runtime_merged_blocks:
        _step(r, plan, plan.merged_block, sink)
        return
    io = blocks.TokenIO(plan, blocks.reverse_step(plan.n_steps))
    g = blocks.load_gate(r.g, io, plan.dk, "g")  # [U, C, K] as given (raw with a gate)
    gp = None if r.gate_params is None else blocks.load_gate_params(r.gate_params, plan)
    cm.by_decay_bound(
        act.step_decay_bound(g, gp, plan),
        plan.runtime_merged_blocks,
        lambda merged: _step(r, plan, merged, sink),
    )


def _head_loop(r: BackwardRefs, plan: Plan):
    """The step's heads in a loop of ``hb / hs`` iterations of ``hs = plan.loop_heads`` heads, each
    the unchanged :func:`_step` of a head-major plan of ``hs`` heads (the program holds one
    iteration's code: plan.py, "Training steps"). The step's tiles are loaded once, as the step
    reads them (grouped keys and values, scalar gates), and kept head-major in VMEM in their
    dtype, so that an iteration's heads are a dynamic offset on a leading axis (on a token block's
    head axis, its sublanes, Mosaic cannot prove the offset aligned). The gradients are staged
    head-major in float32 and written after the loop as the whole step's (:func:`_store_grads`).
    The saved ``T | A_qk^T`` units are head-major (head, chunk), so an iteration's are
    ``hs nc / pack`` consecutive packed blocks (plan.py keeps ``hs nc`` a multiple of the pack)."""
    hs, pack = plan.loop_heads, plan.lane_pack
    assert not plan.varlen and plan.hb % hs == 0 and (hs * plan.nc) % pack == 0, plan
    sub = dataclasses.replace(
        plan,
        hb=hs,
        loop_heads=0,
        layout=Layout.HEAD_MAJOR,
        key_groups=1,
        value_groups=1,
        scalar_gates=(),
    )
    io = blocks.TokenIO(plan, blocks.reverse_step(plan.n_steps))
    vio = io.values()
    head_group = pl.program_id(1)
    K, V = plan.dk, plan.dv
    loaded = {
        "q": io.load_keys(r.q, K, head_group),
        "k": io.load_keys(r.k, K, head_group),
        "v": vio.load(r.v, V),
        "w": blocks.load_gate(r.w, vio, V, "w"),
        "b": blocks.load_gate(r.b, io, K, "b"),
        "g": blocks.load_gate(r.g, io, K, "g"),
        "dO": vio.load(r.dO, V),
    }  # [U, C, d] f32 each
    for name, dst in zip(LOOPED_INPUTS, r.looped_in, strict=True):
        dst[...] = loaded[name].reshape(plan.hb, plan.step_len, -1).astype(dst.dtype)

    def heads_of(x, h):  # a per-head ref's hs heads from h, or None
        return None if x is None else x.at[pl.ds(h, hs)]

    def body(i, carry):
        h = pl.multiple_of(i * hs, hs)  # the iteration's first head
        n_packed = hs * plan.nc // pack  # its packed T | A_qk^T blocks
        first = pl.multiple_of(i * n_packed, n_packed)
        tiles = {  # each input's hs heads, one [nc C, d] ref per head (a head-major plan's tiles)
            n: tuple(x.at[h + j] for j in range(hs))
            for n, x in zip(LOOPED_INPUTS, r.looped_in, strict=True)
        }
        sr = dataclasses.replace(
            r, **tiles, TA=r.TA.at[pl.ds(first, n_packed)], state_in=heads_of(r.state_in, h),
            h0=heads_of(r.h0, h), dh_final=heads_of(r.dh_final, h), dh0=heads_of(r.dh0, h),
            dS=heads_of(r.dS, h), gate_params=heads_of(r.gate_params, h),
            d_gate=heads_of(r.d_gate, h), stages=None, sems=None,
        )  # fmt: skip

        def sink(grads):  # [hs nc, C, d] each -> the stages' heads h .. h + hs - 1
            for x, stage in zip(grads, r.looped_out, strict=True):
                stage[pl.ds(h, hs)] = x.reshape(hs, plan.step_len, x.shape[-1])

        _blocked_step(sr, sub, sink)  # the iteration's own decays pick its blocking
        return carry

    jax.lax.fori_loop(0, plan.hb // hs, body, 0)
    grads = [x[...].reshape(plan.units, plan.C, x.shape[-1]) for x in r.looped_out]  # [U, C, d]
    _store_grads(r, plan, grads)


#: The inputs a looped step stages head-major (:func:`_head_loop`), in its refs' order.
LOOPED_INPUTS = ("q", "k", "v", "w", "b", "g", "dO")


def _step(r: BackwardRefs, plan: Plan, merged: int, sink=None):
    """One grid step after the carried dS: phase A again, the reverse state pass, the gradients;
    ``merged``: the rows of the blocks whose levels merge (1: none; chunk_math.decay_levels);
    ``sink``: where the gradients ``[U, C, d]`` go (None: the step's outputs, :func:`_store_grads`;
    an iteration of :func:`_head_loop`: its float32 stages)."""
    io = blocks.TokenIO(plan, blocks.reverse_step(plan.n_steps))
    vio = io.values()  # v, w, dO, dv, dw: the caller's grouped values with plan.value_groups
    head_group, i = pl.program_id(1), pl.program_id(2)
    n_steps = pl.num_programs(2)
    step = n_steps - 1 - i
    C, K, V, p, scale = plan.C, plan.dk, plan.dv, plan.precisions, plan.scale
    chunk = functools.partial(blocks.chunk_of, plan=plan)

    def inputs():
        """The step's tiles as float32 units: q, k, b, g [U, C, K]; v, w, dO [U, C, V]."""
        q, k = (io.load_keys(x, K, head_group) for x in (r.q, r.k))
        b, g = (blocks.load_gate(x, io, K, n) for n, x in (("b", r.b), ("g", r.g)))
        v, w, dO = vio.load(r.v, V), blocks.load_gate(r.w, vio, V, "w"), vio.load(r.dO, V)
        return q, k, b, g, v, w, dO

    q, k, b, g_raw, v, w, dO = inputs()
    g_in = g_raw
    if plan.fused:  # re-activate the raw inputs (nothing activated was saved)
        gp = None if r.gate_params is None else blocks.load_gate_params(r.gate_params, plan)
        valid = act.valid_rows(plan, step)  # [U, C, 1]
        x = act.activate(q, k, b, w, g_raw, gp, plan.activations, plan.l2norm_eps, valid)
        q, k, b, w, g_in = x.q, x.k, x.b, x.w, x.g
    g = cm.clamp_log_decay(g_in)
    seg = None if r.starts is None else cm.Segments.from_starts(blocks.load_starts(r.starts, plan))
    # The row sums along the chunks (Γ, dg) as MXU products (chunk_math.row_sums_on_mxu) in the
    # bfloat16 backward without sequence starts; the float32 one keeps float32 sums of rolls.
    sums_on_mxu = seg is None and p.grads is MatmulPrecision.BF16
    on_mxu = sums_on_mxu and plan.decay_in_bf16  # Γ of bfloat16 numbers: exact sums
    L = cm.chunk_local(q, k, v, w, b, g, seg, merged, plan.scalar_decay, gamma_on_mxu=on_mxu)
    TA = blocks.unpack_lanes(r.TA[...].astype(F32), plan)  # [U, C, C]
    rr, ss = cm.iota((C, C), 0), cm.iota((C, C), 1)
    A_qk_t = jnp.where(ss >= rr, TA, cm.ZERO)  # [U, C, C] A_qk^T
    T = jnp.where(
        ss < rr, TA, jnp.where(ss == rr, np.float32(1.0 / (1.0 + plan.wy_eps)), cm.ZERO)
    )  # [U, C, C]
    YU = mm(T, jnp.concatenate([L.E_bar, L.Z], axis=2), p.wy)  # [U, C, K + V] F6: T [Ē | Z]
    Y, U = YU[:, :, :K], YU[:, :, K:]

    seqs = None
    if plan.varlen:  # per-sequence states at chunk boundaries (varlen.py)
        writes = state_writes.StateWrites(*r.writes, r.seq_dh0.at[0, pl.ds(0, plan.hb)])
        seqs = varlen.SequenceStates(plan, r.table, None, r.seq_buf, r.seq_sem, writes,
                                     head_group, step)  # fmt: skip

    def replaced(value, j, hbm, when):
        """``value``, or the per-sequence state in ``hbm`` of chunk j when ``when``."""
        r.seq_tmp[...] = value
        seqs.hbm = hbm
        seqs.read(j, when, r.seq_tmp)
        return r.seq_tmp[...]

    # Pass 0: entry states and residual writes of the step's chunks. The state entering step 0
    # is h0 (the forward saves the others).
    S = r.h0[...]  # [hb, K, V]
    if r.state_in is not None:
        S = jnp.where(step == 0, S, r.state_in[...].astype(F32))  # [hb, K, V]
    S_in, R_all = [], []
    for j in range(plan.nc):
        if seqs is not None:  # a sequence's first chunk starts from its own h0
            S = replaced(S, j, r.seq_h0, seqs.is_first(j))
        R = chunk(U, j) - mm(chunk(Y, j), S, p.state)  # [hb, C, V] F7
        S_in.append(S)
        R_all.append(R)
        if j < plan.nc - 1:
            S = chunk(L.decay_C_col, j) * S + mm_tn(chunk(L.K_tilde, j), R, p.state)  # F9
    # Pass 1: the reverse state pass.
    dS = r.dS[...]  # [hb, K, V] w.r.t. the state leaving the step
    dS_out, dR_all = [None] * plan.nc, [None] * plan.nc
    for j in reversed(range(plan.nc)):
        if seqs is not None:  # a sequence's last chunk: the gradient of its h_final
            dS = replaced(dS, j, r.seq_dh_final, seqs.is_last(j))
        dO_j = chunk(dO, j)  # [hb, C, V]
        dR = scale * mm(chunk(A_qk_t, j), dO_j, p.state) + mm(
            chunk(L.K_tilde, j), dS, p.state
        )  # [hb, C, V]
        dS_out[j], dR_all[j] = dS, dR
        dS = (
            chunk(L.decay_C_col, j) * dS
            + scale * mm_tn(chunk(L.Q_tilde, j), dO_j, p.state)
            - mm_tn(chunk(Y, j), dR, p.state)
        )  # [hb, K, V] w.r.t. the state entering chunk j
        if seqs is not None:  # a sequence's first chunk: the gradient of its h0
            seqs.hbm = r.seq_dh0
            seqs.write(j, seqs.is_first(j), dS)
    r.dS[...] = dS

    @pl.when(i == n_steps - 1)
    def _():
        r.dh0[...] = dS

    # Pass 2: chunk-parallel gradients of all units. The inputs loaded again (and the products
    # formed from them): a float32 copy held from phase A to here would be spilled from
    # registers to VMEM, one store per vreg, in a step bound by its stores (docs/algorithm.md
    # section 10). Activated inputs (plan.fused) are kept.
    if not plan.fused:
        q, k, b, g_in, v, w, dO = inputs()
        L = L.rederived(q, k, v, w, b)
    S = blocks.stack_chunks(S_in, plan)  # [U, K, V] state entering the chunk
    R = blocks.stack_chunks(R_all, plan)  # [U, C, V]
    dS = blocks.stack_chunks(dS_out, plan)  # [U, K, V] w.r.t. the state leaving the chunk
    dR = blocks.stack_chunks(dR_all, plan)  # [U, C, V]
    P_qk = scale * jnp.where(ss <= rr, mm_nt(dO, R, p.grads), cm.ZERO)  # [U, C, C] B1
    dQ_tilde = scale * mm_nt(dO, S, p.grads)  # [U, C, K] B2
    dY = -mm_nt(dR, S, p.grads)  # [U, C, K]
    dK_tilde = mm_nt(R, dS, p.grads)  # [U, C, K] B3
    d_decay_C = blocks.row_sums(S * dS)  # [U, 1, K] row sums of S ⊙ dS
    dEZ = mm_tn(T, jnp.concatenate([dY, dR], axis=2), p.grads)  # [U, C, K + V] B4: T^T [dY | dU]
    dE_bar, dZ = dEZ[:, :, :K], dEZ[:, :, K:]
    P_kk = -jnp.where(ss < rr, mm_nt(dEZ, YU, p.grads), cm.ZERO)  # [U, C, C] B5
    sg = cm.score_backward(P_qk, P_kk, q, k, L.E, L.levels, p.score_grads)  # B7

    dE = dE_bar * L.e_gamma + sg.dE_s  # [U, C, K] B8
    dq = dQ_tilde * L.e_gamma + sg.dQ_s + sg.diag_qk * k
    db = dE * k
    dk = dE * b + sg.dK_s + sg.diag_qk * q + dK_tilde * L.e_tail
    dKK = dK_tilde * L.K_tilde  # [U, C, K]
    d_gamma = (
        dQ_tilde * L.Q_tilde + dE_bar * L.E_bar + q * sg.dQ_s + L.E * sg.dE_s - k * sg.dK_s
    )  # [U, C, K] B9 without the K̃ terms
    last_row = cm.iota(d_gamma.shape, 1) == C - 1
    d_gamma = d_gamma + jnp.where(last_row, d_decay_C * L.decay_C, cm.ZERO)  # γ_C = exp(Γ_C)
    # B10. K̃_r = exp(g_(r+1) + ... + g_C) k_r, so dK̃_r ⊙ K̃_r reaches dg_t for t > r only: an
    # exclusive forward cumsum, rather than "-dK̃⊙K̃ at row r, their sum at row C" cancelling
    # through the reverse cumsum (K̃ of the last real token has factor exp(0), also when the
    # chunk ends in padding).
    if sums_on_mxu:  # the same two sums as one product: 16 bits of each term, float32 sums
        dg = cm.row_sums_on_mxu([(d_gamma, "reverse"), (dKK, "exclusive")], parts=2)
    else:
        rows = cm.iota(dKK.shape, 1)
        previous = rows >= 1 if seg is None else (rows >= 1) & seg.same_as_shifted(1)
        dKK_before = cm.cumsum_rows(jnp.where(previous, cm.roll_rows(dKK, 1), cm.ZERO), seg=seg)
        dg = cm.cumsum_rows(d_gamma, reverse=True, seg=seg) + dKK_before  # inside a sequence
    dg = jnp.where(g_in >= cm.G_FLOOR, dg, cm.ZERO)  # the clamp's gradient
    dv, dw = dZ * w, dZ * v  # B6
    if plan.fused:  # gradients of the raw inputs, and this step's dA_log / d dt_bias sums
        dq, dk, db, dw, dg, partial = act.raw_gradients(
            x, g_raw, gp, plan.activations, valid, dq, dk, db, dw, dg
        )
        if partial is not None:
            r.d_gate[...] = blocks.per_head_sums(partial, plan)  # [hb, 2, K]
    grads = (dq, dk, dv, dw, db, dg)
    if sink is None:
        _store_grads(r, plan, grads)
    else:
        sink(grads)
    if seqs is not None:  # the last step waits for the dh0 writes still in flight
        seqs.writes.close()


def _store_grads(r: BackwardRefs, plan: Plan, grads) -> None:
    """The step's gradients [U, C, d] to their outputs."""
    batch, head_group = pl.program_id(0), pl.program_id(1)
    step = plan.n_steps - 1 - pl.program_id(2)
    io = blocks.TokenIO(plan, blocks.reverse_step(plan.n_steps))
    vio = io.values()
    stages = iter(r.stages or ())  # the staged gradients' buffers, in order
    staged = []  # their writes, started together (blocks.write_staged)
    for m, (x, out) in enumerate(zip(grads, r.grads, strict=True)):
        if plan.scalar(GATE_OF_GRAD.get(GRAD_NAMES[m], "")):  # summed over the channels
            blocks.store_scalar(x, out, plan)
            continue
        if m < 2 and plan.key_groups > 1:  # dq, dk summed over each key head's group
            blocks.store_key_grad(x, out, plan)
            continue
        sems = None if r.sems is None else r.sems.at[jnp.int32(m)]
        tiles = vio if GRAD_NAMES[m] in VALUE_GRADS else io
        if tiles.staged:
            staged.append(tiles.staged_write(x, out, next(stages), sems, batch, head_group, step))
        else:
            tiles.store(x, out, None, sems, batch, head_group, step)
    if staged:
        blocks.write_staged(staged)


def backward_call(
    q, k, v, w, b, g, dO, starts, gate_params, table, seq_h0, seq_dh_final, TA, states, h0,
    dh_final, *, plan: Plan,
):  # fmt: skip
    """Kernel-layout inputs and dO, sequence starts and gate parameters (or None), residuals
    (the saved states of steps 1 to ``n_steps - 1``, None with one step), h0 ``(B, H, K, V)``
    f32, dh_final -> (dq, dk, dv, dw, db, dg, dh0), and with a fused gate the per-step sums
    ``(B, H / hb, n_steps, hb, 2, K)`` of dA_log (row 0, per channel) and d dt_bias (row 1)."""
    B, H, K, V, hb = plan.batch, plan.heads, plan.dk, plan.dv, plan.hb
    step_of = blocks.reverse_step(plan.n_steps)
    io = blocks.TokenIO(plan, step_of)
    vio = io.values()  # v, w, dO, dv, dw (grouped values: the caller's layout)
    keys, vals = io.in_specs(K), vio.in_specs(V)
    qk = io.key_specs(K)  # q, k: of the key heads with plan.key_groups
    state = blocks.state_spec(plan)
    on = lambda flag, x: x if flag else None  # noqa: E731  (None: absent)
    dims = (K, K, V, V, K, K)
    scalar = blocks.scalar_spec(plan, step_of)  # a scalar gate's (hb, nc C) block
    gate = lambda name, specs: [scalar] if plan.scalar(name) else specs  # noqa: E731
    is_scalar = [plan.scalar(GATE_OF_GRAD.get(n, "")) for n in GRAD_NAMES]
    tiles = [vio if n in VALUE_GRADS else io for n in GRAD_NAMES]
    grad_specs = [
        scalar if sc else t.out_spec(d) for sc, t, d in zip(is_scalar, tiles, dims, strict=True)
    ]
    grad_shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, w, b, g)]
    if plan.key_groups > 1:  # dq, dk per key head, lane-dense (blocks.key_grad_spec)
        grad_specs[:2] = [blocks.key_grad_spec(plan, step_of, K)] * 2
        grad_shapes[:2] = [jax.ShapeDtypeStruct((B, plan.t_pad, q.shape[2] * K), q.dtype)] * 2
    grad_stages = [  # one per staged gradient, in order (blocks.TokenIO.staged), in its dtype
        t.out_stage(d, shape.dtype)
        for sc, t, d, shape in zip(is_scalar, tiles, dims, grad_shapes, strict=True)
        if not sc and t.staged
    ]
    res = (B, plan.head_groups, plan.n_steps)  # residuals: one block per grid step
    packed = blocks.residual_spec(plan, plan.residual_block, step_of)  # T | A_qk^T
    entry = blocks.saved_state_spec(plan, step_of)  # step entry states but step 0's
    # the looped step's head-major tiles (in their dtype) and float32 gradients (_head_loop)
    ins = zip((*dims, V), (q, k, v, w, b, g, dO), strict=True)
    looped_in = [pltpu.VMEM((hb, plan.step_len, d), x.dtype) for d, x in ins]
    looped_out = [pltpu.VMEM((hb, plan.step_len, d), F32) for d in dims]
    kernel_refs = refs.Table(
        refs.Input("q", qk, q),
        refs.Input("k", qk, k),
        refs.Input("v", vals, v),
        refs.Input("w", gate("w", vals), w),
        refs.Input("b", gate("b", keys), b),
        refs.Input("g", gate("g", keys), g),
        refs.Input("dO", vals, dO),
        refs.Input("starts", blocks.starts_spec(plan, step_of), on(plan.segments, starts)),
        refs.Input("gate_params", blocks.gate_params_spec(plan), on(plan.gate, gate_params)),
        refs.Input("table", pl.BlockSpec(memory_space=pltpu.SMEM), on(plan.varlen, table)),
        refs.Input("seq_h0", blocks.hbm_any(), on(plan.varlen, seq_h0)),
        refs.Input("seq_dh_final", blocks.hbm_any(), on(plan.varlen, seq_dh_final)),
        refs.Input("TA", packed, TA),
        refs.Input("state_in", entry, states),
        refs.Input("h0", state, h0),
        refs.Input("dh_final", state, dh_final),
        refs.Output(  # dq, dk, dv, dw, db, dg in the inputs' kernel layout (scalar gates: f32)
            "grads",
            grad_specs,
            grad_shapes,
        ),
        refs.Output("dh0", state, jax.ShapeDtypeStruct((B, H, K, V), F32)),
        refs.Output(  # per-step partial sums of dA_log and d dt_bias
            "d_gate",
            blocks.residual_spec(plan, (hb, 2, K), step_of),
            on(plan.gate, jax.ShapeDtypeStruct((*res, hb, 2, K), F32)),
        ),
        refs.Output(  # per-sequence dh0, written by DMAs
            "seq_dh0",
            blocks.hbm_any(),
            jax.ShapeDtypeStruct(seq_h0.shape, F32) if plan.varlen else None,
        ),
        refs.Scratch("dS", pltpu.VMEM((hb, K, V), F32)),
        # staging and a replaceable state for the per-sequence DMAs
        refs.Scratch("seq_buf", on(plan.varlen, pltpu.VMEM((hb, K, V), F32))),
        refs.Scratch("seq_tmp", on(plan.varlen, pltpu.VMEM((hb, K, V), F32))),
        refs.Scratch("seq_sem", on(plan.varlen, pltpu.SemaphoreType.DMA(()))),
        refs.Scratch("writes", on(plan.varlen, state_writes.scratch_shapes((hb, K, V), F32))),
        refs.Scratch(  # gradient staging (none for a blocked output: a scalar gate's...)
            "stages", grad_stages or None
        ),
        refs.Scratch("sems", vio.out_sems(len(dims))),
        refs.Scratch("looped_in", on(plan.loop_heads, looped_in)),
        refs.Scratch("looped_out", on(plan.loop_heads, looped_out)),
    )
    return pl.pallas_call(
        kernel_refs.kernel(
            traced_for(
                functools.partial(_backward_kernel, plan=plan),
                plan.interpret is not None,
                plan.mxu_depth,
            ),
            BackwardRefs,
        ),
        out_shape=kernel_refs.out_shape,
        grid=plan.grid(),
        in_specs=kernel_refs.in_specs,
        out_specs=kernel_refs.out_specs,
        scratch_shapes=kernel_refs.scratch_shapes,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=plan.vmem_limit_bytes,
        ),
        cost_estimate=pl.CostEstimate(**cost_backward(plan)),
        interpret=blocks.interpret_params(plan),
        name="gdn2_bwd",
    )(*kernel_refs.operands)
