"""Phase A of the chunkwise forward (docs/algorithm.md F1-F6): everything that does not depend on the
chunk-entry state, for all chunks of a group at once. The backward recomputes it from the inputs.

Every decay factor formed here has a non-positive exponent (for g <= 0): exp(gamma_cum),
exp(gamma_C - gamma_cum) and exp(gamma_C); the scores go through :mod:`gdn2_jax_ref.scores`.

g is first raised to a finite floor (:func:`floor_log_decay`), so g = -inf ("forget this channel")
cannot make -inf - (-inf) = NaN in the cumsum or in a decay difference.

With packed sequences (``seg``, :mod:`gdn2_jax_ref.segments`) the cumsum is segment-local (it
restarts after a start and leaves the start's own g out) and every decay factor that would cross
a sequence start is exactly 0 (exponent masked to -inf before the exp).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Final

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn2_jax_ref.params import ChunkParams, einsum
from gdn2_jax_ref.scores import score
from gdn2_jax_ref.segments import SegmentMasks, same_segment
from gdn2_jax_ref.wy import wy_inverse
from gdn2core.diagnostics import probe


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        *("gamma_cum", "e_head", "e_tail", "decay_C", "E", "E_bar", "Q_tilde", "K_tilde"),
        *("A_qk", "T", "Y", "U", "seg"),
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class ChunkLocal:
    """Chunk-local quantities, all in the accumulation dtype; ``...`` = ``N, B, H``."""

    gamma_cum: Float[Array, "... C K"]  # F1 inclusive chunk-local (segment-local) cumsum of g
    e_head: Float[Array, "... C K"]  # exp(gamma_cum), 0 on rows the entry state does not reach
    e_tail: Float[Array, "... C K"]  # exp(gamma_C - gamma_cum), 0 outside the last segment
    decay_C: Float[Array, "... K"]  # exp(gamma_C), the chunk carry (0 if the chunk holds a start)
    E: Float[Array, "... C K"]  # F2 b * k
    E_bar: Float[Array, "... C K"]  # F3 exp(gamma_cum) * E
    Q_tilde: Float[Array, "... C K"]  # F3 exp(gamma_cum) * q
    K_tilde: Float[Array, "... C K"]  # F3 exp(gamma_C - gamma_cum) * k
    A_qk: Float[Array, "... C C"]  # F4 inclusive score (unscaled)
    T: Float[Array, "... C C"]  # F5 ((1 + wy_eps) I + A_kk)^-1
    Y: Float[Array, "... C K"]  # F6 T E_bar
    U: Float[Array, "... C V"]  # F6 T Z
    seg: SegmentMasks | None  # packed sequences, None for one sequence per row


#: Floor on g per accumulation dtype: g below it is raised to it before anything else, so g = -inf
#: never meets -inf in a cumsum (0 * -inf in the triangle-of-ones matmul) or a difference
#: (-inf - -inf). exp(floor) is exactly 0, as exp(g) is in the reference for g = -inf or g below
#: exp's underflow (float32: -87.3 where denormals are flushed, as XLA does on CPU and TPU, -103.97
#: with IEEE denormals; float64: -745.13), and every decay exponent spanning a floored token is
#: <= floor (all g <= 0), so the token forgets its channel exactly as the reference does.
#: Why this value: after a floored token gamma_cum is about floor for the rest of the chunk, and
#: decay differences there carry an absolute error of ~ulp(|gamma_cum|). So the floor sits just
#: past the underflow edge: a floored token then costs what a legal g of the same size does
#: (-128: ulp 1.5e-5, i.e. ~1e-5 relative error on the later decays of that chunk, where an
#: unfloored g = -1e4 gives 1e-3). The margin (-128, not -104) keeps exp at exactly 0 with IEEE
#: denormals too, after the rounding of a difference (a few ulp of |gamma_cum| <= C * 128: < 1
#: for any C below 2^16). float64: -1024, past -745 with room to spare; ulp(1024) = 2.3e-13
#: costs nothing.
LOG_DECAY_FLOOR: Final = {jnp.dtype(jnp.float32): -128.0, jnp.dtype(jnp.float64): -1024.0}


def floor_log_decay(g: Float[Array, "... C K"]) -> Float[Array, "... C K"]:
    """max(g, floor) in g's (accumulation) dtype; NaN stays NaN. The backward gives g < floor
    a zero gradient, which is the reference's: d/dg of exp(g) S is exp(g) S = 0 there."""
    return jnp.maximum(g, LOG_DECAY_FLOOR[g.dtype])


