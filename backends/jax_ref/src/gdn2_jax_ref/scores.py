"""Decay-safe chunk scores and their two backward contractions (docs/algorithm.md 5.1, B7).

With ``gamma_cum`` the chunk-local inclusive cumsum of g (``[..., C, K]``)::

    Score(X, Y)[r, s] = sum_c X[r, c] Y[s, c] exp(gamma_cum[r, c] - gamma_cum[s, c])  (s <[=] r)
    rho(P, Y)[r]      = sum_{s <= r} P[r, s] Y[s] exp(gamma_cum[r] - gamma_cum[s])   (-> dX)
    kappa(P, X)[s]    = sum_{r >= s} P[r, s] X[r] exp(gamma_cum[r] - gamma_cum[s])   (-> dY)

Only exponentials of non-positive numbers are formed (for g <= 0), so any decay strength is safe:

- off-diagonal sub-blocks (row block I, column block J < I, size c = ``bc``) are plain matmuls
  through a reference row p with s <= p <= r: the first row of I for Score and rho, the last row
  of J for kappa. Both factors have exponent <= 0; ``clip`` caps them only as a NaN guard (it
  cannot bind for g <= 0);
- the diagonal c x c blocks apply the same rule recursively: each is halved, its off-diagonal
  quadrant goes through a reference row, down to ``leaf`` x ``leaf`` blocks that are formed
  pairwise with the exponent masked to -inf BEFORE the exp (an additive 0/-inf mask, which XLA
  fuses with the exp and the reduction, so no [c, c, K] decay tensor is ever stored).
  ``leaf = c`` is the plain pairwise diagonal; a smaller leaf does the same exact arithmetic with
  fewer exps (c*K per token and score drops to leaf*K) and more of it in matmuls.

Packed sequences (:mod:`gdn2_jax_ref.segments`): every function takes the rows' segment numbers
``seg`` (``[..., C, 1]``, or None for one sequence). A pair of rows in different segments has no
decay factor at all: the pairwise exponent is masked to -inf, and each reference-row factor is
masked to -inf unless its row shares the reference row's segment. Rows s <= p <= r lie in one
segment iff r and s do (segments are contiguous), so the masked reference split is exactly the
masked pairwise score, and a cross-segment pair contributes an exact 0.

All functions take arbitrary leading axes (``...`` = ``G, B, H`` in the backend). The first
operand (X for Score, P for rho and kappa) may carry extra leading axes over which the others
broadcast: several scores with the same Y and gamma_cum then share the reference-row factors and
run as one batched matmul per block.
"""

from __future__ import annotations

from typing import Final

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from gdn2_jax_ref.params import einsum
from gdn2_jax_ref.segments import same_segment

#: Size of the pairwise-formed diagonal blocks (see the module docstring).
PAIRWISE_LEAF: Final = 4


