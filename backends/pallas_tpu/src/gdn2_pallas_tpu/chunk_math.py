"""In-kernel chunk math of the forward and backward kernels (docs/algorithm.md, F1-F9, B1-B10).

Every function works on a batch of units: arrays ``[U, C, d]`` where a unit is one chunk of
``C`` tokens of one head, so that the chunk-parallel work of all the chunks and heads of a grid
step runs as batched matrix products whose dependency chains interleave on the MXU.

Decay-safe scores by levels (docs/algorithm.md section 10). ``C = 2^L``. Two rows
``s < r`` of a chunk are first separated at one level ``l`` (``h = 2^l``): they lie in the same
aligned ``2h``-block, ``r`` in its lower half and ``s`` in its upper half. Through the block's
reference row ``p`` (the first row of the lower half; ``s < p <= r``)::

    exp(Γ_r - Γ_s) = exp(Γ_r - Γ_p) * exp(Γ_p - Γ_s),   both exponents <= 0

so the pairs of level ``l`` are one masked matrix product of ``X ⊙ exp(Γ - Γ_p)`` (lower rows)
with ``Y ⊙ exp(Γ_p - Γ)`` (upper rows). ``L`` products cover every pair below the diagonal; the
diagonal itself has factor ``exp(0) = 1``. No exponent is ever positive, there is no clip, and the
result is exact up to underflow at any decay strength. The same per-level factors give the two
backward contractions (rho, kappa) as ``L`` products each.

A scalar decay (GDN's: one log decay per head and token, the same on every channel) needs no
levels: every pair's factor ``exp(Γ_r - Γ_s)`` is one number per pair, so a ``[C, C]`` matrix
``D`` of them (:class:`PairDecay`, exponents ``<= 0``) scales the product of the undecayed
operands: one stacked product per score matrix and per backward contraction.

The WY inverse by the same levels: with ``T_l`` the inverse of the block-diagonal part of
``M = (1 + eps) I + A_kk`` in blocks of ``2^l`` rows, and ``A_l`` the pairs of level ``l``,
``T_(l+1) = T_l - T_l A_l T_l`` exactly (``A_l T_l A_l = 0``): ``2 L`` products, of which
level 0's are free and, from ``h = 8`` up, each takes half the rows (:func:`wy_inverse`). The
scores and ``rho`` take half the rows from ``h = 8`` up too (:func:`lower_rows`): the MXU's time
goes by the rows it is fed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Final

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2_pallas_tpu.matmul import MatmulPrecision, mm, mm_nt, mm_shared, mm_tn, split_bf16
from gdn2_pallas_tpu.plan import MERGED_EXPONENT, NUM_LANES, NUM_SUBLANES

F32 = jnp.float32
#: A float32 zero for ``jnp.where``: a Python 0.0 would be a float64 constant inside the kernel
#: under ``jax_enable_x64``, which Mosaic cannot lower.
ZERO: Final = np.float32(0.0)
#: Log decays below this are raised to it. ``exp`` of anything below about -103.3 is exactly 0 in
#: float32, so a per-token decay of ``exp(G_FLOOR)`` forgets the state exactly as ``exp(-inf)``
#: does, while every cumulative sum stays finite (``-inf - (-inf)`` would be NaN). Its gradient is
#: 0 below the floor, as the reference's (``exp(g) * ...`` underflows to 0 there).
G_FLOOR: Final = -128.0
#: The exponent of a masked factor (a pair across a sequence boundary, a row cut off from the
#: chunk's entry or end state): finite, so the factor ``exp(MASKED) = 0`` (exactly, as for a
#: floored decay) never rests on ``exp(-inf)``, whose value on the TPU's own lowering interpret
#: mode does not show.
MASKED: Final = np.float32(G_FLOOR)


def iota(shape: tuple[int, ...], dim: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def roll_rows(x: jax.Array, shift: int) -> jax.Array:
    """``out[:, r] = x[:, r - shift]`` along the row axis (cyclic; callers mask the wrap)."""
    C = x.shape[1]
    return pltpu.roll(x, jnp.int32(shift % C), 1)  # int32 also under jax_enable_x64


@dataclasses.dataclass(frozen=True)
class Segments:
    """Packed sequences inside a chunk: ``count`` [U, C, 1] int32 is the number of sequence starts
    at or before each row of its chunk (a start resets the state to zero before that token). Rows
    r, s are in the same sequence exactly when their counts are equal; a row sees the state
    entering the chunk when its count is 0, and reaches the chunk's end state when its count is
    the last row's."""

    count: jax.Array  # [U, C, 1] int32

    @classmethod
    def from_starts(cls, starts: jax.Array) -> Segments:
        """``starts`` [U, C, 1] float32 (1.0 at a sequence start)."""
        return cls(cumsum_rows(starts).astype(jnp.int32))

    @property
    def last(self) -> jax.Array:
        """[U, 1, 1] the last row's count."""
        return self.count[:, -1:, :]

    def same_as_shifted(self, shift: int) -> jax.Array:
        """[U, C, 1]: row r and row r - shift are in the same sequence (cyclic; callers mask the
        wrap)."""
        return self.count == roll_rows(self.count, shift)


