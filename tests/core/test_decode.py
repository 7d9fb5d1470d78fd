"""gdn2_decode in the core: argument checks that name the argument, the backend choice, the pool
semantics (concrete indices refused, traced ones skipped), decode == the chunked forward over the
same tokens (the issue's tolerances: float32 1e-5, bfloat16 2e-2), chunk states, and the pool
updated in place when donated."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn2core
from gdn2_conformance import DecodeCase, make_decode_inputs, rel_err
from gdn2core import (
    BackendUnsupportedError,
    DecodeSpec,
    KernelConfig,
    gdn2_decode,
    gdn2_decode_reference,
    gdn2_forward,
    which_decode_backend,
)
from gdn2core.ops.decode.spec import PAIRWISE_MAX, expand_heads, sanitize_slots
from tests.support.slots import random_slot_indices

CASE = DecodeCase(N=3, S=2, H=2, HV=4, dk=8, dv=12, P=5, seed=3)


@pytest.fixture(scope="module")
def x():
    return make_decode_inputs(CASE)


def _call(x, **kw):
    kw.setdefault("state_indices", x.state_indices)
    kw.setdefault("backend", "jax_ref")
    return gdn2_decode(*x.args, x.state, **kw)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(q=jnp.zeros((3, 2, 2))), r"q: expected rank 4 \(N, S, H, dk\)"),
        (dict(k=jnp.zeros((3, 2, 2, 9))), r"k: expected shape \(N, S, H, dk\) = \(3, 2, 2, 8\)"),
        (dict(w=jnp.zeros((3, 2, 3, 12))), r"w: expected shape \(N, S, HV, dv\) = \(3, 2, 4, 12\)"),
        (dict(v=jnp.zeros((3, 2, 3, 12)), w=jnp.zeros((3, 2, 3, 12))), r"HV=3 must be a multiple"),
        (dict(b=jnp.zeros((3, 2, 3, 8))), r"b: expected H=2 or HV=4 heads"),
        (dict(g=jnp.zeros((3, 2, 4, 8))), r"g: expected shape \(N, S, H or HV, dk\)"),
        (dict(w=jnp.zeros((3, 2))), r"w: expected rank 4 \(N, S, HV, dv\) or rank 3 \(N, S, HV\)"),
        (dict(w=jnp.zeros((3, 2, 2))), r"w: expected shape \(N, S, HV\) = \(3, 2, 4\), got"),
        (dict(b=jnp.zeros((3, 2, 3))), r"b: expected H=2 or HV=4 heads"),
        (dict(g=jnp.zeros((3, 1, 2))), r"g: expected shape \(N, S, H or HV\) = \(3, 2, 2\)"),
        (dict(state=jnp.zeros((5, 4, 8))), r"state: expected rank 4 \(P, HV, dk, dv\)"),
        (dict(state=jnp.zeros((5, 4, 8, 11))), r"state: expected shape \(P, HV, dk, dv\)"),
        (dict(state_indices=jnp.asarray([0, 1])), r"state_indices: expected shape \(N,\)"),
        (dict(state_indices=jnp.asarray([0, 5, -1])), r"sequence 1: 5, sequence 2: -1"),
        (dict(state_indices=jnp.asarray([4, 2, 4])), r"slot 4 by sequences \[0, 2\]"),
        (dict(state_indices=None), r"expected P = N = 3, got P = 5"),
        (dict(scale=float("nan")), r"scale: expected a finite float"),
    ],
)
def test_bad_inputs_name_the_argument(x, change, match):
    arrays = {n: getattr(x, n) for n in ("q", "k", "v", "w", "b", "g")}
    kw = {"state": x.state, "state_indices": x.state_indices}
    for name, value in change.items():
        (arrays if name in arrays else kw)[name] = value
    with pytest.raises(ValueError, match=match):
        gdn2_decode(*arrays.values(), **kw, backend="jax_ref")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(state=jnp.zeros((5, 4, 8, 12), jnp.float16)), r"state: expected dtype float32 or"),
        (dict(state_indices=jnp.asarray([0.0, 1.0, 2.0])), r"state_indices: expected an integer"),
        (dict(state_indices="012"), r"state_indices: expected an integer array"),
        (dict(return_token_states=1), r"return_token_states: expected a bool"),
        (dict(config={"bt": 16}), r"config: expected a KernelConfig"),
    ],
)
def test_bad_types_name_the_argument(x, change, match):
    kw = {"state": x.state, "state_indices": x.state_indices, **change}
    with pytest.raises(TypeError, match=match):
        gdn2_decode(*x.args, **kw, backend="jax_ref")


def test_backends_without_decode_are_refused_with_the_reason(x, monkeypatch):
    with pytest.raises(BackendUnsupportedError, match="no decode op"):
        _call(x, backend="scan_baseline")
    monkeypatch.setenv("GDN2_BACKEND", "scan_baseline")
    with pytest.raises(BackendUnsupportedError, match=r"GDN2_BACKEND=scan_baseline.*no decode"):
        _call(x, backend="auto")
    monkeypatch.delenv("GDN2_BACKEND")
    assert which_decode_backend(*x.args, x.state, state_indices=x.state_indices) == "jax_ref"
    with pytest.raises(BackendUnsupportedError, match=r"pallas_tpu.*dk=8 not in \(64, 128, 256\)"):
        which_decode_backend(
            *x.args, x.state, state_indices=x.state_indices, backend="pallas_tpu",
            config=KernelConfig(interpret=True),
        )  # fmt: skip
    y = make_decode_inputs(dataclasses.replace(CASE, dk=64, dv=64))
    with pytest.raises(BackendUnsupportedError, match="pallas_tpu.*runs on tpu"):
        _call(y, backend="pallas_tpu")
    interpret = KernelConfig(interpret=True)
    assert which_decode_backend(*y.args, y.state, state_indices=y.state_indices,
                                backend="pallas_tpu", config=interpret) == "pallas_tpu"  # fmt: skip


def test_spec_is_frozen_and_resolves_grouped_heads(x):
    spec = DecodeSpec.from_inputs(*x.args, x.state, x.state_indices)
    assert (spec.n_seqs, spec.tokens, spec.key_heads, spec.heads, spec.gate_heads) == (
        3,
        2,
        2,
        4,
        2,
    )
    assert spec.group == 2 and spec.pool_size == 5 and spec.indexed
    assert spec.pool_bytes_touched == 2 * 3 * 4 * 8 * 12 * 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.tokens = 3
    resolved = spec.resolved()
    assert resolved.key_heads == resolved.gate_heads == 4 and hash(resolved) != hash(spec)
    q = jnp.arange(2.0).reshape(1, 1, 2, 1)
    assert expand_heads(q, 4)[0, 0, :, 0].tolist() == [0.0, 0.0, 1.0, 1.0]  # head j // 2


def test_sanitize_slots_skips_out_of_range_and_repeated():
    got = sanitize_slots(jnp.asarray([3, 9, 1, 1, -2, 0]), 6, 5).tolist()
    assert got == [3, -1, -1, -1, -1, 0]
    assert sanitize_slots(None, 3, 3).tolist() == [0, 1, 2]


def _slots_rule(idx: np.ndarray, pool_size: int) -> list[int]:
    """The rule in NumPy: a slot in range that no other sequence names, else -1."""
    counts = {int(v): int(c) for v, c in zip(*np.unique(idx, return_counts=True), strict=True)}
    return [int(v) if 0 <= v < pool_size and counts[int(v)] == 1 else -1 for v in idx]


@pytest.mark.parametrize("n", [2, 7, 64, PAIRWISE_MAX, PAIRWISE_MAX + 1, 1500])
def test_sanitize_slots_follows_the_rule_on_both_paths(n):
    """Up to PAIRWISE_MAX sequences the rule compares every pair, above it sorts: both against
    the rule written in NumPy, on indices with repeats, negatives and values past the pool."""
    idx, pool_size = random_slot_indices(n)
    got = sanitize_slots(jnp.asarray(idx, jnp.int32), n, pool_size).tolist()
    assert got == _slots_rule(idx, pool_size)
    assert -1 in got and any(v >= 0 for v in got)  # the case has both kinds


GVA_CASES = [
    DecodeCase(N=2, S=1, H=2, HV=2, dk=8, dv=8, seed=1),
    DecodeCase(N=3, S=4, H=1, HV=4, dk=8, dv=16, P=6, b_max=2.0, seed=2),  # b, g per key head
    DecodeCase(N=2, S=6, H=2, HV=4, gate_heads=4, dk=16, dv=8, P=3, seed=3),  # per value head
]


@pytest.mark.parametrize("case", GVA_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_equals_the_chunked_forward(case, dtype):
    """The issue's check: decode of S tokens from any state equals the chunked forward (jax_ref)
    over the same tokens from the same states, o and the final states; float32 1e-5 and
    bfloat16 2e-2 relative (the kit's decode tolerances)."""
    x = make_decode_inputs(case, jnp.dtype(dtype))
    o, pool = gdn2_decode(*x.args, x.state, state_indices=x.state_indices, backend="jax_ref")
    slots = np.arange(case.N) if x.state_indices is None else np.asarray(x.state_indices)
    heads = [expand_heads(a, case.HV) for a in (x.q, x.k, x.b, x.g)]
    q, k, b, g = heads
    with jax.default_matmul_precision("highest"):
        o_fwd, h_fwd = gdn2_forward(
            q, k, x.v, x.w, b, g, h0=x.state[slots], backend="jax_ref",
            config=KernelConfig(bt=4),
        )  # fmt: skip
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert rel_err(o, o_fwd) <= tol
    assert rel_err(pool[slots], h_fwd) <= tol


def test_token_states_and_the_last_slot_agree(x):
    o, pool, states = _call(x, return_token_states=True)
    assert states.shape == (3, 2, 4, 8, 12) and states.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(pool)[np.asarray(x.state_indices)], states[:, -1])
    o_ref, _, states_ref = gdn2_decode_reference(
        *x.args, x.state, x.state_indices, return_token_states=True
    )
    assert rel_err(states, states_ref) <= 1e-5 and rel_err(o, o_ref) <= 1e-5


