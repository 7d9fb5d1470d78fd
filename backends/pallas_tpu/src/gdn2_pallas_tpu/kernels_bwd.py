"""Backward: one fused ``pallas_call`` (ALGORITHM.md section 6, Pass 1 + B1-B10 per chunk).

Grid ``(B, H / Hb, N)`` with the chunk axis last, "arbitrary", visited in reverse (chunk
``n = N - 1 - i``). The gradient of the state leaving the chunk, dS [K, V] float32, lives in VMEM
scratch ([Hb, K, V], Hb heads per step, layout.py): each step does, head by head, the reverse state
step (Pass 1) and the chunk-parallel gradients (B1-B10) of the same chunk, so dS never goes to
HBM.

Entry states: the forward saved the state entering every ``ckpt``-th chunk. At the first visited
(last) chunk of a superchunk the kernel recomputes the other ``ckpt - 1`` entry states into a VMEM
scratch ``[Hb, ckpt, K, V]`` from the superchunk's k, v, w, b, g tiles (a second, ``ckpt * C``-row
BlockSpec of the same arrays, fetched once per superchunk). Phase A of the chunk is recomputed.

VMEM per step (``config.vmem_bytes_bwd``; blocks x2 incl. the superchunk tiles + scratch + live
intermediates): float32, K = V = 128: C=32 (ckpt 4) 2.5 MiB, C=64 (ckpt 2) 3.4 MiB, C=128 5.1 MiB;
K=128, V=256, C=128 6.9 MiB; K = V = 256, C=128 10.9 MiB (the largest supported). Hb = 8:
K = V = 64, C=64 7.6 MiB; K = V = 128, C=32 bfloat16 12.0 MiB; K = V = 128, C=64 float32 would
need ~17 MiB, so that plan uses Hb = 1. All under the 16 MiB v5e default scoped limit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2_pallas_tpu import chunk_math as cm
from gdn2_pallas_tpu.config import Plan, cost_bwd
from gdn2_pallas_tpu.kernels_fwd import interpret_arg
from gdn2_pallas_tpu.layout import Tile, for_each_head, staging_shapes, state_spec, token_spec

F32 = jnp.float32


def _bwd_kernel(*refs, plan: Plan):
    ck, C, c = plan.ckpt, plan.C, plan.c
    q_ref, k_ref, v_ref, w_ref, b_ref, g_ref, do_ref, st_ref, dhT_ref, *rest = refs
    sup = [rest.pop(0) for _ in range(5)] if ck > 1 else []  # k, v, w, b, g superchunk tiles
    (dq_ref, dk_ref, dv_ref, dw_ref, db_ref, dg_ref, dh0_ref,
     dS_ref, S_scr, gam_ref, k_scr, *stage) = rest  # fmt: skip
    stage = stage or [None] * 13
    i = pl.program_id(2)
    n_steps = pl.num_programs(2)
    n = n_steps - 1 - i  # chunk index (reverse order)
    j_in = lax.rem(n, ck)  # chunk index inside its superchunk

    @pl.when(i == 0)
    def _():
        dS_ref[...] = dhT_ref[...]

    # ---- entry states of the superchunk (once per superchunk, at its last chunk) --------------
    @pl.when(j_in == ck - 1)
    def _():
        S_scr[:, 0] = st_ref[...]  # [Hb, K, V]
        if ck > 1:

            def advance(j, carry):
                @pl.when(j < j_in)
                def _():
                    rows = pl.ds(pl.multiple_of(j * C, C), C)
                    # k, v, w, b, g rows of chunk j of the superchunk (staged like the chunk tiles)
                    tiles = [
                        Tile(plan, r, stage[m], rows=rows)
                        for m, r in zip((1, 2, 3, 4, 5), sup, strict=True)
                    ]
                    for t in tiles:
                        t.load_stage()

                    def one_head(h):
                        kk, vv, ww, bb, gg = (t.read(h) for t in tiles)  # [C, K] / [C, V]
                        L = cm.chunk_local(
                            None, kk, vv, ww, bb, gg, c=c, mb=plan.mb, eps=plan.wy_eps,
                            gam_ref=gam_ref, k_ref=k_scr,
                        )  # fmt: skip
                        S = S_scr[h, j]  # [K, V]
                        S_scr[h, j + 1] = cm.state_update(L, S, L.U - cm.mm(L.Y, S))

                    for_each_head(plan, one_head)

                return carry

            lax.fori_loop(0, ck - 1, advance, 0)

    ins = [
        Tile(plan, r, stage[m])
        for m, r in enumerate((q_ref, k_ref, v_ref, w_ref, b_ref, g_ref, do_ref))
    ]
    for t in ins:
        t.load_stage()
    dq_t, dk_t, dv_t, dw_t, db_t, dg_t = (
        Tile(plan, r, stage[7 + m])
        for m, r in enumerate((dq_ref, dk_ref, dv_ref, dw_ref, db_ref, dg_ref))
    )
    scale = plan.scale
    rr, ss = cm.iota((C, C), 0), cm.iota((C, C), 1)

    def one_head(h):
        q, k, v, w, b, g, dO = (t.read(h) for t in ins)  # [C, K] / [C, V] f32
        S = S_scr[h, j_in]  # [K, V] f32 state entering chunk n
        dS = dS_ref[h]  # [K, V] f32 gradient of the state leaving chunk n
        L = cm.chunk_local(
            q, k, v, w, b, g, c=c, mb=plan.mb, eps=plan.wy_eps, gam_ref=gam_ref, k_ref=k_scr
        )
        R = L.U - cm.mm(L.Y, S)  # [C, V] F7

        # ---- Pass 1: reverse state step -----------------------------------------------------
        dR = scale * cm.mm_tn(L.A_qk, dO) + cm.mm(L.Kt, dS)  # [C, V]
        gamma_c_col = cm.row_to_col(L.gamma_c)  # [K, 1]
        dS_ref[h] = gamma_c_col * dS + scale * cm.mm_tn(L.Qt, dO) - cm.mm_tn(L.Y, dR)  # [K, V]

        # ---- Pass 2: chunk-parallel gradients -----------------------------------------------
        P_qk = scale * jnp.where(ss <= rr, cm.mm_nt(dO, R), 0.0)  # [C, C] B1 dA_qk
        dQt = scale * cm.mm_nt(dO, S)  # [C, K] B2 dQ̃
        dY = -cm.mm_nt(dR, S)  # [C, K]
        dKt = cm.mm_nt(R, dS)  # [C, K] B3 dK̃
        dgamma_c = cm.col_to_row(jnp.sum(S * dS, axis=1, keepdims=True))  # [1, K] dγ_C
        dEbar = cm.mm_tn(L.T, dY)  # [C, K] B4 dĒ
        dZ = cm.mm_tn(L.T, dR)  # [C, V] dZ (dU = dR)
        P_kk = -jnp.where(ss < rr, cm.mm_nt(dEbar, L.Y) + cm.mm_nt(dZ, L.U), 0.0)  # [C, C] B5
        dv_t.write(h, dZ * w)  # [C, V] B6
        dw_t.write(h, dZ * v)

        dec = cm.DecayFactors(L.gamma_cum, c, gam_ref)  # gam_ref / k_scr hold this chunk's rows
        dQs, dEs, dK1, dK2 = cm.score_backward(P_qk, P_kk, q, k, L.E, dec, k_scr)  # [C, K] B7
        dE = dEbar * L.eG + dEs  # [C, K] B8
        dq_t.write(h, dQt * L.eG + dQs)
        db_t.write(h, dE * k)
        dk_t.write(h, dE * b + dK1 + dK2 + dKt * L.eTail)
        dKtKt = dKt * L.Kt  # [C, K]
        dGam = (
            dQt * L.Qt + dEbar * L.Ebar - dKtKt + q * dQs - k * dK1 + L.E * dEs - k * dK2
        )  # [C, K] B9
        last = jnp.sum(dKtKt, axis=0, keepdims=True) + dgamma_c * L.gamma_c  # [1, K]
        dGam = dGam + jnp.where(cm.iota((C, 1), 0) == C - 1, last, 0.0)
        upper_incl = (ss >= rr).astype(F32)  # [C, C]
        dg_t.write(h, cm.mm(upper_incl, dGam))  # [C, K] B10 reverse cumsum

    for_each_head(plan, one_head)
    for t in (dq_t, dk_t, dv_t, dw_t, db_t, dg_t):
        t.flush()

    @pl.when(i == n_steps - 1)
    def _():
        dh0_ref[...] = dS_ref[...]


def backward_call(q, k, v, w, b, g, do, states, dhT, *, plan: Plan):
    """Kernel-layout inputs and dO, saved states, dh_final -> (dq, dk, dv, dw, db, dg, dh0)."""
    B, H, K, V, C, ck, hb = plan.batch, plan.heads, plan.dk, plan.dv, plan.C, plan.ckpt, plan.hb
    N = plan.n_chunks
    chunk = lambda i: N - 1 - i  # noqa: E731
    superchunk = lambda i: lax.div(N - 1 - i, ck)  # noqa: E731
    key_spec = token_spec(plan, K, C, chunk)
    val_spec = token_spec(plan, V, C, chunk)
    st_in = pl.BlockSpec((None, hb, None, K, V), lambda b_, h_, i: (b_, h_, superchunk(i), 0, 0))
    in_specs = [key_spec, key_spec, val_spec, val_spec, key_spec, key_spec, val_spec,
                st_in, state_spec(plan)]  # fmt: skip
    args = [q, k, v, w, b, g, do, states, dhT]
    if ck > 1:
        ks = token_spec(plan, K, ck * C, superchunk)
        vs = token_spec(plan, V, ck * C, superchunk)
        in_specs += [ks, vs, vs, ks, ks]
        args += [k, v, w, b, g]
    out_specs = [key_spec, key_spec, val_spec, val_spec, key_spec, key_spec, state_spec(plan)]
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, w, b, g)]
    out_shape.append(jax.ShapeDtypeStruct((B, H, K, V), F32))
    scratch = [
        pltpu.VMEM((hb, K, V), F32),  # dS
        pltpu.VMEM((hb, ck, K, V), F32),  # entry states of the superchunk's chunks
        pltpu.VMEM((C, K), F32),  # gamma_cum rows
        pltpu.VMEM((C, K), F32),  # k rows
        # float32 staging ("bthd", bf16): q, k, v, w, b, g, dO in; dq, dk, dv, dw, db, dg out
        *staging_shapes(plan, (K, K, V, V, K, K, V, K, K, V, V, K, K)),
    ]
    dq, dk, dv, dw, db, dg, dh0 = pl.pallas_call(
        functools.partial(_bwd_kernel, plan=plan),
        out_shape=out_shape,
        grid=(B, H // hb, N),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        cost_estimate=pl.CostEstimate(**cost_bwd(plan)),
        interpret=interpret_arg(plan),
        name="gdn2_bwd_fused",
    )(*args)
    return dq, dk, dv, dw, db, dg, dh0
