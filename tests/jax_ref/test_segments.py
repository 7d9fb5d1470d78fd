"""jax_ref with packed sequences by segment ids (gdn2_jax_ref.segments): against a token-serial
recurrence with resets, finite differences, and bit-for-bit independence of the sequences.

Errors are ``rel = max|actual - expected| / max|expected|`` (gdn2_conformance.rel_err).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_conformance import Case, check_central_differences, make_inputs, rel_err
from gdn2_jax_ref import chunk, scores
from gdn2_jax_ref.config import JaxRefConfig
from gdn2_jax_ref.params import ChunkParams
from gdn2_jax_ref.segments import RowSegments, segment_numbers
from gdn2_jax_ref.vjp import gdn2_chunk_trainable
from tests.jax_ref.reset_reference import serial_with_resets, starts_of

NAMES = ("q", "k", "v", "w", "b", "g", "h0")
# float64 against float64: the same operator summed in another order (docs/algorithm.md 8
# measures <= 2.5e-14); a state leaking across a start, or a missing one, is an O(0.1) error.
TOL_F64 = 1e-10


def ids_from_starts(T: int, starts, first_id: int = 0) -> np.ndarray:
    """One row of segment ids with a new sequence at each position of ``starts``; the ids
    alternate between two values, so equal ids recur in non-adjacent sequences (a start is where
    the id changes, not where a new id appears)."""
    row = np.zeros(T, np.int64)
    row[list(starts)] = 1
    return (np.cumsum(row) % 2 + first_id).astype(np.int32)


def params_of(case: Case, bt: int, bc: int, wy_block: int, acc: str) -> ChunkParams:
    return ChunkParams(
        scale=case.dk**-0.5, bt=bt, bc=bc, wy_block=wy_block, wy_eps=0.0, clip=60.0, acc=acc
    )


@functools.cache
def value_and_grads(kind: str, params: ChunkParams):
    """jit(grad) of loss = sum(o * do) + sum(h_final * dh): jax_ref ("jax_ref") or the
    token-serial recurrence with resets ("serial"). Returns ``(grads of q..h0, (o, h_final))``."""

    def loss(args, ids, do, dh):
        if kind == "jax_ref":
            o, h = gdn2_chunk_trainable(*args, params, ids)
        else:
            o, h = serial_with_resets(*args, params.scale, ids)
        return jnp.sum(o * do) + jnp.sum(h * dh), (o, h)

    return jax.jit(jax.grad(loss, has_aux=True))


def run(kind, params, inp, ids):
    return value_and_grads(kind, params)((*inp.args, inp.h0), jnp.asarray(ids), inp.do, inp.dh)


# Row layouts (T = 37): starts inside chunks, at a chunk's first and last row, length-1
# sequences, several sequences in one chunk, the last token a start, every token a start, no start.
LAYOUTS = {
    "inside-and-length-1": ([5, 6, 8, 16, 30], [1, 2, 3, 11, 12, 13, 14, 25]),
    "chunk-edges": ([7, 8, 15, 23, 24, 36], [16, 31, 32]),
    "every-token": (range(1, 37), [18]),
    "none": ([], [36]),
}
# (bt, bc, wy_block): one level of sub-chunks (pairwise diagonal); the recursive diagonal (bc = 8 >
# leaf) with off-diagonal reference rows.
BLOCKINGS = [(8, 4, 2), (16, 8, 4)]


@pytest.mark.parametrize(
    ("layout", "blocking"),
    [*((name, BLOCKINGS[0]) for name in LAYOUTS), ("inside-and-length-1", BLOCKINGS[1])],
    ids=lambda x: f"bt{x[0]}" if isinstance(x, tuple) else x,
)
def test_matches_serial_with_resets_f64(x64, layout, blocking):
    case = Case(B=2, T=37, H=2, dk=8, dv=12, b_max=2.0, decay="strong", seed=1)
    inp = make_inputs(case, jnp.float64)
    ids = np.stack([ids_from_starts(37, s, first_id=7 * r) for r, s in enumerate(LAYOUTS[layout])])
    params = params_of(case, *blocking, "float64")
    g_ours, (o, h) = run("jax_ref", params, inp, ids)
    g_ref, (o_ref, h_ref) = run("serial", params, inp, ids)
    assert rel_err(o, o_ref) < TOL_F64
    assert rel_err(h, h_ref) < TOL_F64
    for name, a, e in zip(NAMES, g_ours, g_ref, strict=True):
        assert rel_err(a, e) < TOL_F64, (name, rel_err(a, e))
    # A start's g decays a zero state: its gradient is exactly 0, as the recurrence's is.
    starts = np.asarray(starts_of(ids))
    assert not np.any(np.asarray(g_ref[5])[starts]) and not np.any(np.asarray(g_ours[5])[starts])


def test_several_groups_and_forgotten_channels_f64(x64, monkeypatch):
    """Small GROUP_BYTES: several groups of chunks (a sequence crossing group boundaries, one
    starting at a group's first row); g = -inf (forget a channel) at starts and elsewhere."""
    monkeypatch.setattr(chunk, "GROUP_BYTES", 2048)
    case = Case(B=2, T=70, H=2, dk=8, dv=8, decay="strong", seed=3)
    inp = make_inputs(case, jnp.float64)
    g = inp.g.at[0, 16, :, :3].set(-jnp.inf).at[1, 40:43].set(-jnp.inf).at[0, 50].set(-1e4)
    inp = type(inp)(**{**inp.__dict__, "g": g})
    ids = np.stack([ids_from_starts(70, [16, 17, 33, 50]), ids_from_starts(70, [32, 41, 69])])
    params = params_of(case, 8, 4, 2, "float64")
    blk = chunk.Blocking.plan(70, 8, 2 * 2 * 8 * 8)
    assert blk.n_groups > 2  # the case exercises the group boundaries
    g_ours, (o, h) = run("jax_ref", params, inp, ids)
    g_ref, (o_ref, h_ref) = run("serial", params, inp, ids)
    assert rel_err(o, o_ref) < TOL_F64 and rel_err(h, h_ref) < TOL_F64
    for name, a, e in zip(NAMES, g_ours, g_ref, strict=True):
        assert bool(jnp.all(jnp.isfinite(a))), name
        assert rel_err(a, e) < TOL_F64, (name, rel_err(a, e))


def test_float32_default_config(x64):
    """float32 inputs, the default JaxRefConfig (C = 64), several sequences per chunk and
    sequences spanning chunks, against the float64 recurrence."""
    case = Case(B=2, T=200, H=2, dk=32, dv=16, b_max=2.0, decay="strong", seed=4)
    inp = make_inputs(case, jnp.float32)
    ids = np.stack([ids_from_starts(200, [3, 50, 51, 64, 70, 130]), ids_from_starts(200, [127])])
    cfg = JaxRefConfig()
    params = params_of(case, cfg.bt, cfg.bc, cfg.wy_block, "float32")
    g32, (o, h) = run("jax_ref", params, inp, ids)
    inp64 = make_inputs(case, jnp.float64)
    g_ref, (o_ref, h_ref) = run("serial", params_of(case, 64, 32, 16, "float64"), inp64, ids)
    # The conformance suite's float32 tolerances (docs/algorithm.md 5.4 measures 2e-6 to 1e-5
    # for the chunked algorithm; strong decay and b up to 2 amplify it a few-fold).
    assert rel_err(o, o_ref) < 1e-4 and rel_err(h, h_ref) < 1e-4
    for name, a, e in zip(NAMES, g32, g_ref, strict=True):
        assert rel_err(a, e) < 3e-4, (name, rel_err(a, e))


def test_central_differences_f64(x64):
    """The hand-derived backward with segments against float64 central differences of jax_ref's
    own forward, along one random direction per argument."""
    case = Case(B=1, T=29, H=1, dk=6, dv=5, b_max=2.0, seed=6)
    inp = make_inputs(case, jnp.float64)
    ids = jnp.asarray(ids_from_starts(29, [4, 5, 13, 21])[None])
    params = params_of(case, 8, 4, 2, "float64")
    args = (*inp.args, inp.h0)

    @jax.jit
    def loss(*a):
        o, h = gdn2_chunk_trainable(*a, params, ids)
        return jnp.sum(o * inp.do) + jnp.sum(h * inp.dh)

    # Central differences: truncation O(eps^2) ~ 1e-10 and rounding ~ 1e-16 / eps = 1e-11
    # relative; a missing or leaked term is O(1e-2) or larger.
    check_central_differences(loss, args, seed=0, eps=1e-5, names=NAMES, rtol=1e-7)


# Row 0 of the leakage test: sequences [0, 50), [50, 51), [51, 130), [130, 200) - the third
# crosses the chunk boundaries at 64 and 128 (C = 64) and shares chunks with its neighbours.
LEAK_SEQS = [(0, 50), (50, 51), (51, 130), (130, 200)]
SMALL = JaxRefConfig(bt=16, bc=8, wy_block=4)


@pytest.mark.parametrize(
    ("victim", "config"),
    [*((victim, SMALL) for victim in (0, 2, 3)), (2, JaxRefConfig())],
    ids=lambda x: f"bt{x.bt}" if isinstance(x, JaxRefConfig) else f"seq{x}",
)
def test_no_leakage_bit_for_bit(config, victim):
    """Perturbing every input of one sequence changes no result of any other sequence, not by an
    ulp: outputs, h_final and dh0 where they belong to other sequences, and all gradients at the
    other sequences' tokens (float32, the default and a small config)."""
    case = Case(B=2, T=200, H=2, dk=16, dv=24, b_max=2.0, decay="strong", seed=8)
    inp = make_inputs(case, jnp.float32)
    ids = np.stack([ids_from_starts(200, [50, 51, 130]), ids_from_starts(200, [17, 100])])
    lo, hi = LEAK_SEQS[victim]
    other = make_inputs(Case(**{**case.__dict__, "seed": 9}), jnp.float32)
    changed = type(inp)(
        **{
            **inp.__dict__,
            **{n: getattr(inp, n).at[0, lo:hi].set(getattr(other, n)[0, lo:hi]) for n in NAMES[:6]},
        }
    )
    params = params_of(case, config.bt, config.bc, config.wy_block, "float32")
    g_a, (o_a, h_a) = run("jax_ref", params, inp, ids)
    g_b, (o_b, h_b) = run("jax_ref", params, changed, ids)
    keep = np.ones((2, 200), bool)
    keep[0, lo:hi] = False

    def same(x, y):
        return np.array_equal(np.asarray(x), np.asarray(y))

    assert not same(o_a[0, lo:hi], o_b[0, lo:hi])  # the perturbation reaches its own sequence
    assert same(o_a[keep], o_b[keep])
    assert same(h_a[1], h_b[1]) and same(g_a[6][1], g_b[6][1])  # row 1 untouched entirely
    assert same(h_a[0], h_b[0]) == (victim != 3)  # h_final leaves the last sequence
    assert same(g_a[6][0], g_b[6][0]) == (victim != 0)  # h0 enters the first sequence
    for name, a, b in zip(NAMES[:6], g_a[:6], g_b[:6], strict=True):
        assert same(a[keep], b[keep]), name


def test_segment_numbers_and_chunk_entries():
    ids = jnp.asarray([[4, 4, 9, 9, 4, 1, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2, 2, 2, 3, 3]])
    np.testing.assert_array_equal(
        np.asarray(segment_numbers(ids)),
        [[0, 0, 1, 1, 2, 3, 3, 3, 3, 3], [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]],
    )
    blk = chunk.Blocking(seq_len=10, bt=4, group=3, n_groups=1)
    rows = RowSegments.build(ids, blk)
    # Padding continues the last sequence; each chunk is entered by the segment of the row before.
    np.testing.assert_array_equal(np.asarray(rows.seg[:, 10:]), [[3, 3], [1, 1]])
    np.testing.assert_array_equal(np.asarray(rows.entry), [[0, 1, 3], [0, 0, 0]])
    masks = rows.load_group(0, blk)
    assert masks.seg.shape == (3, 2, 1, 4, 1)
    np.testing.assert_array_equal(
        np.asarray(masks.is_start[:, 0, 0, :, 0]),
        [[False, False, True, False], [True, True, False, False], [False, False, False, False]],
    )
    np.testing.assert_array_equal(np.asarray(masks.no_start[:, :, 0, 0]), [[0, 1], [0, 1], [1, 0]])


def direct_masked(G, seg, strict):
    """exp(G_r - G_s) over the whole chunk, 0 for s > r (s >= r) or r, s in different segments."""
    C = G.shape[-2]
    keep = np.tril(np.ones((C, C), bool), -1 if strict else 0) & (seg[:, None] == seg[None, :])
    return jnp.exp(jnp.where(keep[:, :, None], G[..., :, None, :] - G[..., None, :, :], -jnp.inf))


@pytest.mark.parametrize(("C", "c", "leaf"), [(16, 8, 8), (16, 8, 2), (16, 4, 4), (24, 12, 3)])
def test_masked_scores_match_direct_einsum(x64, C, c, leaf):
    """Score, rho and kappa with segments: every block shape (pairwise leaves, recursive halves,
    off-diagonal reference rows) against the direct masked pairwise form."""
    rng = np.random.default_rng(C + c + leaf)
    seg = np.cumsum(rng.random(C) < 0.3)  # [C] segment numbers, starts anywhere
    seg[c] = seg[c - 1] + 1  # a start on a block edge too
    seg[c:] = np.maximum(seg[c:], seg[c])
    X, Y = (jnp.asarray(rng.standard_normal((2, C, 8))) for _ in range(2))
    P = jnp.asarray(np.tril(rng.standard_normal((2, C, C))))
    g = -rng.random((2, C, 8))  # [2, C, K]
    G = np.zeros_like(g)  # segment-local cumsum, a start's own g left out
    for r in range(C):
        start = r > 0 and seg[r] != seg[r - 1]
        G[:, r] = 0.0 if start else g[:, r] + (G[:, r - 1] if r > 0 else 0.0)
    G = jnp.asarray(G)
    sb = jnp.asarray(seg.astype(np.int32))[:, None]  # [C, 1]
    D_strict, D_incl = direct_masked(G, seg, True), direct_masked(G, seg, False)
    want = (
        jnp.einsum("...rk,...sk,...rsk->...rs", X, Y, D_strict),
        jnp.einsum("...rk,...sk,...rsk->...rs", X, Y, D_incl),
        jnp.einsum("...rs,...sk,...rsk->...rk", P, Y, D_incl),
        jnp.einsum("...rs,...rk,...rsk->...sk", P, X, D_incl),
    )
    got = (
        scores.score(X, Y, G, c, 60.0, True, leaf, seg=sb),
        scores.score(X, Y, G, c, 60.0, False, leaf, seg=sb),
        scores.score_rho(P, Y, G, c, 60.0, leaf, seg=sb),
        scores.score_kappa(P, X, G, c, 60.0, leaf, seg=sb),
    )
    for name, a, e in zip(("strict", "inclusive", "rho", "kappa"), got, want, strict=True):
        # float64 with O(1) terms: rounding only (~1e-15); a factor leaking across a start is O(1).
        assert float(jnp.max(jnp.abs(a - e))) < 1e-12, name