def test_chunk_states_are_refused_by_backends_without_them(x):
    q = jnp.zeros((1, 8, 1, 64))
    with pytest.raises(BackendUnsupportedError, match=r"no chunk states \(return_chunk_states"):
        gdn2_forward(q, q, q, q, q, q, backend="scan_baseline", return_chunk_states=True)
    with pytest.raises(TypeError, match="return_chunk_states: expected a bool"):
        gdn2_forward(q, q, q, q, q, q, backend="jax_ref", return_chunk_states="yes")
    # auto passes over them
    *_, chunks = gdn2_forward(q, q, q, q, q, q, return_chunk_states=True)
    assert chunks.shape == (1, 1, 1, 64, 64)


def test_donated_pool_is_updated_without_a_copy():
    """jit with donate_argnums: XLA aliases the pool to the result (no pool-sized scratch)."""
    case = DecodeCase(N=4, S=1, H=2, HV=4, dk=64, dv=64, P=64, seed=4)
    x = make_decode_inputs(case)

    def step(q, k, v, w, b, g, pool, idx):
        return gdn2_decode(q, k, v, w, b, g, pool, state_indices=idx, backend="jax_ref")

    args = (*x.args, x.state, x.state_indices)
    compiled = jax.jit(step, donate_argnums=(6,)).lower(*args).compile()
    pool_bytes = x.state.size * 4
    assert compiled.memory_analysis().temp_size_in_bytes < pool_bytes // 4
    pool = x.state.copy()
    _, new = compiled(*x.args, pool, x.state_indices)
    assert pool.is_deleted() and not new.is_deleted()