def _blocks(x: Float[Array, "... C d"], c: int) -> Float[Array, "... n c d"]:
    """Split the row axis into n = C / c sub-blocks."""
    *lead, C, d = x.shape
    if C % c:
        raise ValueError(f"length {C} is not a multiple of the block size {c}")
    return x.reshape(*lead, C // c, c, d)


def _diag_of(P: Float[Array, "... C C"], c: int) -> Float[Array, "... n c c"]:
    """The diagonal c x c blocks of P."""
    n = P.shape[-1] // c
    return jnp.stack([P[..., i * c : (i + 1) * c, i * c : (i + 1) * c] for i in range(n)], -3)


def _capped_exp(x: Float[Array, "*dims"], clip: float, keep=None) -> Float[Array, "*dims"]:
    """exp(min(x, clip)): the section-5.2 guard on a reference-split factor; exactly 0 where
    ``keep`` (a bool mask broadcasting to x, None: everywhere kept) is False."""
    x = jnp.minimum(x, clip)
    if keep is not None:
        x = jnp.where(keep, x, -jnp.inf)
    return jnp.exp(x)


def _same(sx: Int[Array, "... r 1"] | None, sref: Int[Array, "... 1 1"] | None):
    """Rows of ``sx`` in the reference row's segment (None without segments)."""
    return None if sx is None else sx == sref


def _maybe(f, x):
    return None if x is None else f(x)


def pairwise_decay(
    gb: Float[Array, "... n c K"], strict: bool, sb: Int[Array, "... n c 1"] | None = None
) -> Float[Array, "... n c c K"]:
    """exp(gamma_cum[r] - gamma_cum[s]) inside each block, exactly 0 where s > r (s >= r if strict)
    and where r and s are in different segments (``sb``: segment numbers, None: one segment).

    The exponent gets an additive -inf mask before the exp, so no positive exponent (and no
    inf * 0) ever occurs. Meant to be consumed inside one fused elementwise-and-reduce.
    """
    c = gb.shape[-2]
    keep = jnp.tril(jnp.ones((c, c), dtype=bool), -1 if strict else 0)  # [c(r), c(s)]
    if sb is not None:
        keep = keep & same_segment(sb, sb)  # [..., n, c, c]
    neg_inf_mask = jnp.where(keep, 0.0, -jnp.inf).astype(gb.dtype)[..., None]  # [..., c, c, 1]
    return jnp.exp(gb[..., :, None, :] - gb[..., None, :, :] + neg_inf_mask)  # [..., n, c, c, K]


def _leaf_inputs(*xs: Float[Array, "*dims"]) -> tuple[Float[Array, "*dims"], ...]:
    """Materialise the (small) operands of a pairwise leaf behind an optimisation barrier.

    Without it XLA may fuse an operand's producer into the [.., s, s, K] broadcast instead of
    fusing the broadcast into the reduction, and then stores that broadcast (c/leaf times the size
    of the operand); the barrier also keeps two leaves with equal operands from sharing one
    stored decay tensor.
    """
    return lax.optimization_barrier(xs)


def _halves(x: Float[Array, "... n s d"]) -> Float[Array, "... 2n h d"]:
    """Split every block into its two halves, as twice as many blocks."""
    *lead, n, s, d = x.shape
    return x.reshape(*lead, 2 * n, s // 2, d)


def _quadrants(P: Float[Array, "... n s s"]) -> Float[Array, "... 2n h h"]:
    """The two diagonal quadrants of every block, as twice as many blocks."""
    *lead, n, s, _ = P.shape
    h = s // 2
    both = jnp.stack([P[..., :h, :h], P[..., h:, h:]], axis=-3)  # [..., n, 2, h, h]
    return both.reshape(*lead, 2 * n, h, h)


def _recurse(s: int, leaf: int) -> bool:
    return s > leaf and s % 2 == 0


def _score_diag(
    xb: Float[Array, "... n s K"],
    yb: Float[Array, "... n s K"],
    gb: Float[Array, "... n s K"],
    sb: Int[Array, "... n s 1"] | None,
    strict: bool,
    leaf: int,
    clip: float,
) -> Float[Array, "... n s s"]:
    """Score restricted to diagonal blocks (each block on its own)."""
    *_, n, s, _ = xb.shape
    if not _recurse(s, leaf):
        xb, yb, gb, sb = _leaf_inputs(xb, yb, gb, sb)
        D = pairwise_decay(gb, strict, sb)  # [..., n, s, s, K]
        return jnp.sum(xb[..., :, None, :] * yb[..., None, :, :] * D, axis=-1)  # [..., n, s, s]
    h = s // 2
    inner = _score_diag(
        _halves(xb), _halves(yb), _halves(gb), _maybe(_halves, sb), strict, leaf, clip
    )
    inner = inner.reshape(*inner.shape[:-3], n, 2, h, h)  # [..., n, 2, h, h]
    ref = gb[..., h : h + 1, :]  # [..., n, 1, K] first row of the lower half
    sref = _maybe(lambda x: x[..., h : h + 1, :], sb)  # [..., n, 1, 1]
    keep_x = _same(_maybe(lambda x: x[..., h:, :], sb), sref)  # [..., n, h, 1]
    keep_y = _same(_maybe(lambda x: x[..., :h, :], sb), sref)  # [..., n, h, 1]
    x_ref = xb[..., h:, :] * _capped_exp(gb[..., h:, :] - ref, clip, keep_x)  # [..., n, h, K]
    y_ref = yb[..., :h, :] * _capped_exp(ref - gb[..., :h, :], clip, keep_y)  # [..., n, h, K]
    off = einsum("...rk,...sk->...rs", x_ref, y_ref)  # [..., n, h, h]
    top = jnp.concatenate([inner[..., 0, :, :], jnp.zeros_like(off)], axis=-1)  # [..., n, h, s]
    bottom = jnp.concatenate([off, inner[..., 1, :, :]], axis=-1)  # [..., n, h, s]
    return jnp.concatenate([top, bottom], axis=-2)  # [..., n, s, s]


def score(
    X: Float[Array, "... C K"],
    Yk: Float[Array, "... C K"],
    gamma_cum: Float[Array, "... C K"],
    c: int,
    clip: float,
    strict: bool,
    leaf: int = PAIRWISE_LEAF,
    seg: Int[Array, "... C 1"] | None = None,
) -> Float[Array, "... C C"]:
    """Score(X, Yk), lower triangular (strictly when ``strict``), 0 across segments."""
    C = X.shape[-2]
    n = C // c
    xb, yb, gb = _blocks(X, c), _blocks(Yk, c), _blocks(gamma_cum, c)  # [..., n, c, K]
    sb = _maybe(lambda x: _blocks(x, c), seg)  # [..., n, c, 1]
    diag = _score_diag(xb, yb, gb, sb, strict, leaf, clip)  # [..., n, c, c]
    lead = X.shape[:-2]
    rows = []
    for i in range(n):
        parts = []
        if i > 0:
            ref = gb[..., i, :1, :]  # [..., 1, K] first row of row block i
            sref = _maybe(lambda x, i=i: x[..., i, :1, :], sb)  # [..., 1, 1]
            keep_x = _same(_maybe(lambda x, i=i: x[..., i, :, :], sb), sref)  # [..., c, 1]
            keep_y = _same(_maybe(lambda x, i=i: x[..., : i * c, :], seg), sref)  # [..., i*c, 1]
            x_ref = xb[..., i, :, :] * _capped_exp(gb[..., i, :, :] - ref, clip, keep_x)
            y_ref = Yk[..., : i * c, :] * _capped_exp(
                ref - gamma_cum[..., : i * c, :], clip, keep_y
            )  # [..., i*c, K]
            parts.append(einsum("...rk,...sk->...rs", x_ref, y_ref))  # [..., c, i*c]
        parts.append(diag[..., i, :, :])  # [..., c, c]
        if i < n - 1:
            parts.append(jnp.zeros((*lead, c, (n - 1 - i) * c), X.dtype))  # [..., c, rest]
        rows.append(jnp.concatenate(parts, axis=-1))  # [..., c, C]
    return jnp.concatenate(rows, axis=-2)  # [..., C, C]


def _rho_diag(
    Pd: Float[Array, "... n s s"],
    yb: Float[Array, "... n s K"],
    gb: Float[Array, "... n s K"],
    sb: Int[Array, "... n s 1"] | None,
    leaf: int,
    clip: float,
) -> Float[Array, "... n s K"]:
    """rho restricted to diagonal blocks."""
    *_, n, s, K = yb.shape
    if not _recurse(s, leaf):
        Pd, yb, gb, sb = _leaf_inputs(Pd, yb, gb, sb)
        D = pairwise_decay(gb, False, sb)  # [..., n, s(r), s(s), K]
        return jnp.sum(Pd[..., None] * yb[..., None, :, :] * D, axis=-2)  # [..., n, s(r), K]
    h = s // 2
    inner = _rho_diag(
        _quadrants(Pd), _halves(yb), _halves(gb), _maybe(_halves, sb), leaf, clip
    )  # [..., 2n, h, K]
    inner = inner.reshape(*inner.shape[:-3], n, 2, h, K)  # [..., n, 2, h, K]
    ref = gb[..., h : h + 1, :]  # [..., n, 1, K] first row of the lower half
    sref = _maybe(lambda x: x[..., h : h + 1, :], sb)  # [..., n, 1, 1]
    keep_r = _same(_maybe(lambda x: x[..., h:, :], sb), sref)  # [..., n, h, 1]
    keep_s = _same(_maybe(lambda x: x[..., :h, :], sb), sref)  # [..., n, h, 1]
    y_ref = yb[..., :h, :] * _capped_exp(ref - gb[..., :h, :], clip, keep_s)  # [..., n, h, K]
    off = einsum("...rs,...sk->...rk", Pd[..., h:, :h], y_ref)  # [..., n, h, K]
    bottom = inner[..., 1, :, :] + _capped_exp(gb[..., h:, :] - ref, clip, keep_r) * off
    return jnp.concatenate([inner[..., 0, :, :], bottom], axis=-2)  # [..., n, s, K]


def score_rho(
    P: Float[Array, "... C C"],
    Yk: Float[Array, "... C K"],
    gamma_cum: Float[Array, "... C K"],
    c: int,
    clip: float,
    leaf: int = PAIRWISE_LEAF,
    seg: Int[Array, "... C 1"] | None = None,
) -> Float[Array, "... C K"]:
    """rho(P, Yk)[r] = sum_{s <= r} P[r, s] Yk[s] exp(gamma_cum[r] - gamma_cum[s]), s in r's
    segment."""
    C = Yk.shape[-2]
    n = C // c
    yb, gb = _blocks(Yk, c), _blocks(gamma_cum, c)  # [..., n, c, K]
    sb = _maybe(lambda x: _blocks(x, c), seg)  # [..., n, c, 1]
    diag = _rho_diag(_diag_of(P, c), yb, gb, sb, leaf, clip)  # [..., n, c(r), K]
    out = []
    for i in range(n):
        blk = diag[..., i, :, :]  # [..., c, K]
        if i > 0:
            ref = gb[..., i, :1, :]  # [..., 1, K] first row of row block i
            sref = _maybe(lambda x, i=i: x[..., i, :1, :], sb)  # [..., 1, 1]
            keep_r = _same(_maybe(lambda x, i=i: x[..., i, :, :], sb), sref)  # [..., c, 1]
            keep_s = _same(_maybe(lambda x, i=i: x[..., : i * c, :], seg), sref)  # [..., i*c, 1]
            y_ref = Yk[..., : i * c, :] * _capped_exp(
                ref - gamma_cum[..., : i * c, :], clip, keep_s
            )  # [..., i*c, K]
            off = einsum("...rs,...sk->...rk", P[..., i * c : (i + 1) * c, : i * c], y_ref)
            blk = blk + _capped_exp(gb[..., i, :, :] - ref, clip, keep_r) * off  # [..., c, K]
        out.append(blk)
    return jnp.concatenate(out, axis=-2)  # [..., C, K]


def _kappa_diag(
    Pd: Float[Array, "... n s s"],
    xb: Float[Array, "... n s K"],
    gb: Float[Array, "... n s K"],
    sb: Int[Array, "... n s 1"] | None,
    leaf: int,
    clip: float,
) -> Float[Array, "... n s K"]:
    """kappa restricted to diagonal blocks."""
    *_, n, s, K = xb.shape
    if not _recurse(s, leaf):
        Pd, xb, gb, sb = _leaf_inputs(Pd, xb, gb, sb)
        D = pairwise_decay(gb, False, sb)  # [..., n, s(r), s(s), K]
        return jnp.sum(Pd[..., None] * xb[..., :, None, :] * D, axis=-3)  # [..., n, s(s), K]
    h = s // 2
    inner = _kappa_diag(
        _quadrants(Pd), _halves(xb), _halves(gb), _maybe(_halves, sb), leaf, clip
    )  # [..., 2n, h, K]
    inner = inner.reshape(*inner.shape[:-3], n, 2, h, K)  # [..., n, 2, h, K]
    ref = gb[..., h - 1 : h, :]  # [..., n, 1, K] last row of the upper half
    sref = _maybe(lambda x: x[..., h - 1 : h, :], sb)  # [..., n, 1, 1]
    keep_r = _same(_maybe(lambda x: x[..., h:, :], sb), sref)  # [..., n, h, 1]
    keep_s = _same(_maybe(lambda x: x[..., :h, :], sb), sref)  # [..., n, h, 1]
    x_ref = xb[..., h:, :] * _capped_exp(gb[..., h:, :] - ref, clip, keep_r)  # [..., n, h, K]
    off = einsum("...rs,...rk->...sk", Pd[..., h:, :h], x_ref)  # [..., n, h, K]
    top = inner[..., 0, :, :] + _capped_exp(ref - gb[..., :h, :], clip, keep_s) * off
    return jnp.concatenate([top, inner[..., 1, :, :]], axis=-2)  # [..., n, s, K]


def score_kappa(
    P: Float[Array, "... C C"],
    X: Float[Array, "... C K"],
    gamma_cum: Float[Array, "... C K"],
    c: int,
    clip: float,
    leaf: int = PAIRWISE_LEAF,
    seg: Int[Array, "... C 1"] | None = None,
) -> Float[Array, "... C K"]:
    """kappa(P, X)[s] = sum_{r >= s} P[r, s] X[r] exp(gamma_cum[r] - gamma_cum[s]), r in s's
    segment."""
    C = X.shape[-2]
    n = C // c
    xb, gb = _blocks(X, c), _blocks(gamma_cum, c)  # [..., n, c, K]
    sb = _maybe(lambda x: _blocks(x, c), seg)  # [..., n, c, 1]
    diag = _kappa_diag(_diag_of(P, c), xb, gb, sb, leaf, clip)  # [..., n, c(s), K]
    out = []
    for j in range(n):
        blk = diag[..., j, :, :]  # [..., c, K]
        if j < n - 1:
            ref = gb[..., j, -1:, :]  # [..., 1, K] last row of column block j
            lo = (j + 1) * c
            sref = _maybe(lambda x, j=j: x[..., j, -1:, :], sb)  # [..., 1, 1]
            keep_r = _same(_maybe(lambda x, lo=lo: x[..., lo:, :], seg), sref)  # [..., C-lo, 1]
            keep_s = _same(_maybe(lambda x, j=j: x[..., j, :, :], sb), sref)  # [..., c, 1]
            x_ref = X[..., lo:, :] * _capped_exp(gamma_cum[..., lo:, :] - ref, clip, keep_r)
            off = einsum("...rs,...rk->...sk", P[..., lo:, j * c : lo], x_ref)  # [..., c, K]
            blk = blk + _capped_exp(ref - gb[..., j, :, :], clip, keep_s) * off
        out.append(blk)
    return jnp.concatenate(out, axis=-2)  # [..., C, K]
