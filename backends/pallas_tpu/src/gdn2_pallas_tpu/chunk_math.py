"""In-kernel chunk math shared by the forward and backward kernels (ALGORITHM.md F1-F9, B1-B10).

Everything here runs inside a Pallas TPU kernel on one chunk of ``C = 2 c`` tokens of one
(batch, head): plain 2-D float32 values, 2-D iotas and masks, matmuls through ``lax.dot_general``.

Decay-safe scores (section 5.1). ``Score(X, Y)[r, s] = sum_ch X[r,ch] Y[s,ch] exp(Γ[r,ch]-Γ[s,ch])``:

- off-diagonal sub-block (rows c..C-1, columns 0..c-1): one matmul through the reference row
  ``p = c``, ``(X ⊙ exp(Γ - Γ_p)) (Y ⊙ exp(Γ_p - Γ))^T`` with both exponents <= 0 (the other rows
  are masked to -inf before the exp, i.e. to exact zeros);
- diagonal c x c sub-blocks: pairwise, one column pair (j, c + j) per loop step, the exponent
  ``Γ_r - Γ_s`` masked to -inf before the exp where s > r.

So only exponents <= 0 are ever formed: exact (up to underflow) at any decay strength, no clip.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
NEG_INF = -jnp.inf


def mm(a, b):
    """a @ b, float32 accumulation at full precision."""
    return lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=F32
    )


def mm_nt(a, b):
    """a @ b^T."""
    return lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=HIGHEST, preferred_element_type=F32
    )


def mm_tn(a, b):
    """a^T @ b."""
    return lax.dot_general(
        a, b, (((0,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=F32
    )


def iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def row_to_col(x):
    """[1, K] -> [K, 1] without a transpose: broadcast, keep the diagonal, lane-reduce."""
    K = x.shape[1]
    eye = iota((K, K), 0) == iota((K, K), 1)
    return jnp.sum(jnp.where(eye, jnp.broadcast_to(x, (K, K)), 0.0), axis=1, keepdims=True)


def col_to_row(x):
    """[K, 1] -> [1, K]."""
    K = x.shape[0]
    eye = iota((K, K), 0) == iota((K, K), 1)
    return jnp.sum(jnp.where(eye, jnp.broadcast_to(x, (K, K)), 0.0), axis=0, keepdims=True)


@dataclasses.dataclass(frozen=True)
class ChunkLocal:
    """Phase A of one chunk (F1-F6); every field float32."""

    gamma_cum: jax.Array  # [C, K] Γ, inclusive chunk-local cumsum of g
    eG: jax.Array  # [C, K] exp(Γ)
    eTail: jax.Array  # [C, K] exp(Γ_C - Γ)
    gamma_c: jax.Array  # [1, K] γ_C = exp(Γ_C)
    E: jax.Array  # [C, K] b ⊙ k
    Z: jax.Array  # [C, V] w ⊙ v
    Ebar: jax.Array  # [C, K] Ē = exp(Γ) ⊙ E
    Qt: jax.Array | None  # [C, K] Q̃ = exp(Γ) ⊙ q
    Kt: jax.Array  # [C, K] K̃ = exp(Γ_C - Γ) ⊙ k
    A_kk: jax.Array  # [C, C] strictly lower
    A_qk: jax.Array | None  # [C, C] lower incl. diagonal
    T: jax.Array  # [C, C] ((1 + eps) I + A_kk)^-1
    Y: jax.Array  # [C, K] T Ē
    U: jax.Array  # [C, V] T Z


class DecayFactors:
    """Masked decay factors of the reference-row split and of the pairwise diagonal blocks."""

    def __init__(self, gamma_cum, c, gam_ref):
        C, K = gamma_cum.shape
        self.C, self.c, self.K = C, c, K
        self.gamma_cum = gamma_cum
        self.gam_ref = gam_ref  # VMEM scratch [C, K] f32 holding Γ (for dynamic row loads)
        rows = iota((C, K), 0)
        self.top = rows < c  # [C, K] rows of the first sub-chunk
        self.rmod = jnp.where(self.top, rows, rows - c)  # [C, K] row index inside its sub-chunk
        gp = gamma_cum[c : c + 1, :]  # [1, K] Γ at the reference row p = c
        self.e_row = jnp.exp(jnp.where(self.top, NEG_INF, gamma_cum - gp))  # [C, K] rows >= c
        self.e_col = jnp.exp(jnp.where(self.top, gp - gamma_cum, NEG_INF))  # [C, K] rows < c
        rr, ss = iota((C, C), 0), iota((C, C), 1)
        self.rr, self.ss = rr, ss
        self.top_cc = rr < c  # [C, C]

    def diag(self, j):
        """Pairwise factors of column j (rows < c) and column c + j (rows >= c).

        Returns (dec [C, K], col_sel [C, C] bool) with dec[r] = exp(Γ_r - Γ_s(r)) masked to 0 for
        r < s(r), s(r) = j or c + j, and col_sel[r, s] = (s == s(r))."""
        g_j = self.gam_ref[pl.ds(j, 1), :]  # [1, K]
        g_cj = self.gam_ref[pl.ds(self.c + j, 1), :]  # [1, K]
        g_sel = jnp.where(self.top, g_j, g_cj)  # [C, K]
        dec = jnp.exp(jnp.where(self.rmod >= j, self.gamma_cum - g_sel, NEG_INF))  # [C, K] <= 1
        col_sel = self.ss == jnp.where(self.top_cc, j, self.c + j)  # [C, C]
        return dec, col_sel

    def select_rows(self, ref, j):
        """[C, K]: ref row j broadcast over the first sub-chunk, row c + j over the second."""
        return jnp.where(self.top, ref[pl.ds(j, 1), :], ref[pl.ds(self.c + j, 1), :])


def unit_lower_inverse(A, mb, eps):
    """T = ((1 + eps) I + A)^-1 for strictly-lower A [C, C] (F5).

    Diagonal mb x mb micro-blocks by row recursion (all micro-blocks at once), then the
    off-diagonal blocks by the block recursion T_I = T_II (E_I - sum_{L<I} A_IL T_L)."""
    C = A.shape[0]
    rr, ss = iota((C, C), 0), iota((C, C), 1)
    same = lax.div(rr, mb) == lax.div(ss, mb)  # [C, C] same micro-block
    A_bd = jnp.where(same, A, 0.0)  # [C, C] block-diagonal part
    A_off = jnp.where(same, 0.0, A)  # [C, C] strictly block-lower part
    eye = (rr == ss).astype(F32)  # [C, C]
    inv = 1.0 / (1.0 + eps)
    r_in = lax.rem(rr, mb)  # [C, C] row index inside the micro-block
    T_bd = eye * inv  # [C, C]
    for r in range(1, mb):
        T_bd = jnp.where(r_in == r, (eye - mm(A_bd, T_bd)) * inv, T_bd)
    T = T_bd  # [C, C]
    blk = lax.div(rr, mb)
    for i in range(1, C // mb):
        T = jnp.where(blk == i, mm(T_bd, eye - mm(A_off, T)), T)
    return T


def chunk_local(q, k, v, w, b, g, *, c, mb, eps, gam_ref, k_ref) -> ChunkLocal:
    """Phase A (F1-F6) of one chunk. q may be None (no A_qk, Q̃). Inputs [C, K] / [C, V] f32.

    gam_ref, k_ref: VMEM scratch [C, K] f32 (overwritten) for the dynamic row loads of the
    pairwise diagonal blocks."""
    C = k.shape[0]
    rr = iota((C, C), 0)
    ss = iota((C, C), 1)
    lower_incl = (ss <= rr).astype(F32)  # [C, C]
    gamma_cum = mm(lower_incl, g)  # [C, K] F1 Γ (f32 cumsum as a matmul)
    gam_last = gamma_cum[C - 1 : C, :]  # [1, K] Γ_C
    eG = jnp.exp(gamma_cum)  # [C, K] <= 1
    eTail = jnp.exp(gam_last - gamma_cum)  # [C, K] <= 1
    gamma_c = jnp.exp(gam_last)  # [1, K]
    E = b * k  # [C, K] F2
    Z = w * v  # [C, V]
    Ebar = eG * E  # [C, K] F3
    Qt = None if q is None else eG * q  # [C, K]
    Kt = eTail * k  # [C, K]

    gam_ref[...] = gamma_cum
    k_ref[...] = k
    dec = DecayFactors(gamma_cum, c, gam_ref)
    kc = k * dec.e_col  # [C, K] column side of the off-diagonal block
    A_kk = mm_nt(E * dec.e_row, kc)  # [C, C] F4 off-diagonal block (rows >= c, cols < c)
    A_qk = None if q is None else mm_nt(q * dec.e_row, kc)  # [C, C]

    def body(j, carry):
        a_kk, a_qk = carry
        d, col_sel = dec.diag(j)  # [C, K], [C, C]
        kd = dec.select_rows(k_ref, j) * d  # [C, K] k_s ⊙ exp(Γ_r - Γ_s)
        a_kk = a_kk + jnp.where(col_sel, jnp.sum(E * kd, axis=1, keepdims=True), 0.0)
        if a_qk is not None:
            a_qk = a_qk + jnp.where(col_sel, jnp.sum(q * kd, axis=1, keepdims=True), 0.0)
        return a_kk, a_qk

    A_kk, A_qk = lax.fori_loop(0, c, body, (A_kk, A_qk))
    A_kk = jnp.where(ss < rr, A_kk, 0.0)  # [C, C] strictly lower
    T = unit_lower_inverse(A_kk, mb, eps)  # [C, C] F5
    Y = mm(T, Ebar)  # [C, K] F6
    U = mm(T, Z)  # [C, V]
    return ChunkLocal(gamma_cum, eG, eTail, gamma_c, E, Z, Ebar, Qt, Kt, A_kk, A_qk, T, Y, U)


def state_update(L: ChunkLocal, S, R):
    """F9: S_next = γ_C ⊙_rows S + K̃^T R.  S [K, V], R [C, V] f32."""
    return row_to_col(L.gamma_c) * S + mm_tn(L.Kt, R)


def score_backward(P_qk, P_kk, q, k, E, dec: DecayFactors, k_ref):
    """B7: ρ(P_qk, k), κ(P_qk, q), ρ(P_kk, k), κ(P_kk, E) -> dQ_s, dK_1, dE_s, dK_2 [C, K].

    k_ref: VMEM scratch [C, K] f32 holding k (dynamic row loads)."""
    C, K = k.shape
    c = dec.c
    # off-diagonal sub-block through the reference row (both factors <= 1)
    ke = k * dec.e_col  # [C, K]
    dQs = dec.e_row * mm(P_qk, ke)  # [C, K] rows >= c
    dEs = dec.e_row * mm(P_kk, ke)  # [C, K]
    dK1 = dec.e_col * mm_tn(P_qk, q * dec.e_row)  # [C, K] rows < c
    dK2 = dec.e_col * mm_tn(P_kk, E * dec.e_row)  # [C, K]
    rows = iota((C, K), 0)

    def body(j, carry):
        dQs, dEs, dK1, dK2 = carry
        d, col_sel = dec.diag(j)  # [C, K], [C, C]
        pq = jnp.sum(jnp.where(col_sel, P_qk, 0.0), axis=1, keepdims=True)  # [C, 1] P_qk[r, s(r)]
        pk = jnp.sum(jnp.where(col_sel, P_kk, 0.0), axis=1, keepdims=True)  # [C, 1]
        kd = dec.select_rows(k_ref, j) * d  # [C, K]
        dQs = dQs + pq * kd
        dEs = dEs + pk * kd
        mq = pq * q * d  # [C, K] contributions to κ rows j / c + j
        mk = pk * E * d  # [C, K]
        for m, name in ((mq, "q"), (mk, "e")):
            top = jnp.sum(jnp.where(dec.top, m, 0.0), axis=0, keepdims=True)  # [1, K] -> row j
            bot = jnp.sum(jnp.where(dec.top, 0.0, m), axis=0, keepdims=True)  # [1, K] -> row c+j
            upd = jnp.where(rows == j, top, 0.0) + jnp.where(rows == c + j, bot, 0.0)  # [C, K]
            if name == "q":
                dK1 = dK1 + upd
            else:
                dK2 = dK2 + upd
        return dQs, dEs, dK1, dK2

    return lax.fori_loop(0, c, body, (dQs, dEs, dK1, dK2))