def cumsum_rows(x: jax.Array, reverse: bool = False, seg: Segments | None = None) -> jax.Array:
    """Inclusive (or reverse inclusive) sum along the rows of ``[U, C, d]``: log2(C) steps of a
    sublane roll and a masked float32 add. With ``seg``, the sums restart at every sequence start
    (a step adds a shifted partial sum only from the same sequence: since sequences are
    contiguous, that partial sum then lies entirely inside it)."""
    C = x.shape[1]
    rows = iota(x.shape, 1)
    shift = 1
    while shift < C:
        step = -shift if reverse else shift
        keep = (rows < C - shift) if reverse else (rows >= shift)
        if seg is not None:
            keep = keep & seg.same_as_shifted(step)
        x = x + jnp.where(keep, roll_rows(x, step), ZERO)
        shift *= 2
    return x


def row_sums_on_mxu(terms: list[tuple[jax.Array, str]], parts: int) -> jax.Array:
    """``sum_i M_i x_i`` per unit as one MXU product, for ``terms`` of ``x_i`` [U, C, d] float32
    and the kind of ``M_i`` [C, C] (0/1): ``"inclusive"`` (row r sums the rows s <= r, as
    :func:`cumsum_rows`), ``"reverse"`` (s >= r) or ``"exclusive"`` (s < r). No sequence starts
    (:func:`cumsum_rows` takes those).

    Each ``x_i`` enters as ``parts`` bfloat16 pieces stacked along the contraction, ``M_i`` as
    many times beside itself: ``parts = 1`` when its values are bfloat16 numbers (then the sums
    are float32 sums of the exact values), 2 otherwise (:func:`split_bf16`: 16 significant bits
    of float32's 24, for the bfloat16 backward's sums of float32 terms that already carry
    bfloat16 roundings). :func:`cumsum_rows` takes log2(C) rolls and masked adds of the whole
    ``[U, C, d]`` array, each stored to VMEM in a step bound by its stores (docs/algorithm.md
    section 10); this takes one ``[C, parts n C] x [parts n C, d]`` product per unit."""
    U, C, _ = terms[0][0].shape
    r, s = iota((C, C), 0), iota((C, C), 1)
    kinds = {"inclusive": s <= r, "reverse": s >= r, "exclusive": s < r}
    ones = [jnp.where(kinds[kind], 1.0, 0.0).astype(jnp.bfloat16) for _, kind in terms]
    M = jnp.concatenate([m for m in ones for _ in range(parts)], axis=1)  # [C, parts n C]

    def pieces(x):  # [.., C, d] float32 -> its bfloat16 pieces
        return [x.astype(jnp.bfloat16)] if parts == 1 else list(split_bf16(x))

    def stacked(u):  # [parts n C, d] bfloat16 of unit u ([U, parts n C, d] for None)
        xs = [x if u is None else x[u] for x, _ in terms]
        return jnp.concatenate([p for x in xs for p in pieces(x)], axis=-2)

    return mm_shared(M, stacked, U, MatmulPrecision.BF16)  # [U, C, d]


def n_levels(C: int) -> int:
    return C.bit_length() - 1


def level_pairs(C: int, level: int) -> jax.Array:
    """[C, C] bool: the pairs (r, s) first separated at ``level`` (r in the lower half of the
    aligned ``2^(level+1)``-block, s in its upper half)."""
    r, s = iota((C, C), 0), iota((C, C), 1)
    h = 1 << level
    return ((r >> (level + 1)) == (s >> (level + 1))) & ((r & h) != 0) & ((s & h) == 0)


def halves_are_tiles(h: int) -> bool:
    """A level of ``h``-row halves whose products may take the lower halves alone
    (:func:`lower_rows`): they are whole sublane tiles."""
    return h >= NUM_SUBLANES


