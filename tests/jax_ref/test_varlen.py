"""jax_ref with packed sequences by cu_seqlens (gdn2_jax_ref.varlen): the re-laid row, against
each sequence run on its own by the token-serial recurrence, finite differences, and bit-for-bit
independence of the sequences.

Errors are ``rel = max|actual - expected| / max|expected|`` (gdn2_conformance.rel_err).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_conformance import Case, check_central_differences, make_inputs, rel_err
from gdn2_jax_ref import chunk
from gdn2_jax_ref.config import JaxRefConfig
from gdn2_jax_ref.params import ChunkParams
from gdn2_jax_ref.varlen import VarlenLayout, VarlenRows, varlen_length
from gdn2_jax_ref.vjp import gdn2_chunk_trainable
from tests.jax_ref.reset_reference import serial_varlen

NAMES = ("q", "k", "v", "w", "b", "g", "h0")
# float64 against float64: rounding only (docs/algorithm.md 8 measures <= 2.5e-14); a state
# carried into the wrong sequence is an O(0.1) error.
TOL_F64 = 1e-10


def params_of(case: Case, bt: int, bc: int, wy_block: int, acc: str) -> ChunkParams:
    return ChunkParams(
        scale=case.dk**-0.5, bt=bt, bc=bc, wy_block=wy_block, wy_eps=0.0, clip=60.0, acc=acc
    )


def per_seq(case: Case, n_seqs: int, seed: int, dtype):
    """h0 and dh_final per sequence, ``(N, H, dk, dv)``."""
    rng = np.random.default_rng(seed)
    shape = (n_seqs, case.H, case.dk, case.dv)
    return tuple(jnp.asarray(0.5 * rng.standard_normal(shape), dtype) for _ in range(2))


@functools.cache
def value_and_grads(kind: str, params: ChunkParams, cu_key: tuple[int, ...] | None):
    """jit(grad) of loss = sum(o * do) + sum(h_final * dh); ``kind`` "jax_ref" takes cu_seqlens
    as a traced argument, "serial" is specialised to ``cu_key``."""

    def loss(args, cu, do, dh):
        if kind == "jax_ref":
            o, h = gdn2_chunk_trainable(*args, params, None, cu)
        else:
            o, h = serial_varlen(*args, params.scale, cu_key)
        return jnp.sum(o * do) + jnp.sum(h * dh), (o, h)

    return jax.jit(jax.grad(loss, has_aux=True))


def run(kind, params, inp, h0, dh, cu):
    key = tuple(int(c) for c in cu) if kind == "serial" else None
    cu = jnp.asarray(cu, jnp.int32)
    return value_and_grads(kind, params, key)((*inp.args, h0), cu, inp.do, dh)


# T = 37: empty sequences (first, middle, last), length-1 ones, one spanning several chunks, one
# sequence only.
CU = {
    "mixed": [0, 3, 3, 4, 20, 21, 37],
    "empty-ends": [0, 0, 8, 16, 37, 37],
    "one": [0, 37],
    "short": [0, 1, 2, 3, 5, 8, 13, 21, 34, 37],
}


@pytest.mark.parametrize(
    ("cu_name", "blocking"),
    [*((name, (8, 4, 2)) for name in CU), ("mixed", (16, 8, 4))],
    ids=lambda x: f"bt{x[0]}" if isinstance(x, tuple) else x,
)
def test_matches_serial_per_sequence_f64(x64, cu_name, blocking):
    case = Case(B=1, T=37, H=2, dk=8, dv=12, b_max=2.0, decay="strong", seed=1)
    inp = make_inputs(case, jnp.float64)
    cu = CU[cu_name]
    h0, dh = per_seq(case, len(cu) - 1, 2, jnp.float64)
    params = params_of(case, *blocking, "float64")
    g_ours, (o, h) = run("jax_ref", params, inp, h0, dh, cu)
    g_ref, (o_ref, h_ref) = run("serial", params, inp, h0, dh, cu)
    assert o.shape == o_ref.shape and h.shape == h0.shape
    assert rel_err(o, o_ref) < TOL_F64 and rel_err(h, h_ref) < TOL_F64
    for name, a, e in zip(NAMES, g_ours, g_ref, strict=True):
        assert a.shape == e.shape, name
        assert rel_err(a, e) < TOL_F64, (name, rel_err(a, e))


def test_several_groups_f64(x64, monkeypatch):
    """Small GROUP_BYTES: sequences crossing group boundaries, the dh0 of a sequence recorded in
    another group than its dh_final enters."""
    monkeypatch.setattr(chunk, "GROUP_BYTES", 1024)
    case = Case(B=1, T=70, H=2, dk=8, dv=8, decay="strong", seed=3)
    inp = make_inputs(case, jnp.float64)
    cu = [0, 17, 18, 50, 50, 70]
    h0, dh = per_seq(case, 5, 4, jnp.float64)
    params = params_of(case, 8, 4, 2, "float64")
    g_ours, (o, h) = run("jax_ref", params, inp, h0, dh, cu)
    g_ref, (o_ref, h_ref) = run("serial", params, inp, h0, dh, cu)
    assert rel_err(o, o_ref) < TOL_F64 and rel_err(h, h_ref) < TOL_F64
    for name, a, e in zip(NAMES, g_ours, g_ref, strict=True):
        assert rel_err(a, e) < TOL_F64, (name, rel_err(a, e))


def test_float32_default_config(x64):
    case = Case(B=1, T=200, H=2, dk=32, dv=16, b_max=2.0, decay="strong", seed=4)
    cu = [0, 3, 50, 51, 130, 200]
    inp = make_inputs(case, jnp.float32)
    h0, dh = per_seq(case, 5, 5, jnp.float32)
    cfg = JaxRefConfig()
    g32, (o, h) = run(
        "jax_ref", params_of(case, cfg.bt, cfg.bc, cfg.wy_block, "float32"), inp, h0, dh, cu
    )
    inp64 = make_inputs(case, jnp.float64)
    h64, dh64 = (x.astype(jnp.float64) for x in (h0, dh))
    g_ref, (o_ref, h_ref) = run(
        "serial", params_of(case, 64, 32, 16, "float64"), inp64, h64, dh64, cu
    )
    # The conformance suite's float32 tolerances (docs/algorithm.md 5.4 measures 2e-6 to 1e-5
    # for the chunked algorithm; strong decay and b up to 2 amplify it a few-fold).
    assert rel_err(o, o_ref) < 1e-4 and rel_err(h, h_ref) < 1e-4
    for name, a, e in zip(NAMES, g32, g_ref, strict=True):
        assert rel_err(a, e) < 3e-4, (name, rel_err(a, e))


def test_central_differences_f64(x64):
    """The backward through the re-layout against float64 central differences of jax_ref's own
    forward, along one random direction per argument (h0 per sequence included)."""
    case = Case(B=1, T=29, H=1, dk=6, dv=5, b_max=2.0, seed=6)
    inp = make_inputs(case, jnp.float64)
    cu = jnp.asarray([0, 4, 5, 5, 21, 29], jnp.int32)
    h0, dh = per_seq(case, 5, 7, jnp.float64)
    params = params_of(case, 8, 4, 2, "float64")
    args = (*inp.args, h0)

    @jax.jit
    def loss(*a):
        o, h = gdn2_chunk_trainable(*a, params, None, cu)
        return jnp.sum(o * inp.do) + jnp.sum(h * dh)

    # Central differences: truncation O(eps^2) ~ 1e-10 and rounding ~ 1e-16 / eps = 1e-11
    # relative; a missing or misrouted term is O(1e-2) or larger.
    check_central_differences(loss, args, seed=0, eps=1e-5, names=NAMES, rtol=1e-7)


@pytest.mark.parametrize("victim", [0, 2, 3])
def test_no_leakage_bit_for_bit(victim):
    """Perturbing every input and the h0 of one sequence changes no result of any other sequence,
    not by an ulp: outputs, h_final, dh0 and all gradients at the other sequences' tokens."""
    case = Case(B=1, T=200, H=2, dk=16, dv=24, b_max=2.0, decay="strong", seed=8)
    cu = [0, 50, 51, 130, 200]
    inp = make_inputs(case, jnp.float32)
    h0, dh = per_seq(case, 4, 9, jnp.float32)
    lo, hi = cu[victim], cu[victim + 1]
    other = make_inputs(Case(**{**case.__dict__, "seed": 10}), jnp.float32)
    changed = type(inp)(
        **{
            **inp.__dict__,
            **{n: getattr(inp, n).at[0, lo:hi].set(getattr(other, n)[0, lo:hi]) for n in NAMES[:6]},
        }
    )
    h0_b = h0.at[victim].set(2.0 * h0[victim] + 0.1)
    cfg = JaxRefConfig()
    params = params_of(case, cfg.bt, cfg.bc, cfg.wy_block, "float32")
    g_a, (o_a, h_a) = run("jax_ref", params, inp, h0, dh, cu)
    g_b, (o_b, h_b) = run("jax_ref", params, changed, h0_b, dh, cu)
    keep = np.ones(200, bool)
    keep[lo:hi] = False
    seqs = np.arange(4) != victim

    def same(x, y):
        return np.array_equal(np.asarray(x), np.asarray(y))

    assert not same(o_a[0, lo:hi], o_b[0, lo:hi]) and not same(h_a[victim], h_b[victim])
    assert same(o_a[0, keep], o_b[0, keep])
    assert same(h_a[seqs], h_b[seqs]) and same(g_a[6][seqs], g_b[6][seqs])
    for name, a, b in zip(NAMES[:6], g_a[:6], g_b[:6], strict=True):
        assert same(a[0, keep], b[0, keep]), name