def test_init_state_pool():
    pool = gdn2core.init_state_pool(3, 4, 8, 16, jnp.bfloat16)
    assert pool.shape == (3, 4, 8, 16) and pool.dtype == jnp.bfloat16 and not pool.any()


#: The fused activations of the chunked op, every option in two calls (as the kit's feature
#: suite): softplus gate with the L2 norm and sigmoids; the bounded gate with negative eigenvalues.
ACTIVATIONS = [
    dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_bw_sigmoid_in_kernel=True),
    dict(
        use_gate_in_kernel=True, lower_bound=-3.0, use_bw_sigmoid_in_kernel=True,
        allow_neg_eigval=True,
    ),
]  # fmt: skip


def _gate_params(kw, heads, dk, seed):
    """``A_log (Hg,)`` and, for the softplus gate, ``dt_bias (Hg, dk)``."""
    rng = np.random.default_rng(seed)
    params = {"A_log": jnp.asarray(rng.uniform(-1.0, 1.0, heads), jnp.float32)}
    if kw.get("use_gate_in_kernel") and kw.get("lower_bound") is None:
        params["dt_bias"] = jnp.asarray(rng.normal(size=(heads, dk)), jnp.float32)
    return params


@pytest.mark.parametrize("kw", ACTIVATIONS, ids=["softplus", "lower-bound"])
@pytest.mark.parametrize("case", GVA_CASES[1:], ids=lambda c: c.id)
def test_decode_applies_the_fused_activations(case, kw):
    """gdn2_decode with the fused-activation keywords on raw inputs against the token-serial
    reference of the chunked op (which applies them token by token, independently of the core's
    XLA path) from the same states: float32, 1e-5 relative (the kit's decode tolerance; the two
    differ by float32 rounding only, a missing or misplaced activation is O(1))."""
    x = make_decode_inputs(case)
    params = _gate_params(kw, x.b.shape[2], case.dk, case.seed)
    o, pool = gdn2_decode(
        *x.args, x.state, state_indices=x.state_indices, backend="jax_ref", **kw, **params
    )
    slots = np.arange(case.N) if x.state_indices is None else np.asarray(x.state_indices)
    with jax.default_matmul_precision("highest"):
        o_ref, h_ref = gdn2core.gdn2_token_serial_reference(
            *x.args, h0=x.state[slots], **kw, **params
        )
        o_plain, _ = gdn2_decode(*x.args, x.state, state_indices=x.state_indices)
    assert rel_err(o, o_ref) <= 1e-5
    assert rel_err(pool[slots], h_ref) <= 1e-5
    assert rel_err(o_plain, o_ref) > 1e-2  # the activations change the result


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(use_gate_in_kernel=True), r"A_log: expected an array of shape \(Hg,\) = \(2,\)"),
        (dict(A_log=jnp.zeros(2)), r"A_log: given but use_gate_in_kernel=False"),
        (
            dict(use_gate_in_kernel=True, A_log=jnp.zeros(4), dt_bias=jnp.zeros((2, 8))),
            r"A_log: expected shape \(Hg,\) = \(2,\)",
        ),
        (
            dict(use_gate_in_kernel=True, lower_bound=-1.0, A_log=jnp.zeros(2),
                 dt_bias=jnp.zeros((2, 4))),
            r"dt_bias: expected shape \(Hg, dk\) = \(2, 8\)",
        ),
        (dict(lower_bound=-1.0), r"lower_bound"),
        (dict(allow_neg_eigval=True), r"allow_neg_eigval"),
    ],
)  # fmt: skip
def test_bad_activation_arguments_name_the_argument(x, kw, match):
    with pytest.raises(ValueError, match=match):
        _call(x, **kw)
    with pytest.raises(ValueError, match=match):
        which_decode_backend(*x.args, x.state, state_indices=x.state_indices, **kw)