def lower_rows(x: jax.Array, h: int) -> jax.Array:
    """[U, C/2, N]: the rows of ``x`` [U, C, N] in the lower halves of its aligned ``2h``-row
    blocks, in order (``h >= 8``: whole sublane tiles, a reshape and a slice)."""
    U, C, N = x.shape
    return x.reshape(U, C // (2 * h), 2 * h, N)[:, :, h:, :].reshape(U, C // 2, N)


def with_lower_rows(x: jax.Array, lower: jax.Array, h: int) -> jax.Array:
    """``x`` [U, C, N] with the rows of :func:`lower_rows` replaced by ``lower`` [U, C/2, N]."""
    U, C, N = x.shape
    blocks = x.reshape(U, C // (2 * h), 2 * h, N)
    lower = lower.reshape(U, C // (2 * h), h, N)
    return jnp.concatenate([blocks[:, :, :h, :], lower], axis=2).reshape(U, C, N)


def lower_level_pairs(C: int, level: int) -> jax.Array:
    """[C/2, C] bool: :func:`level_pairs` on the rows of :func:`lower_rows` (row ``i`` is row
    ``r = 2h (i // h) + h + i % h`` of the chunk)."""
    i, s = iota((C // 2, C), 0), iota((C // 2, C), 1)
    return ((i >> level) == (s >> (level + 1))) & ((s & (1 << level)) == 0)


def block_pairs(C: int, block: int) -> jax.Array:
    """[C, C] bool: the pairs (r > s) inside one aligned ``block``-row block: those first
    separated at a level below ``log2(block)``."""
    r, s = iota((C, C), 0), iota((C, C), 1)
    shift = n_levels(block)
    return ((r >> shift) == (s >> shift)) & (r > s)


def _reference_rows(gamma_cum: jax.Array, h: int) -> jax.Array:
    """Γ (or any [U, C, d] array) at each row's level-``h`` reference row.

    ``h >= 8``: whole sublane tiles, a reshape and a broadcast. ``h = 2, 4``: inside each 8-row
    tile, a sublane broadcast per reference row (no relayout across tiles)."""
    U, C, K = gamma_cum.shape
    if h >= NUM_SUBLANES:
        blocks = gamma_cum.reshape(U, C // (2 * h), 2 * h, K)
        ref = jnp.broadcast_to(blocks[:, :, h : h + 1, :], blocks.shape)
        return ref.reshape(U, C, K)
    tiles = gamma_cum.reshape(U, C // NUM_SUBLANES, NUM_SUBLANES, K)  # [U, C/8, 8, K]
    sub = lax.broadcasted_iota(jnp.int32, tiles.shape, 2)
    ref = jnp.zeros_like(tiles)
    for p in range(h, NUM_SUBLANES, 2 * h):  # first row of each lower half in the tile
        row = jnp.broadcast_to(tiles[:, :, p : p + 1, :], tiles.shape)
        ref = jnp.where((sub >= p - h) & (sub < p + h), row, ref)
    return ref.reshape(U, C, K)


@dataclasses.dataclass(frozen=True)
class Level:
    """The decay factors of the pairs first separated at levels ``lo..hi`` (one level, or the
    merged levels of a bounded gate): a pair (r, s) is ``row_factor[r] * col_factor[s]``.

    One level: ``lower`` [U, C, K] bool marks the lower-half rows; ``F`` [U, C, K] is
    ``exp(Γ_r - Γ_p)`` on lower rows and ``exp(Γ_p - Γ_s)`` on upper rows. Merged levels:
    ``lower`` is None, ``F`` the rows' factor ``exp(Γ_r - Γ_p)`` and ``F_col`` the columns'
    ``exp(Γ_p - Γ_s)``, every row both. The factors are formed where a product reads them."""

    lower: jax.Array | None
    F: jax.Array
    lo: int
    hi: int
    F_col: jax.Array | None = None

    @property
    def row_factor(self) -> jax.Array:
        """[U, C, K]: the factor of the later row r of a pair (0 on rows that are none)."""
        return self.F if self.lower is None else jnp.where(self.lower, self.F, ZERO)

    @property
    def col_factor(self) -> jax.Array:
        """[U, C, K]: the factor of the earlier row s of a pair (0 on rows that are none)."""
        return self.F_col if self.lower is None else jnp.where(self.lower, ZERO, self.F)

    @property
    def tile_rows(self) -> int:
        """``h`` when this is one level whose halves are whole sublane tiles (``h >= 8``): its
        products then take the lower-half rows alone (:func:`lower_rows`); else 0."""
        h = 1 << self.lo
        return h if self.lower is not None and halves_are_tiles(h) else 0

    def pairs(self, C: int) -> jax.Array:
        """[C, C] bool: the pairs this level holds."""
        if self.lo == self.hi:
            return level_pairs(C, self.lo)
        assert self.lo == 0, "merged levels start at level 0"
        return block_pairs(C, 2 << self.hi)


def merged_levels(gamma_cum: jax.Array, block: int) -> Level:
    """The levels inside aligned ``block``-row blocks as one (a bounded gate, plan.py): every
    row's factors relative to its block's reference row p (its first lower-half row),
    ``exp(Γ_r - Γ_p)`` and ``exp(Γ_p - Γ_s)``, whose exponents are at most ``block / 2`` decays
    in size, so their product ``exp(Γ_r - Γ_s)`` neither overflows nor underflows."""
    ref = _reference_rows(gamma_cum, block // 2)  # [U, C, K] Γ_p
    F_row, F_col = jnp.exp(gamma_cum - ref), jnp.exp(ref - gamma_cum)  # [U, C, K] each
    return Level(None, F_row, 0, n_levels(block) - 1, F_col)


@dataclasses.dataclass(frozen=True)
class PairDecay:
    """A scalar decay's factor of every pair at once (the module docstring): ``D`` [U, C, C] is
    ``exp(Γ_r - Γ_s)`` for ``s < r`` in the same sequence, 0 elsewhere (the diagonal of
    ``A_qk``, factor 1, is formed apart)."""

    D: jax.Array  # [U, C, C] float32


def pair_decay(gamma_cum: jax.Array, seg: Segments | None = None) -> PairDecay:
    """:class:`PairDecay` of Γ = ``gamma_cum`` [U, C, K], equal on every channel (a scalar
    decay broadcast over them). ``Γ_s`` along the lanes comes from one transpose of Γ's first
    lanes (with ``seg``, the rows' sequence counts ride in lane 1); a pair across a sequence
    boundary gets its exponent masked to :data:`MASKED` before the exp, as in
    :func:`decay_levels`."""
    U, C, K = gamma_cum.shape
    src = gamma_cum[:, :, : min(K, NUM_LANES)]  # [U, C, lanes] Γ_r on every lane
    if seg is not None:
        src = jnp.where(iota(src.shape, 2) == 1, seg.count.astype(F32), src)
    cols = jnp.swapaxes(src, 1, 2)  # [U, lanes, C]: row 0 Γ_s, row 1 the count of row s
    expo = gamma_cum[:, :, :1] - cols[:, :1, :]  # [U, C, C] Γ_r - Γ_s
    keep = iota((U, C, C), 1) > iota((U, C, C), 2)  # [U, C, C] s < r
    if seg is not None:
        keep = keep & (seg.count.astype(F32) == cols[:, 1:2, :])
    return PairDecay(jnp.exp(jnp.where(keep, expo, MASKED)))


#: The factors of a chunk's pairs: its levels, or one matrix of a scalar decay.
Decay = list[Level] | PairDecay


def decay_levels(
    gamma_cum: jax.Array, g: jax.Array, seg: Segments | None = None, block: int = 1
) -> list[Level]:
    """The levels of a chunk (Γ = ``gamma_cum`` and the clamped ``g``, both [U, C, K]): the ``L``
    levels, or with ``block > 1`` (a bounded gate, no ``seg``) the levels inside ``block``-row
    blocks merged into one (:func:`merged_levels`) and the levels above it.

    With ``seg`` (Γ then restarts at every sequence start), a row in another sequence than its
    reference row gets the factor 0 (exponent masked to the finite :data:`MASKED` before the
    exp): every pair across a sequence boundary then has an exactly-zero factor, since one of its
    rows differs from the reference row between them."""
    U, C, K = gamma_cum.shape
    rows = iota((U, C, K), 1)
    levels = []
    first = 0
    if block > 1:
        assert seg is None, "merged levels: a reference row may lie in another sequence"
        levels.append(merged_levels(gamma_cum, block))
        first = n_levels(block)
    for level in range(first, n_levels(C)):
        h = 1 << level
        lower = (rows & h) != 0
        if h == 1:  # p = r for odd r (factor 1); even s pairs with p = s + 1: exp(g_(s+1))
            expo = jnp.where(lower, ZERO, roll_rows(g, -1))
            same = None if seg is None else seg.same_as_shifted(-1) | lower
        else:
            ref = _reference_rows(gamma_cum, h)
            expo = jnp.where(lower, gamma_cum - ref, ref - gamma_cum)  # <= 0 on both halves
            same = None if seg is None else seg.count == _reference_rows(seg.count, h)
        if same is not None:
            expo = jnp.where(same, expo, MASKED)
        levels.append(Level(lower, jnp.exp(expo), level, level))
    return levels


def heads_max(x: jax.Array, nc: int) -> jax.Array:
    """The elementwise maximum over the heads of units ``x`` [U, ...] (unit ``head * nc +
    chunk``): ``[nc, ...]``, one per chunk of the step, by a tree of ``jnp.maximum``
    (elementwise, so a NaN carries on every backend)."""
    parts = [x[h * nc : (h + 1) * nc] for h in range(x.shape[0] // nc)]  # heads x [nc, ...]
    while len(parts) > 1:
        pairs = [jnp.maximum(a, b) for a, b in zip(parts[::2], parts[1::2], strict=False)]
        parts = pairs + parts[len(pairs) * 2 :]
    return parts[0]


def decay_row_bound(g: jax.Array, nc: int) -> jax.Array:
    """[nc, C, K]: the heads' largest ``|g|`` of each chunk, row and channel (``g`` [U, C, K]
    clamped, units ``head * nc + chunk``), the bound :func:`window_maxima` sums."""
    return heads_max(jnp.abs(g), nc)


def window_maxima(
    bound: jax.Array,
    widths: tuple[int, ...],
    roll: Callable[[jax.Array, int], jax.Array] = roll_rows,
) -> dict[int, jax.Array]:
    """For each of ``widths`` (powers of two, at most ``C``): a bound on the largest sum of
    ``|g|`` over that many consecutive rows of a unit, on any channel, as a float32 scalar,
    from ``bound`` [nc, C, K], a bound on the ``|g|`` of every head at each chunk, row and
    channel (:func:`decay_row_bound`, or a fused gate's, activations.py): the heads share their
    sums (a chunk's windows hold the same tokens in every head, so a strong head bounds them
    all), the chunks keep their own. Sums by doubling (a sublane roll and an add per doubling);
    a window wraps around its chunk's rows, which only adds terms. Infinite when ``bound`` holds
    a NaN, which becomes infinite first (whether a reduction's maximum carries a NaN differs by
    backend: XLA on a CPU drops it). ``roll``: :func:`roll_rows` in a kernel (merged_steps.py
    applies the same rule outside one)."""
    sums = jnp.where(bound == bound, bound, np.float32(np.inf))  # [nc, C, K] windows of 1 row
    width, out = 1, {}  # sums: [nc, C, K] the windows of `width` rows ending at each row
    while True:
        if width in widths:
            out[width] = jnp.max(sums)
        if width >= max(widths):
            return out
        sums = sums + roll(sums, width)
        width *= 2


def mergeable(window_max: jax.Array) -> jax.Array:
    """Whether the levels inside aligned ``block``-row blocks merge (:func:`merged_levels`),
    given ``window_max``, a bound on the largest sum of ``|g|`` over ``block / 2`` consecutive
    rows of a unit (:func:`window_maxima`): at most :data:`MERGED_EXPONENT`.

    A merged factor's exponent is ``Γ_r - Γ_p`` (or its negative), ``p`` the reference row of
    ``r``'s block: the sum of ``|g|`` over the rows after the earlier of the two up to the later,
    at most ``block / 2`` consecutive rows of the block. So no factor leaves
    ``[exp(-64), exp(64)]``. A scalar bool; False where ``g`` holds a NaN (the levels then
    carry it, as they always did)."""
    return window_max <= np.float32(MERGED_EXPONENT)


def by_decay_bound(bound: jax.Array, blocks: tuple[int, ...], step: Callable[[int], None]) -> None:
    """Runs ``step(block)`` for the first of ``blocks`` (largest first) whose levels the grid
    step's log decays let merge (:func:`mergeable`, by ``bound`` [nc, C, K], the heads' largest
    ``|g|`` of each chunk, row and channel or a bound on it: :func:`window_maxima`), else
    ``step(1)`` (the levels).

    Each is a whole copy of the step under its own ``pl.when``, exactly one of which runs: a
    branch around the scores alone would cut the step's schedule in three regions that cannot
    overlap (static estimate, forward kernel at B = 1, T = 1024, H = 6, v5e: 61,525 cycles with
    the merged branch, against 54,165 for the levels alone and 46,638 with whole copies)."""
    maxima = window_maxima(bound, tuple(block // 2 for block in blocks))
    taken = None  # a larger block's condition, which implies every smaller one's
    for block in (*blocks, 1):
        here = jnp.bool_(True) if block == 1 else mergeable(maxima[block // 2])
        if taken is not None:
            here = jnp.logical_and(here, jnp.logical_not(taken))
        pl.when(here)(lambda block=block: step(block))
        taken = here if taken is None else jnp.logical_or(taken, here)


@dataclasses.dataclass(frozen=True)
class ChunkLocal:
    """Phase A quantities of a batch of units (F1-F3); float32 [U, C, *] unless noted."""

    gamma_cum: jax.Array  # Γ, inclusive chunk-local cumsum of g [U, C, K]
    e_gamma: jax.Array  # exp(Γ) [U, C, K]
    e_tail: jax.Array  # exp(Γ_C - Γ) [U, C, K]
    decay_C: jax.Array  # γ_C = exp(Γ_C) [U, 1, K]
    E: jax.Array  # b ⊙ k [U, C, K]
    Z: jax.Array  # w ⊙ v [U, C, V]
    E_bar: jax.Array  # exp(Γ) ⊙ E [U, C, K]
    Q_tilde: jax.Array  # exp(Γ) ⊙ q [U, C, K]
    K_tilde: jax.Array  # exp(Γ_C - Γ) ⊙ k [U, C, K]
    levels: Decay

    @property
    def decay_C_col(self) -> jax.Array:
        """γ_C as a column [U, K, 1], to scale the rows of a state."""
        return jnp.swapaxes(self.decay_C, 1, 2)

    def rederived(self, q, k, v, w, b) -> ChunkLocal:
        """These quantities with ``E, Z, Ē, Q̃, K̃`` formed again from ``q, k, v, w, b`` (the same
        values, loaded again): the backward's pass 2 uses them, so that no ``[U, C, d]`` float32
        product is held (spilled from registers to VMEM) from phase A until then."""
        return dataclasses.replace(self, **_scaled_inputs(q, k, v, w, b, self.e_gamma, self.e_tail))


def clamp_log_decay(g: jax.Array) -> jax.Array:
    """``max(g, G_FLOOR)``: -inf (forget entirely) becomes an exactly-zero decay (NaN stays NaN)."""
    return jnp.maximum(g, G_FLOOR)


def chunk_local(
    q,
    k,
    v,
    w,
    b,
    g,
    seg: Segments | None = None,
    block: int = 1,
    scalar_decay: bool = False,
    gamma_on_mxu: bool = False,
) -> ChunkLocal:
    """F1-F3 and the decay levels for [U, C, d] float32 inputs (``g`` already clamped); ``block``:
    the rows whose levels merge (a bounded gate, :func:`decay_levels`); ``scalar_decay``: ``g``
    is the same on every channel, and the pairs take one :class:`PairDecay` instead;
    ``gamma_on_mxu``: Γ by :func:`row_sums_on_mxu` (exact for ``g`` of bfloat16 numbers; no
    ``seg``): the bfloat16 backward takes it, the forward kernels keep the rolls (on the MXU their
    step took 1.3% more cycles, docs/algorithm.md section 10).

    With ``seg`` (packed sequences): Γ restarts at every sequence start; exp(Γ) (the decay from
    the chunk's entry state) is 0 on rows after a start in the chunk, exp(Γ_C - Γ) (to the
    chunk's end state) is 0 on rows before its last start, and γ_C is 0 when the chunk contains
    a start. All by exponents masked to the finite :data:`MASKED` (``exp(MASKED) = 0``; never
    ``exp(-inf)``), so no value of another sequence ever enters."""
    C = k.shape[1]
    if gamma_on_mxu:
        gamma_cum = row_sums_on_mxu([(g, "inclusive")], parts=1)  # [U, C, K] F1
    else:
        gamma_cum = cumsum_rows(g, seg=seg)  # [U, C, K] F1
    gamma_last = gamma_cum[:, C - 1 : C, :]  # [U, 1, K] Γ_C
    to_entry, to_end, whole = gamma_cum, gamma_last - gamma_cum, gamma_last
    if seg is not None:
        to_entry = jnp.where(seg.count == 0, to_entry, MASKED)  # [U, C, K]
        to_end = jnp.where(seg.count == seg.last, to_end, MASKED)  # [U, C, K]
        whole = jnp.where(seg.last == 0, whole, MASKED)  # [U, 1, K]
    e_gamma = jnp.exp(to_entry)  # [U, C, K] <= 1
    e_tail = jnp.exp(to_end)  # [U, C, K] <= 1
    return ChunkLocal(
        gamma_cum=gamma_cum,
        e_gamma=e_gamma,
        e_tail=e_tail,
        decay_C=jnp.exp(whole),
        levels=pair_decay(gamma_cum, seg)
        if scalar_decay
        else decay_levels(gamma_cum, g, seg, block),
        **_scaled_inputs(q, k, v, w, b, e_gamma, e_tail),
    )


def _scaled_inputs(q, k, v, w, b, e_gamma, e_tail) -> dict[str, jax.Array]:
    """F2, F3: the products of the inputs with each other and with the decays."""
    E = b * k  # [U, C, K] F2
    return dict(
        E=E,
        Z=w * v,  # [U, C, V]
        E_bar=e_gamma * E,  # [U, C, K] F3
        Q_tilde=e_gamma * q,  # [U, C, K]
        K_tilde=e_tail * k,  # [U, C, K]
    )


def scores(
    E: jax.Array, q: jax.Array, k: jax.Array, levels: Decay, precision: MatmulPrecision
) -> tuple[jax.Array, jax.Array]:
    """F4: ``A_kk`` [U, C, C] (strictly lower) and ``A_qk`` [U, C, C] (lower, diagonal included),
    one stacked product per level (one in all for a :class:`PairDecay`)."""
    U, C, _ = k.shape
    eye = iota((C, C), 0) == iota((C, C), 1)

    def with_self_pairs(A_qk):  # [U, C, C] with its diagonal q_r . k_r (factor 1)
        return jnp.where(eye, jnp.sum(q * k, axis=2, keepdims=True), A_qk)

    if isinstance(levels, PairDecay):
        pairs = mm_nt(jnp.concatenate([E, q], axis=1), k, precision)  # [U, 2C, C]
        return pairs[:, :C] * levels.D, with_self_pairs(pairs[:, C:] * levels.D)
    A_kk = jnp.zeros((U, C, C), F32)
    A_qk = jnp.zeros((U, C, C), F32)
    # Merged levels (the first level, rows' factors on every row): their product also holds the
    # self pairs (r, r), factor exp(Γ_r - Γ_p) exp(Γ_p - Γ_r) = 1, so A_qk's diagonal comes from
    # it rather than from a lane reduction of q ⊙ k.
    diag_in_product = levels[0].lower is None
    for lv in levels:
        h = lv.tile_rows
        if h:  # only the lower-half rows take part: push those alone
            F = lower_rows(lv.F, h)  # [U, C/2, K]
            X = jnp.concatenate([lower_rows(E, h) * F, lower_rows(q, h) * F], axis=1)  # [U, C, K]
            pairs = mm_nt(X, k * lv.col_factor, precision)  # [U, C, C]
            here = lower_level_pairs(C, lv.lo)  # [C/2, C]
            A_kk = with_lower_rows(
                A_kk, jnp.where(here, pairs[:, : C // 2], lower_rows(A_kk, h)), h
            )
            A_qk = with_lower_rows(
                A_qk, jnp.where(here, pairs[:, C // 2 :], lower_rows(A_qk, h)), h
            )
            continue
        row_f = lv.row_factor  # [U, C, K]
        X = jnp.concatenate([E * row_f, q * row_f], axis=1)  # [U, 2C, K]
        pairs = mm_nt(X, k * lv.col_factor, precision)  # [U, 2C, C]
        here = lv.pairs(C)  # [C, C]
        A_kk = jnp.where(here, pairs[:, :C], A_kk)
        here_qk = here | eye if lv.lower is None else here  # [C, C]
        A_qk = jnp.where(here_qk, pairs[:, C:], A_qk)
    return A_kk, A_qk if diag_in_product else with_self_pairs(A_qk)


def wy_inverse(A_kk: jax.Array, wy_eps: float, precision: MatmulPrecision) -> jax.Array:
    """F5: ``T = ((1 + wy_eps) I + A_kk)^-1`` [U, C, C] by levels (module docstring).

    Level 0 needs no product (``T_0 = I / (1 + wy_eps)``, so ``T_0 A_0 T_0 = A_0 / (1 + wy_eps)^2``).
    The correction ``T_l A_l T_l`` of a level lives on its lower-half rows only (``A_l``'s rows
    are, and ``T_l`` keeps every row inside its ``2^l``-block), so from ``h = 8`` up, where those
    rows are whole sublane tiles, it is computed as ``(T_l[lower] A_l) T_l``: products of ``C / 2``
    rows, half the MXU pushes of ``C``-row ones."""
    C = A_kk.shape[-1]
    d = 1.0 / (1.0 + wy_eps)
    eye = (iota((C, C), 0) == iota((C, C), 1)).astype(F32)  # [C, C]
    A_0 = jnp.where(level_pairs(C, 0), A_kk, ZERO)  # [U, C, C]
    T = d * eye - (d * d) * A_0  # [U, C, C] T_1: blocks of 2 rows
    for level in range(1, n_levels(C)):
        h = 1 << level
        A_l = jnp.where(level_pairs(C, level), A_kk, ZERO)  # [U, C, C]
        if halves_are_tiles(h):
            T_lo = lower_rows(T, h)  # [U, C/2, C]
            corr = mm(mm(T_lo, A_l, precision), T, precision)  # [U, C/2, C]
            T = with_lower_rows(T, T_lo - corr, h)
        else:
            T = T - mm(T, mm(A_l, T, precision), precision)
    return T


@dataclasses.dataclass(frozen=True)
class ScoreGrads:
    """B7 without the exact self-pair terms (the diagonal of ``A_qk``, factor exp(0)), which carry
    no gradient to Γ; adding and then cancelling them in dΓ would only leave rounding behind."""

    dQ_s: jax.Array  # rho(P_qk, k) [U, C, K]
    dE_s: jax.Array  # rho(P_kk, k) [U, C, K]
    dK_s: jax.Array  # kappa(P_qk, q) + kappa(P_kk, E) [U, C, K]
    diag_qk: jax.Array  # diagonal of P_qk [U, C, 1]: adds diag_qk * k to dq, diag_qk * q to dk


def score_backward(
    P_qk: jax.Array,
    P_kk: jax.Array,
    q: jax.Array,
    k: jax.Array,
    E: jax.Array,
    levels: Decay,
    precision: MatmulPrecision,
) -> ScoreGrads:
    """B7 by levels: ``rho(P, Y)_r = sum_(s<r) P_rs Y_s exp(Γ_r - Γ_s)`` and
    ``kappa(P, X)_s = sum_(r>s) P_rs X_r exp(Γ_r - Γ_s)``, two stacked products per level (two
    in all for a :class:`PairDecay`: ``P ⊙ D`` times the undecayed operands)."""
    U, C, K = k.shape
    eye = iota((C, C), 0) == iota((C, C), 1)
    diag_qk = jnp.sum(jnp.where(eye, P_qk, ZERO), axis=2, keepdims=True)  # [U, C, 1]
    if isinstance(levels, PairDecay):
        P = jnp.concatenate([P_qk * levels.D, P_kk * levels.D], axis=1)  # [U, 2C, C]
        rho = mm(P, k, precision)  # [U, 2C, K]
        dK_s = mm_tn(P, jnp.concatenate([q, E], axis=1), precision)  # [U, C, K]
        return ScoreGrads(rho[:, :C], rho[:, C:], dK_s, diag_qk)
    dQ_s = jnp.zeros((U, C, K), F32)
    dE_s = jnp.zeros((U, C, K), F32)
    dK_s = jnp.zeros((U, C, K), F32)
    for lv in levels:
        h = lv.tile_rows
        if h:  # only the lower-half rows r take part: push those alone
            here = lower_level_pairs(C, lv.lo)  # [C/2, C]
            P = jnp.concatenate(
                [
                    jnp.where(here, lower_rows(P_qk, h), ZERO),
                    jnp.where(here, lower_rows(P_kk, h), ZERO),
                ],
                axis=1,
            )  # [U, C, C]
            F, col_f = lower_rows(lv.F, h), lv.col_factor  # [U, C/2, K], [U, C, K]
            rho = mm(P, k * col_f, precision)  # [U, C, K]
            dQ_s = with_lower_rows(dQ_s, lower_rows(dQ_s, h) + F * rho[:, : C // 2], h)
            dE_s = with_lower_rows(dE_s, lower_rows(dE_s, h) + F * rho[:, C // 2 :], h)
            X = jnp.concatenate([lower_rows(q, h) * F, lower_rows(E, h) * F], axis=1)  # [U, C, K]
            dK_s = dK_s + col_f * mm_tn(P, X, precision)  # [U, C, K]
            continue
        here = lv.pairs(C)  # [C, C]
        P = jnp.concatenate([jnp.where(here, P_qk, ZERO), jnp.where(here, P_kk, ZERO)], axis=1)
        row_f, col_f = lv.row_factor, lv.col_factor  # [U, C, K]
        rho = mm(P, k * col_f, precision)  # [U, 2C, K]
        dQ_s = dQ_s + row_f * rho[:, :C]
        dE_s = dE_s + row_f * rho[:, C:]
        X = jnp.concatenate([q * row_f, E * row_f], axis=1)  # [U, 2C, K]
        dK_s = dK_s + col_f * mm_tn(P, X, precision)  # [U, C, K]
    return ScoreGrads(dQ_s, dE_s, dK_s, diag_qk)