def test_layout_and_windows():
    """Every sequence starts on a chunk boundary and its chunks read consecutive windows of the
    row, in order; the chunk flags mark each non-empty sequence's first and last chunk; reading a
    group gives zero tokens past each sequence, and writing it back restores the row exactly,
    whatever order the groups are written in."""
    cu, T, C = [0, 0, 5, 6, 6, 23, 23], 23, 4
    length = varlen_length(T, 6, C)
    blk = chunk.Blocking(seq_len=length, bt=C, group=3, n_groups=-(-length // (3 * C)) + 1)
    lay = VarlenLayout.build(jnp.asarray(cu, jnp.int32), T, C, blk.n_chunks)
    src, n_rows = np.asarray(lay.chunk_src), np.asarray(lay.chunk_len)
    seq = np.asarray(lay.chunk_seq)
    first, last = np.asarray(lay.chunk_first), np.asarray(lay.chunk_last)
    used = (5 + 3) // C + 1 + (17 + 3) // C  # chunks of the three non-empty sequences
    assert int(lay.n_used) == used
    tokens = np.concatenate(
        [np.arange(s, s + n) for s, n in zip(src[:used], n_rows[:used], strict=True)]
    )
    np.testing.assert_array_equal(tokens, np.arange(T))  # each token once, in order
    for n in (1, 2, 4):
        mine = np.flatnonzero(seq[:used] == n)
        assert src[mine[0]] == cu[n] and np.all(n_rows[mine[:-1]] == C), n
        assert first[mine].tolist() == [True] + [False] * (len(mine) - 1), n
        assert last[mine].tolist() == [False] * (len(mine) - 1) + [True], n
    assert not np.any(first[used:] | last[used:]) and not np.any(n_rows[used:])
    np.testing.assert_array_equal(np.asarray(lay.empty), [True, False, False, True, False, True])

    io = VarlenRows(lay, blk)
    x = jnp.arange(T * 2, dtype=jnp.float32).reshape(1, T, 1, 2) + 1.0
    xp = io.pad(x)  # [1, T, 1, 2]
    groups = [io.load(xp, i, jnp.float32) for i in range(blk.n_groups)]  # [G, 1, 1, C, 2]
    rows = jnp.concatenate(groups)[:, 0, 0, :, 0]  # [Nc, C]
    assert int(jnp.sum(rows != 0)) == T  # zero tokens past each sequence
    for order in (range(blk.n_groups), reversed(range(blk.n_groups))):
        buf = jnp.zeros_like(xp)
        for i in order:
            buf = io.store(buf, groups[i], i)
        np.testing.assert_array_equal(np.asarray(buf), np.asarray(xp))