def cumsum_rows(
    x: Float[Array, "... C K"],
    reverse: bool = False,
    exclusive: bool = False,
    seg: SegmentMasks | None = None,
) -> Float[Array, "... C K"]:
    """Inclusive cumsum over the C axis (reverse: from the end; exclusive: row r itself left
    out), as a matmul with a triangle of ones (faster on CPU than XLA's reduce-window cumsum;
    the same number of additions per row). With ``seg`` it is segment-local: the triangle is 0
    between rows of different segments, so each row sums its own segment's rows only."""
    C = x.shape[-2]
    ones = jnp.tril(jnp.ones((C, C), x.dtype), -1 if exclusive else 0)  # [C(r), C(s)]: s <=(<) r
    if reverse:
        ones = ones.T  # s >= r
    if seg is None:
        return einsum("rs,...sk->...rk", ones, x)  # [..., C, K]
    ones = jnp.where(same_segment(seg.seg, seg.seg), ones, 0.0)  # [G, B, 1, C, C]
    return einsum("...rs,...sk->...rk", ones, x)  # [..., C, K]


def masked_exp(x: Float[Array, "*dims"], keep) -> Float[Array, "*dims"]:
    """exp(x), exactly 0 where ``keep`` is False (the exponent is set to -inf first); plain
    exp(x) for ``keep`` None."""
    return jnp.exp(x if keep is None else jnp.where(keep, x, -jnp.inf))


def chunk_local(
    q: Float[Array, "... C K"],
    k: Float[Array, "... C K"],
    v: Float[Array, "... C V"],
    w: Float[Array, "... C V"],
    b: Float[Array, "... C K"],
    g: Float[Array, "... C K"],
    params: ChunkParams,
    seg: SegmentMasks | None = None,
) -> ChunkLocal:
    """F1-F6 for every chunk (inputs already chunked and in the accumulation dtype); ``seg``:
    the segment numbers of packed sequences (None: one sequence)."""
    g = floor_log_decay(g)  # [..., C, K]
    if seg is not None:
        g = jnp.where(seg.is_start, 0.0, g)  # a start's g decays a zero state: left out
    gamma_cum = probe("jax_ref gamma_cum", cumsum_rows(g, seg=seg))  # [..., C, K]
    gamma_C = gamma_cum[..., -1:, :]  # [..., 1, K]
    E = b * k  # [..., C, K]
    Z = w * v  # [..., C, V]
    carry_in, in_last, no_start = (
        (None,) * 3 if seg is None else (seg.carry_in, seg.in_last, seg.no_start)
    )
    e_head = masked_exp(gamma_cum, carry_in)  # [..., C, K] <= 1
    e_tail = masked_exp(gamma_C - gamma_cum, in_last)  # [..., C, K] <= 1
    E_bar = e_head * E  # [..., C, K]
    Q_tilde = e_head * q  # [..., C, K]
    K_tilde = e_tail * k  # [..., C, K]
    decay_C = masked_exp(gamma_C[..., 0, :], no_start)  # [..., K]
    # F4: both scores share K and gamma_cum, so they run as one stacked (inclusive) Score; A_kk
    # then drops its diagonal (masking after the fact is exact: the diagonal terms are finite).
    seg_rows = None if seg is None else seg.seg
    A_both = score(
        jnp.stack([E, q]), k, gamma_cum, params.bc, params.clip, strict=False, seg=seg_rows
    )
    A_kk = probe("jax_ref A_kk", jnp.tril(A_both[0], -1))  # [..., C, C] strictly lower
    A_qk = probe("jax_ref A_qk", A_both[1])  # [..., C, C] lower incl. diagonal
    T = probe("jax_ref T", wy_inverse(A_kk, params.wy_block, params.wy_eps))  # [..., C, C]
    Y = probe("jax_ref Y", einsum("...rs,...sk->...rk", T, E_bar))  # [..., C, K]
    U = probe("jax_ref U", einsum("...rs,...sv->...rv", T, Z))  # [..., C, V]
    return ChunkLocal(
        gamma_cum, e_head, e_tail, decay_C, E, E_bar, Q_tilde, K_tilde, A_qk, T, Y, U, seg
    )