def _forward_inputs(B, T, H, HV, Hg, dk, dv, seed):
    rng = np.random.default_rng(seed)

    def arr(*shape, lo=-1.0, hi=1.0):
        return jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32)

    q, k = arr(B, T, H, dk), arr(B, T, H, dk)
    v, w = arr(B, T, HV, dv), arr(B, T, HV, dv, lo=0.0)
    b, g = arr(B, T, Hg, dk, lo=0.0), arr(B, T, Hg, dk, lo=-2.0, hi=0.0)
    return (q, k, v, w, b, g), arr(B, HV, dk, dv)


@pytest.mark.parametrize("Hg", [1, 2], ids=["gates-per-key-head", "gates-per-value-head"])
def test_chunk_states_with_grouped_heads_and_activations(Hg):
    """return_chunk_states with GVA (HV = 2 H; b, g on key heads: the backend runs dv' = 2 dv, on
    value heads: q, k repeated) and fused activations: o, h_final and every chunk-entry state
    against the token-serial reference (the state after the first i * bt tokens, from the
    reference's h_final over those tokens): float32, 1e-5 relative."""
    args, h0 = _forward_inputs(2, 11, 1, 2, Hg, 8, 4, seed=Hg)
    kw = dict(ACTIVATIONS[0], **_gate_params(ACTIVATIONS[0], Hg, 8, seed=5))
    config = KernelConfig(bt=4)
    o, h, chunks = gdn2_forward(
        *args, h0=h0, config=config, backend="jax_ref", return_chunk_states=True, **kw
    )
    assert chunks.shape == (2, 3, 2, 8, 4) and chunks.dtype == jnp.float32
    with jax.default_matmul_precision("highest"):
        o_ref, h_ref = gdn2core.gdn2_token_serial_reference(*args, h0=h0, **kw)
        assert rel_err(o, o_ref) <= 1e-5 and rel_err(h, h_ref) <= 1e-5
        np.testing.assert_array_equal(chunks[:, 0], h0)
        for i in (1, 2):
            prefix = [a[:, : 4 * i] for a in args]
            _, h_i = gdn2core.gdn2_token_serial_reference(*prefix, h0=h0, **kw)
            assert rel_err(chunks[:, i], h_i) <= 1e-5, i


def test_chunk_states_are_refused_with_packed_sequences():
    args, _ = _forward_inputs(1, 8, 1, 1, 1, 8, 8, seed=0)
    ids = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"return_chunk_states: expected a call without packed"):
        gdn2_forward(*args, backend="jax_ref", segment_ids=ids, return_chunk_states=True)
    with pytest.raises(ValueError, match=r"return_chunk_states: expected a call without packed"):
        gdn2_forward(
            *args, backend="jax_ref", cu_seqlens=jnp.asarray([0, 3, 8]), return_chunk_states=True
        )
