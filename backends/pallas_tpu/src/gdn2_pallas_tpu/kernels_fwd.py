"""Forward: one fused ``pallas_call`` (phase A F1-F6 and the state pass F7-F9 per chunk).

Grid ``(B, H / Hb, N)``; the chunk axis N is last and "arbitrary" (sequential), the others
"parallel". Per step: the tiles of q, k, v, w, b, g of chunk n for Hb heads (Hb = 1 or 8,
layout.py), processed head by head; the states S [Hb, K, V] float32 live in VMEM scratch across
the chunk axis. Outputs: the o tile, h_final at the last chunk and, when ``save_states``, the
state entering every ``plan.ckpt``-th chunk (the backward residual).

VMEM per step (``config.vmem_bytes_fwd``; blocks x2 + scratch + live intermediates), Hb = 1:
float32, K = V = 128: C=32 1.1 MiB, C=64 1.7 MiB, C=128 3.1 MiB; K=128, V=256, C=128 4.3 MiB;
K = V = 256, C=128 6.8 MiB (bfloat16 ~15% less). Hb = 8, K = V = 128: C=32 5.7 MiB, C=64 7.8 MiB
(bfloat16 including its float32 staging). All under the 16 MiB v5e default scoped limit; a plan
whose forward or backward would not fit the 14 MiB budget with Hb = 8 uses Hb = 1 (config.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2_pallas_tpu import chunk_math as cm
from gdn2_pallas_tpu.config import Plan, cost_fwd
from gdn2_pallas_tpu.layout import Tile, for_each_head, staging_shapes, state_spec, token_spec

F32 = jnp.float32


def interpret_arg(plan: Plan):
    return pltpu.InterpretParams() if plan.interpret else False


def _fwd_kernel(*refs, plan: Plan, save_states: bool):
    q_ref, k_ref, v_ref, w_ref, b_ref, g_ref, h0_ref, o_ref, hT_ref, *rest = refs
    st_ref = rest.pop(0) if save_states else None
    S_ref, gam_ref, k_scr, *stage = rest
    stage = stage or [None] * 7
    n = pl.program_id(2)
    n_last = pl.num_programs(2) - 1

    @pl.when(n == 0)
    def _():
        S_ref[...] = h0_ref[...]

    if save_states:

        @pl.when(lax.rem(n, plan.ckpt) == 0)
        def _():
            st_ref[...] = S_ref[...]  # [Hb, K, V] states entering chunk n

    ins = [
        Tile(plan, r, stage[m]) for m, r in enumerate((q_ref, k_ref, v_ref, w_ref, b_ref, g_ref))
    ]
    for t in ins:
        t.load_stage()
    o_tile = Tile(plan, o_ref, stage[6])

    def one_head(h):
        q, k, v, w, b, g = (t.read(h) for t in ins)  # [C, K] x2, [C, V] x2, [C, K] x2 f32
        S = S_ref[h]  # [K, V] f32 state entering chunk n
        L = cm.chunk_local(
            q, k, v, w, b, g, c=plan.c, mb=plan.mb, eps=plan.wy_eps, gam_ref=gam_ref, k_ref=k_scr
        )
        R = L.U - cm.mm(L.Y, S)  # [C, V] F7
        O = plan.scale * (cm.mm(L.Qt, S) + cm.mm(L.A_qk, R))  # [C, V] F8
        o_tile.write(h, O)
        S_ref[h] = cm.state_update(L, S, R)  # [K, V] F9

    for_each_head(plan, one_head)
    o_tile.flush()

    @pl.when(n == n_last)
    def _():
        hT_ref[...] = S_ref[...]


def forward_call(q, k, v, w, b, g, h0, *, plan: Plan, save_states: bool):
    """Kernel-layout inputs (layout.py), h0 (B, H, K, V) f32 -> (o, h_final, states | None)."""
    B, H, K, V, C, hb = plan.batch, plan.heads, plan.dk, plan.dv, plan.C, plan.hb
    N = plan.n_chunks
    chunk = lambda i: i  # noqa: E731
    key_spec = token_spec(plan, K, C, chunk)
    val_spec = token_spec(plan, V, C, chunk)
    in_specs = [key_spec, key_spec, val_spec, val_spec, key_spec, key_spec, state_spec(plan)]
    out_specs = [val_spec, state_spec(plan)]
    out_shape = [
        jax.ShapeDtypeStruct(v.shape, v.dtype),  # o
        jax.ShapeDtypeStruct((B, H, K, V), F32),  # h_final
    ]
    if save_states:
        out_specs.append(
            pl.BlockSpec(
                (None, hb, None, K, V), lambda b_, h_, i: (b_, h_, lax.div(i, plan.ckpt), 0, 0)
            )
        )
        out_shape.append(jax.ShapeDtypeStruct((B, H, plan.n_super, K, V), F32))
    scratch = [
        pltpu.VMEM((hb, K, V), F32),  # S
        pltpu.VMEM((C, K), F32),  # gamma_cum rows
        pltpu.VMEM((C, K), F32),  # k rows
        *staging_shapes(plan, (K, K, V, V, K, K, V)),  # q, k, v, w, b, g, o ("bthd", bf16)
    ]
    outs = pl.pallas_call(
        functools.partial(_fwd_kernel, plan=plan, save_states=save_states),
        out_shape=out_shape,
        grid=(B, H // hb, N),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        cost_estimate=pl.CostEstimate(**cost_fwd(plan, save_states)),
        interpret=interpret_arg(plan),
        name="gdn2_fwd_fused",
    )(q, k, v, w, b, g, h0)
    if save_states:
        return outs[0], outs[1], outs[2]
    return outs[0], outs[1], None
