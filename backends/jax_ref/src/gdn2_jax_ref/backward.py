"""The hand-derived chunkwise backward (docs/algorithm.md section 6).

A reverse ``lax.scan`` over the same groups of G chunks as the forward carries dS, the gradient
w.r.t. the state leaving the group. Per group:

1. recompute Phase A (F1-F6) from the inputs, and (Pass 0) the chunk-entry states S and the
   residual writes R = U - Y S by an inner scan from the saved group-entry state;
2. Pass 1: inner reverse ``lax.scan`` over the group's chunks (two matmuls per chunk), yielding
   dR and dS (w.r.t. the state leaving each chunk of the group);
3. Pass 2: B1-B10 for the G chunks at once, with the decay-safe rho/kappa of
   :mod:`gdn2_jax_ref.scores`; the gradients are written into the output buffers in place.
   dGamma (B9/B10) leaves out every term whose decay is exactly exp(0): they carry no gradient
   to g but would cancel only after rounding (see :func:`chunk_grads`).

dh0 is the final carry.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from gdn2_jax_ref.forward import entry_states, plan_rows
from gdn2_jax_ref.local import LOG_DECAY_FLOOR, ChunkLocal, chunk_local, cumsum_rows
from gdn2_jax_ref.params import ChunkParams, einsum
from gdn2_jax_ref.scores import score_kappa, score_rho
from gdn2_jax_ref.segments import RowSegments
from gdn2_jax_ref.varlen import SeqStates, enter, record
from gdn2core.diagnostics import probe


def reverse_state_pass(
    L: ChunkLocal,
    dO: Float[Array, "G B H C V"],
    dS_out: Float[Array, "B H K V"],
    scale: float,
    seqs: SeqStates | None = None,
    dh0: Float[Array, "N H K V"] | None = None,
) -> tuple[
    Float[Array, "G B H C V"],
    Float[Array, "G B H K V"],
    Float[Array, "B H K V"],
    Float[Array, "N H K V"] | None,
]:
    """Pass 1 over the chunks of one group, entered (from the right) with ``dS_out``.

    dR = scale A_qk^T dO + K_tilde dS;  dS <- exp(gamma_C) dS + scale Q_tilde^T dO - Y^T dR.
    The dO terms do not depend on dS and are formed for the G chunks at once; the scan does two
    matmuls per chunk. Returns ``(dR, dS, dS_in, dh0)`` with dS[n] the gradient w.r.t. the state
    leaving chunk n. With ``seqs`` (cu_seqlens), dS leaving a sequence's last chunk is its
    dh_final, the dS entering its first chunk is recorded in ``dh0`` and not carried on.
    """
    dR_o = scale * einsum("...rc,...rv->...cv", L.A_qk, dO)  # [G, B, H, C, V]
    dS_o = scale * einsum("...ck,...cv->...kv", L.Q_tilde, dO)  # [G, B, H, K, V]

    def step(carry, xs):  # dS: [B, H, K, V], w.r.t. the state leaving this chunk
        dS, d0 = carry
        dR_o_n, dS_o_n, K_tilde, decay_C, Y, rs = xs
        if rs is not None:
            dS = enter(seqs.dh_final, dS, rs.last, rs.seq)  # [B=1, H, K, V]
        dR = dR_o_n + einsum("bhck,bhkv->bhcv", K_tilde, dS)  # [B, H, C, V]
        dS_prev = decay_C[..., None] * dS + dS_o_n - einsum("bhck,bhcv->bhkv", Y, dR)
        if rs is not None:
            d0 = record(d0, dS_prev, rs.first, rs.seq)  # [N, H, K, V]
            dS_prev = jnp.where(rs.first, 0.0, dS_prev)  # nothing flows into the previous one
        return (dS_prev, d0), (dR, dS)  # dS_prev: [B, H, K, V]

    rs = None if seqs is None else seqs.resets
    xs = (dR_o, dS_o, L.K_tilde, L.decay_C, L.Y, rs)
    (dS_in, dh0), (dR, dS) = lax.scan(step, (dS_out, dh0), xs, reverse=True)
    return dR, dS, dS_in, dh0


def chunk_grads(
    L: ChunkLocal,
    qc: Float[Array, "G B H C K"],
    kc: Float[Array, "G B H C K"],
    vc: Float[Array, "G B H C V"],
    wc: Float[Array, "G B H C V"],
    bc: Float[Array, "G B H C K"],
    gc: Float[Array, "G B H C K"],
    S0: Float[Array, "B H K V"],
    dO: Float[Array, "G B H C V"],
    dS_out: Float[Array, "B H K V"],
    params: ChunkParams,
    seqs: SeqStates | None = None,
    dh0: Float[Array, "N H K V"] | None = None,
) -> tuple[
    tuple[Float[Array, "G B H C _"], ...], Float[Array, "B H K V"], Float[Array, "N H K V"] | None
]:
    """Passes 0, 1 and 2 for one group entered with state ``S0``. Returns
    ``((dq, dk, dv, dw, db, dg), dS_in, dh0)``, the gradients in chunk layout (``seqs``, ``dh0``:
    cu_seqlens, see :func:`reverse_state_pass`)."""
    scale, c, clip = params.scale, params.bc, params.clip
    S, R, _, _ = entry_states(L, S0, seqs)  # Pass 0: [G, B, H, K, V], [G, B, H, C, V]
    dR, dS, dS_in, dh0 = reverse_state_pass(L, dO, dS_out, scale, seqs, dh0)  # Pass 1
    dR = probe("jax_ref dR", dR)  # [G, B, H, C, V]
    dK_tilde = einsum("...cv,...kv->...ck", R, dS)  # B3 [G, B, H, C, K]
    d_decay_C = jnp.sum(S * dS, axis=-1)  # B3 [G, B, H, K]

    P_qk = scale * jnp.tril(einsum("...rv,...sv->...rs", dO, R))  # B1 [G, B, H, C, C]
    dQ_tilde = scale * einsum("...cv,...kv->...ck", dO, S)  # B2 [G, B, H, C, K]
    dY = -einsum("...cv,...kv->...ck", dR, S)  # B2 [G, B, H, C, K]
    dE_bar = einsum("...rc,...rk->...ck", L.T, dY)  # B4 T^T dY [G, B, H, C, K]
    dZ = einsum("...rc,...rv->...cv", L.T, dR)  # B4 T^T dU, dU = dR [G, B, H, C, V]
    P_kk = -jnp.tril(
        einsum("...rk,...sk->...rs", dE_bar, L.Y) + einsum("...rv,...sv->...rs", dZ, L.U), -1
    )  # B5 [G, B, H, C, C]
    P_kk = probe("jax_ref P_kk", P_kk)
    dv_c = dZ * wc  # B6 [G, B, H, C, V]
    dw_c = dZ * vc  # B6 [G, B, H, C, V]

    # B7, the two rho and the two kappa contractions each as one stacked call. The barrier gives
    # rho and kappa distinct copies of gamma_cum, so XLA cannot CSE their pairwise decays into one
    # shared (and then materialised) [.., c, c, K] tensor; each stays fused into its reduction.
    # The self pairs s = r of A_qk (decay exp(0) = 1) go around rho and kappa and are added to dq
    # and dk directly (B8): in B9 their +q P_rr k and -k P_rr q sit in the same row of dGamma and
    # cancel exactly, so they carry no gradient to g, but only after each was rounded inside an
    # O(|q P k|) sum. Under uniformly strong decay every other dGamma term is ~exp(g) small and
    # that rounding (~1e-8 absolute, ~ulp of O(0.1)) exceeded the true dg (~1e-8) several-fold.
    # Leaving them out is exact; P_kk is strictly lower already.
    g_rho, g_kappa = lax.optimization_barrier((L.gamma_cum, L.gamma_cum))
    P_qk_self = jnp.diagonal(P_qk, axis1=-2, axis2=-1)[..., None]  # [G, B, H, C, 1]
    P_both = jnp.stack([jnp.tril(P_qk, -1), P_kk])  # [2, G, B, H, C, C] both strictly lower
    seg = L.seg  # packed sequences: every factor across a start is 0 (gdn2_jax_ref.segments)
    seg_rows = None if seg is None else seg.seg  # [G, B, 1, C, 1]
    dQ_s, dE_s = score_rho(P_both, kc, g_rho, c, clip, seg=seg_rows)  # [G, B, H, C, K], s < r
    dK_1, dK_2 = score_kappa(P_both, jnp.stack([qc, L.E]), g_kappa, c, clip, seg=seg_rows)

    dE = dE_bar * L.e_head + dE_s  # B8 [G, B, H, C, K]
    dq_c = dQ_tilde * L.e_head + dQ_s + P_qk_self * kc  # B8 [G, B, H, C, K], self pairs back in
    db_c = dE * kc  # B8 [G, B, H, C, K]
    dk_c = dE * bc + dK_1 + dK_2 + P_qk_self * qc + dK_tilde * L.e_tail  # B8 [G, B, H, C, K]
    # B9 without the self pairs (see B7) and without the K_tilde terms.
    d_gamma = (
        dQ_tilde * L.Q_tilde + dE_bar * L.E_bar + qc * dQ_s - kc * dK_1 + L.E * dE_s - kc * dK_2
    )  # [G, B, H, C, K]
    C = qc.shape[-2]
    is_last = (jnp.arange(C) == C - 1)[:, None]  # [C, 1]
    d_gamma = d_gamma + jnp.where(is_last, (d_decay_C * L.decay_C)[..., None, :], 0.0)  # gamma_C
    # K_tilde_r = exp(gamma_C - gamma_r) k_r depends on g_{r+1..C} only, so its part of dg_j is
    # sum_{r<j} dK_tilde_r K_tilde_r: an exclusive forward cumsum. docs/algorithm.md B9/B10 add it as
    # -row r plus the row sum at C, reverse-cumsummed: the same sum in exact arithmetic, but the
    # r = C term (exp(0) k, O(1)) then enters twice and cancels only after rounding, as does the
    # last real token's when zero-g padding follows it (T not a multiple of C). Excluding r = C
    # alone leaves the padded case off by 100% of max|dg| under uniformly strong decay.
    # With packed sequences both cumsums are segment-local, like gamma_cum's: g_j enters only
    # the gamma_cum of later rows of its own segment (and gamma_C, K_tilde only through the last
    # segment, where decay_C and e_tail are not masked to 0).
    dg_c = cumsum_rows(d_gamma, reverse=True, seg=seg) + cumsum_rows(
        dK_tilde * L.K_tilde, exclusive=True, seg=seg
    )  # B10 [G, B, H, C, K]
    # g below the floor of floor_log_decay: exp(g) = 0 exactly, so its gradient is 0; a start's
    # g decays a zero state (it is left out of gamma_cum): 0 too.
    forgotten = gc < LOG_DECAY_FLOOR[gc.dtype]  # [G, B, H, C, K]
    if seg is not None:
        forgotten = forgotten | seg.is_start
    dg_c = jnp.where(forgotten, 0.0, dg_c)  # [G, B, H, C, K]
    return (dq_c, dk_c, dv_c, dw_c, db_c, dg_c), dS_in, dh0


def gdn2_chunk_backward(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    w: Float[Array, "B T H V"],
    b: Float[Array, "B T H K"],
    g: Float[Array, "B T H K"],
    states: Float[Array, "n B H K V"],
    do: Float[Array, "B T H V"],
    dh_final: Float[Array, "B H K V"],
    params: ChunkParams,
    segment_ids: Int[Array, "B T"] | None = None,
    cu_seqlens: Int[Array, " N1"] | None = None,
    h0: Float[Array, "N H K V"] | None = None,
) -> tuple[Float[Array, "B T H _"], ...]:
    """Gradients ``(dq, dk, dv, dw, db, dg, dh0)``: inputs' dtypes, dh0 in the state dtype.

    ``segment_ids``, ``cu_seqlens``: as :func:`gdn2_jax_ref.forward.gdn2_chunk_forward`; with
    ``cu_seqlens``, ``h0`` (the per-sequence initial states) is required and dh_final and dh0 are
    per sequence."""
    acc = params.acc_dtype
    bsz, seq = q.shape[:2]
    blk, io, varlen = plan_rows(q, v, params, cu_seqlens)
    rows = None if segment_ids is None else RowSegments.build(segment_ids, blk)
    dS0, dh0_0, seqs_h0, seqs_dh = dh_final.astype(acc), None, None, None  # [B, H, K, V]
    if varlen is not None:  # the carry starts at zero; dh_final[n] enters at chunk level
        seqs_h0, seqs_dh = h0.astype(acc), dh_final.astype(acc)  # [N, H, K, V]
        dS0 = jnp.zeros((bsz, *dh_final.shape[1:]), acc)  # [B=1, H, K, V]
        dh0_0 = jnp.where(varlen.empty[:, None, None, None], seqs_dh, 0.0)  # empty: dh_final
    inputs = tuple(io.pad(x) for x in (q, k, v, w, b, g))  # [B, Tp, H, d]
    do = io.pad(do)  # [B, Tp, H, V]
    bufs0 = tuple(jnp.zeros_like(x) for x in inputs)  # gradient buffers [B, Tp, H, d]

    def group_work(dS, dh0, i, S0):
        qc, kc, vc, wc, bc, gc = (io.load(x, i, acc) for x in inputs)  # [G, B, H, C, d]
        dO = io.load(do, i, acc)  # [G, B, H, C, V]
        seg = None if rows is None else rows.load_group(i, blk)  # [G, B, 1, C, 1]
        L = chunk_local(qc, kc, vc, wc, bc, gc, params=params, seg=seg)
        seqs = None if varlen is None else SeqStates(varlen.group(i, blk.group), seqs_h0, seqs_dh)
        return chunk_grads(L, qc, kc, vc, wc, bc, gc, S0, dO, dS, params, seqs, dh0)

    def group_skip(dS, dh0, i, S0):  # zero tokens only (see the forward): no gradient
        shape = (blk.group, bsz, q.shape[2], blk.bt)  # [G, B, H, C]
        grads = tuple(jnp.zeros((*shape, x.shape[-1]), acc) for x in inputs)
        return grads, dS, dh0

    def group_step(carry, xs):
        dS, bufs, dh0 = carry  # [B, H, K, V], 6 x [B, Tp, H, d], [N, H, K, V] or None
        i, S0 = xs  # group index, [B, H, K, V] group-entry state
        if varlen is None:
            grads, dS_in, dh0 = group_work(dS, dh0, i, S0)
        else:
            used = varlen.group_used(i, blk.group)
            grads, dS_in, dh0 = lax.cond(used, group_work, group_skip, dS, dh0, i, S0)
        bufs = tuple(io.store(buf, d, i) for buf, d in zip(bufs, grads, strict=True))
        return (dS_in, bufs, dh0), None

    carry0 = (dS0, bufs0, dh0_0)
    xs = (jnp.arange(blk.n_groups), states)
    (dS_in, bufs, dh0), _ = lax.scan(group_step, carry0, xs, reverse=True)
    dq, dk, dv, dw, db, dg = (buf[:, :seq] for buf in bufs)
    dh0 = dS_in if dh0 is None else dh0  # [B or N, H, K, V]
    return dq, dk, dv, dw, db, probe("jax_ref dg", dg), probe("jax_ref dh0", dh0)
