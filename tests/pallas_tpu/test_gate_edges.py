"""The fused gates at extreme raw inputs (+-inf, +-1e4, +-1e30, +-3e38) and extreme A_log, on every
backend: the Pallas kernels (TPU interpret mode on the CPU), jax_ref and scan_baseline (the core's
XLA path) and the token-serial reference, against float64 NumPy loops of the same stable formulas
(:func:`gdn2_conformance.feature_inputs.np_gate`). The kernels' activation code is also checked
directly (it is plain jnp, the same functions the kernels trace): exact limits, and gradients that
are 0, not NaN, where a gate is flat.

What "exact at any input" means here (docs/operator.md, the gates): ``sigmoid(+-inf) = 1, 0``,
``softplus(-inf) = 0``, a raw ``g = +inf`` under the softplus gate is a full erase of the decayed
state (``g = -inf``), a raw ``g = -inf`` no decay at all (the padding of packed sequences relies
on it), and ``A_log`` enters clipped to ``A_LOG_RANGE``. None of it may depend on how Mosaic lowers
``exp`` or a division at an infinity (no exponent the kernels form is infinite, no divisor is
outside ``[1, 2]``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

from gdn2_conformance import SMALL_CONFIG, rel_err, tolerance
from gdn2_conformance.checks import op_function, outputs_and_grads
from gdn2_conformance.feature_inputs import activation_options, np_gate, np_sigmoid, np_softplus
from gdn2_conformance.inputs import Inputs
from gdn2_conformance.numpy_ref import gdn2_numpy_loop
from gdn2_pallas_tpu import activations as kact
from gdn2_pallas_tpu.chunk_math import G_FLOOR
from gdn2core import (
    Activations,
    GateMode,
    KernelConfig,
    gdn2_forward,
    gdn2_forward_trainable,
    gdn2_token_serial_reference,
)
from gdn2core.options import A_LOG_RANGE

#: Raw values that saturate every gate, and some that do not.
EXTREMES = np.array(
    [np.inf, -np.inf, 1e4, -1e4, 1e30, -1e30, 3e38, -3e38, 110.0, -110.0, 30.0, -30.0, 0.0],
    np.float32,
)
SOFTPLUS = Activations(qk_l2norm=True, gate=GateMode.SOFTPLUS, bw_sigmoid=True)
BOUNDED = Activations(
    qk_l2norm=True, gate=GateMode.LOWER_BOUND, lower_bound=-3.0, bw_sigmoid=True, neg_eigval=True
)
#: A_log per head: inside the clip, both infinities, +-1e4 and large finite values.
A_LOGS = {"softplus": (0.7, -np.inf, np.inf, 30.0), "lower_bound": (-1e4, 1e4, 0.7, -30.0)}
ERASE_TOKEN = 9  # softplus gate, head 0: raw g = +inf on every channel, a full erase
T, H, D = 21, 4, 64  # two chunks of 16 (the second one padded), four A_log values

PALLAS = KernelConfig(bt=16, interpret=True)
BACKENDS = {"jax_ref": SMALL_CONFIG, "scan_baseline": SMALL_CONFIG, "pallas_tpu": PALLAS}


def _ulp_close(actual, expected, ulps: float = 4.0, absolute: float = 1.2e-7) -> np.ndarray:
    """Elementwise: equal (infinities included), or within ``ulps`` float32 ulps of the float64
    value (a few roundings of exp, log1p and one division) plus ``absolute`` (the float32 ulp of
    1: what ``1 + t`` loses, and what a value below the float32 range underflows from)."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    with np.errstate(invalid="ignore"):
        near = np.abs(a - e) <= ulps * 2.0**-23 * np.abs(e) + absolute
    return (a == e) | near


# --- what the kernels' code exponentiates and divides by ------------------------------------


def _audited(fn, *args):
    """Run ``fn`` on concrete arrays op by op (its jaxpr, nested jits included) and fail at the
    first ``exp`` of an infinite value or division by a non-finite or zero divisor: values whose
    result on the TPU's own lowering of exp and of a refined reciprocal interpret mode does not
    show (``exp(-inf)``, ``1 / inf``). ``pltpu.roll`` (no CPU rule) runs as ``jnp.roll``."""
    closed = jax.make_jaxpr(fn)(*args)
    flat, _ = jax.tree_util.tree_flatten(args)
    out = _eval(closed.jaxpr, closed.consts, flat)
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(jax.eval_shape(fn, *args)), out
    )


def _eval(jaxpr, consts, args):
    """Evaluate ``jaxpr`` eqn by eqn with the checks of :func:`_audited`."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for var, val in zip(jaxpr.constvars, consts, strict=True):
        env[var] = val
    for var, val in zip(jaxpr.invars, args, strict=True):
        env[var] = val
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "exp":
            assert not np.isinf(np.asarray(ins[0])).any(), f"exp of an infinity: {eqn}"
        if name == "div":
            d = np.asarray(ins[1])
            assert np.isfinite(d).all() and (d != 0).all(), f"division by {d[~np.isfinite(d)]}"
        if name in ("jit", "pjit"):
            sub = eqn.params["jaxpr"]
            outs = _eval(sub.jaxpr, sub.consts, ins)
        elif name == "roll":
            assert eqn.params["stride"] is None, eqn
            outs = jnp.roll(ins[0], int(ins[1]), axis=eqn.params["axis"])
        else:
            outs = eqn.primitive.bind(*ins, **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        for var, val in zip(eqn.outvars, outs, strict=True):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]


def _unit_inputs(K: int, C: int = 16):
    """Raw inputs [1, C, K] of one unit with EXTREMES in b, w and g (rows), normal q, k, v."""
    rng = np.random.default_rng(0)
    vals = np.concatenate([EXTREMES, np.zeros(C - EXTREMES.size, np.float32)])[:C]
    ext = np.repeat(vals[:, None], K, axis=1)[None]  # [1, C, K]
    q, k, v = (jnp.asarray(rng.standard_normal((1, C, K)), jnp.float32) for _ in range(3))
    b, w, g = (jnp.asarray(np.roll(ext, s, axis=1)) for s in (0, 3, 5))
    return q, k, v, w, b, g


def test_kernel_activations_never_exponentiate_an_infinity():
    """The kernels' activate and raw_gradients, both gates, at EXTREMES in b, w, g and every
    extreme A_log: no exp of an infinity, no division by an infinity or 0, and finite gradients
    (one test for both gates: each takes under a second)."""
    for act in (SOFTPLUS, BOUNDED):
        _check_activations_at_extremes(act)


def _check_activations_at_extremes(act):
    """One gate of :func:`test_kernel_activations_never_exponentiate_an_infinity`."""
    A_log = np.array([-np.inf, -1e4, -30.0, 0.7, 30.0, 85.0, 1e4, np.inf], np.float32)
    K = A_log.size
    q, k, _, w, b, g = _unit_inputs(K)
    gp = jnp.stack([jnp.exp(jnp.asarray(A_log)), jnp.full((K,), -0.5, jnp.float32)])[None]
    valid = jnp.ones((1, 16, 1), bool)

    def both(q, k, b, w, g, gp):
        x = kact.activate(q, k, b, w, g, gp, act, 1e-6, valid)
        up = jnp.where(x.g >= G_FLOOR, 1.0, 0.0).astype(jnp.float32)
        ones = jnp.ones_like(q)
        return x.b, x.w, x.g, kact.raw_gradients(x, g, gp, act, valid, ones, ones, ones, ones, up)

    b_act, w_act, _, (_, _, db, dw, dg, partial) = _audited(both, q, k, b, w, g, gp)
    for name, a in (("db", db), ("dw", dw), ("dg", dg), ("dA_log, ddt_bias", partial)):
        assert np.isfinite(np.asarray(a)).all(), name
    scale = 2.0 if act.neg_eigval else 1.0
    raw_b, raw_w = np.asarray(b), np.asarray(w)
    assert np.all(np.asarray(b_act)[raw_b == np.inf] == scale)  # sigmoid(inf) = 1 exactly
    assert np.all(np.asarray(b_act)[raw_b == -np.inf] == 0.0)
    assert np.all(np.asarray(w_act)[raw_w == np.inf] == 1.0)
    assert np.all(np.asarray(w_act)[raw_w == -np.inf] == 0.0)
    assert np.all(np.asarray(db)[np.abs(raw_b) >= 1e4] == 0.0)  # flat: exactly 0, not NaN
    assert np.all(np.asarray(dw)[np.abs(raw_w) >= 1e4] == 0.0)


def test_chunk_math_masks_never_exponentiate_an_infinity():
    """Packed sequences inside a chunk (starts at rows 0, 3, 4 and 11) with a full erase
    (g = -inf raised to G_FLOOR) and strong decay: the chunk-local factors and the levels
    form no exp of an infinity (their masks are the finite exponent MASKED), and every factor
    cut off by a sequence start is exactly 0."""
    from gdn2_pallas_tpu import chunk_math as cm

    C, K = 16, 8
    q, k, v, w, b, _ = _unit_inputs(K, C)
    w, b = kact._sigmoid(w), kact._sigmoid(b)
    rng = np.random.default_rng(1)
    g = -np.abs(rng.standard_normal((1, C, K))).astype(np.float32) * 30.0
    g[0, 6] = -np.inf
    g = cm.clamp_log_decay(jnp.asarray(g))
    starts = np.zeros((1, C, 1), np.float32)
    starts[0, [0, 3, 4, 11]] = 1.0

    def local(q, k, v, w, b, g, starts):
        seg = cm.Segments.from_starts(starts)
        L = cm.chunk_local(q, k, v, w, b, g, seg)
        return L.e_gamma, L.e_tail, L.decay_C, [lv.F for lv in L.levels], seg.count

    e_gamma, e_tail, decay_C, factors, count = _audited(local, q, k, v, w, b, g, starts)
    count = np.asarray(count)[0, :, 0]
    assert np.all(np.asarray(e_gamma)[0][count != 0] == 0.0)  # rows after a start
    assert np.all(np.asarray(e_tail)[0][count != count[-1]] == 0.0)  # rows before the last start
    assert np.all(np.asarray(decay_C) == 0.0)  # the chunk holds starts
    for F in factors:
        assert np.isfinite(np.asarray(F)).all() and (np.asarray(F) <= 1.0).all()


def test_pair_decay_is_exact_and_finite_at_any_decay():
    """A scalar decay's pair factors (chunk_math.PairDecay) in one chunk with packed sequences
    (starts at rows 0, 3, 4 and 11), a full erase (g = -inf raised to G_FLOOR) and decays up to
    -30 per token: no exp of an infinity; D is exp(Γ_r - Γ_s) of float64 NumPy for s < r in one
    sequence and exactly 0 elsewhere (relative error within 4 float32 ulps of the largest |Γ|:
    the float32 cumsums' rounding becomes exp's relative error; below float32's smallest normal
    number, absolute); the scores from D equal those of the levels on the same g (float32
    products at full precision; 1e-5 of the largest score: the two sum the same terms in other
    orders)."""
    from gdn2_pallas_tpu import chunk_math as cm
    from gdn2_pallas_tpu.matmul import MatmulPrecision

    C, K = 16, 128
    q, k, v, w, b, _ = _unit_inputs(K, C)
    w, b = kact._sigmoid(w), kact._sigmoid(b)
    rng = np.random.default_rng(2)
    g1 = -np.abs(rng.standard_normal(C)).astype(np.float32) * 30.0
    g1[6] = -np.inf
    g = cm.clamp_log_decay(jnp.asarray(np.broadcast_to(g1[None, :, None], (1, C, K))))
    starts = np.zeros((1, C, 1), np.float32)
    starts[0, [0, 3, 4, 11]] = 1.0
    f32 = MatmulPrecision.F32

    def local(q, k, v, w, b, g, starts):
        seg = cm.Segments.from_starts(starts)
        pair = cm.chunk_local(q, k, v, w, b, g, seg, scalar_decay=True)
        lev = cm.chunk_local(q, k, v, w, b, g, seg)
        scores = [cm.scores(x.E, q, k, x.levels, f32) for x in (pair, lev)]
        return pair.levels.D, scores, seg.count

    D, ((kk_p, qk_p), (kk_l, qk_l)), count = _audited(local, q, k, v, w, b, g, starts)
    D, count = np.asarray(D)[0], np.asarray(count)[0, :, 0]
    gamma = np.zeros(C)
    for r in range(C):  # float64, restarting at every sequence start
        gamma[r] = max(float(g1[r]), G_FLOOR) + (
            gamma[r - 1] if r and count[r] == count[r - 1] else 0
        )
    r, s = np.indices((C, C))
    pairs = (s < r) & (count[r] == count[s])
    want = np.where(pairs, np.exp(np.where(pairs, gamma[r] - gamma[s], 0.0)), 0.0)
    assert np.all(D[~pairs] == 0.0)
    f32_eps, tiny = np.finfo(np.float32).eps, np.finfo(np.float32).tiny
    rtol = 4 * f32_eps * np.abs(gamma).max()
    np.testing.assert_allclose(D[pairs], want[pairs], rtol=rtol, atol=tiny)
    for pair, lev in ((kk_p, kk_l), (qk_p, qk_l)):
        pair, lev = np.asarray(pair), np.asarray(lev)
        assert np.abs(pair - lev).max() <= 1e-5 * np.abs(lev).max()


# --- the kernels' activation code -----------------------------------------------------------


def test_kernel_sigmoid_softplus_are_exact_at_any_input():
    """float32 on the CPU (the same jnp the kernels trace, jitted) against float64 NumPy: the
    limits exactly, the rest within 4 ulps + 1.2e-7 (``_ulp_close``)."""
    x = jnp.asarray(np.concatenate([EXTREMES, -EXTREMES, [1e-30, -1e-30, 1.0, -1.0, 88.0]]))
    xs = np.asarray(x, np.float64)
    s, sp = jax.jit(lambda v: (kact._sigmoid(v), kact._softplus(v)))(x)
    for name, got, want in (("sigmoid", s, np_sigmoid(xs)), ("softplus", sp, np_softplus(xs))):
        ok = _ulp_close(got, want)
        assert ok.all(), (name, xs[~ok], np.asarray(got)[~ok], want[~ok])
    inf = np.isinf(xs)
    assert np.array_equal(np.asarray(s)[inf], (xs[inf] > 0).astype(np.float64))  # exactly 1, 0
    assert np.asarray(sp)[xs == -np.inf].tolist() == [0.0, 0.0]
    assert np.all(np.asarray(sp)[xs == np.inf] == np.inf)


@functools.partial(jax.jit, static_argnums=0)
def _kernel_gate(act, raw_g, A_log, dt_bias):
    """The kernels' activate and raw_gradients on one unit [1, C, K] (C tokens), jitted as in
    a kernel (XLA may contract a * b + c into one rounding, as the TPU compiler may): the
    activated g, and the gradients of ``sum(g * up)`` (``up``: 1, and 0 where g is below G_FLOOR,
    as the chunk math's clamp hands it down) in raw g, A_log (summed over tokens) and dt_bias."""
    C, K = raw_g.shape
    gp = jnp.stack([jnp.exp(jnp.asarray(A_log, jnp.float32)), jnp.asarray(dt_bias)])[None]
    zeros = jnp.zeros((1, C, K), jnp.float32)
    valid = jnp.ones((1, C, 1), bool)
    g_raw = jnp.asarray(raw_g)[None]
    x = kact.activate(zeros, zeros, zeros, zeros, g_raw, gp, act, 1e-6, valid)
    up = jnp.where(x.g >= G_FLOOR, 1.0, 0.0).astype(jnp.float32)
    *_, d_raw, partial = kact.raw_gradients(
        x, g_raw, gp, act, valid, zeros, zeros, zeros, zeros, up
    )
    return x.g[0], up[0], d_raw[0], partial[0, 0], partial[0, 1]


def _numpy_gate_grads(act, raw_g, A_log, dt_bias, up):
    """float64 closed forms of the same gradients (module docstring of the kernels'
    activations.py), 0 where the upstream gradient or the slope is 0."""
    lo, hi = A_LOG_RANGE
    A = np.asarray(A_log, np.float64)
    a = np.exp(np.clip(A, lo, hi))  # [K]
    z = np.asarray(raw_g, np.float64) + np.asarray(dt_bias, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        if act.gate == GateMode.SOFTPLUS:
            g = -a * np_softplus(z)
            d_raw = -up * a * np_sigmoid(z)
            d_log_a = np.where(up == 0, 0.0, up * g)
        else:
            y = a * z
            t = np.exp(-np.abs(y))
            dy = up * act.lower_bound * t / (1.0 + t) ** 2
            d_raw = dy * a
            d_log_a = np.where(dy == 0, 0.0, dy * y)
    d_log_a = np.where((A < lo) | (A > hi), 0.0, d_log_a)
    return d_raw, d_log_a.sum(axis=0), d_raw.sum(axis=0)


def test_kernel_gate_and_its_gradients_at_any_input():
    """Both gates (one test: each takes under a second); see :func:`_check_gate_at_extremes`."""
    for act in (SOFTPLUS, BOUNDED):
        _check_gate_at_extremes(act)


def _check_gate_at_extremes(act):
    """Every raw g of EXTREMES against every A_log (one per channel, the kernels' clip included)
    and a finite dt_bias: the activated g as float64 NumPy's (limits exactly: -inf under the
    softplus gate for a raw +inf, 0 for a raw -inf), and the gradients (raw g, A_log, dt_bias)
    finite, 0 where the gate is flat, and as the float64 closed forms within 4 ulps + 1.2e-7
    relative to each column's size."""
    A_log = np.array([-np.inf, -1e4, -85.0, -30.0, 0.0, 0.7, 30.0, 85.0, 1e4, np.inf], np.float32)
    K = A_log.size
    raw = np.repeat(EXTREMES[:, None], K, axis=1)  # [C, K]: every raw value against every A_log
    raw = np.concatenate([raw, np.zeros((16 - raw.shape[0], K), np.float32)])  # C = 16
    dt = np.full(K, -0.5, np.float32)
    g, up, d_raw, d_log_a, d_dt = (np.asarray(a) for a in _kernel_gate(act, raw, A_log, dt))
    want = np_gate(act, raw[:, :, None], A_log, dt[:, None])[:, :, 0]  # channels as heads
    # As the chunk math sees them (raised to G_FLOOR: a full erase either way; float64 values
    # below float32's range are -inf in float32).
    ok = _ulp_close(np.maximum(g, G_FLOOR), np.maximum(want, G_FLOOR))
    assert ok.all(), (raw[~ok], g[~ok], want[~ok])
    if act.gate == GateMode.SOFTPLUS:
        assert np.all(g[raw == np.inf] == -np.inf)  # a full erase
    assert np.all(g[raw == -np.inf] == 0.0)  # no decay: what the padding of cu_seqlens needs
    w_raw, w_log_a, w_dt = _numpy_gate_grads(act, raw, A_log, dt, up.astype(np.float64))
    for name, got, expect in (("dg", d_raw, w_raw), ("dA_log", d_log_a, w_log_a),
                              ("ddt_bias", d_dt, w_dt)):  # fmt: skip
        assert np.isfinite(got).all(), (name, got)
        size = np.maximum(np.abs(expect).max(axis=0), 1.0)  # per channel (one A_log each)
        bad = np.abs(got - expect) > (4 * 2.0**-23 + 1.2e-7) * size
        assert not bad.any(), (name, got[bad], expect[bad])
        assert np.all(got[expect == 0] == 0.0), name  # flat: exactly 0, not NaN


# --- every backend, end to end --------------------------------------------------------------


def _extreme_inputs(act: Activations, seed: int = 0) -> Inputs:
    """B = 1, T = 21 (two chunks of 16), H = 4, dk = dv = 64, float32: raw q, k, v ~ N(0, 1); raw
    b, w, g ~ N(0, 1) with a third of their entries set to EXTREMES; A_log per head from A_LOGS,
    dt_bias ~ N(-1, 0.5); under the softplus gate head 0 has raw g = +inf on every channel at
    ERASE_TOKEN (a full erase)."""
    rng = np.random.default_rng(seed)
    shape = (1, T, H, D)
    t, h, c = np.meshgrid(np.arange(T), np.arange(H), np.arange(D), indexing="ij")
    pick = ((t * 7 + c * 3 + h) % EXTREMES.size)[None]

    def raw(offset):
        x = rng.standard_normal(shape).astype(np.float32)
        return np.where(((t + c + h + offset) % 3 == 0)[None], EXTREMES[pick], x)

    b, w, g = raw(0), raw(1), raw(2)
    if act.gate == GateMode.SOFTPLUS:
        g[0, ERASE_TOKEN, 0] = np.inf
    arrays = dict(
        q=rng.standard_normal(shape), k=rng.standard_normal(shape), v=rng.standard_normal(shape),
        w=w, b=b, g=g,
    )  # fmt: skip
    return Inputs(
        **{n: jnp.asarray(a, jnp.float32) for n, a in arrays.items()},
        h0=jnp.asarray(0.5 * rng.standard_normal((1, H, D, D)), jnp.float32),
        do=jnp.asarray(rng.standard_normal(shape), jnp.float32),
        dh=jnp.asarray(rng.standard_normal((1, H, D, D)), jnp.float32),
        A_log=jnp.asarray(A_LOGS[act.gate], jnp.float32),
        dt_bias=jnp.asarray(-1.0 + 0.5 * rng.standard_normal((H, D)), jnp.float32),
        options=activation_options(act),
    )


def _numpy_truth(x: Inputs, act: Activations):
    """float64 NumPy: the activations (the same stable formulas) and the NumPy loop."""
    q, k = (np.asarray(a, np.float64) for a in (x.q, x.k))
    q, k = (a / np.sqrt(np.sum(a * a, axis=-1, keepdims=True) + 1e-6) for a in (q, k))
    b = (2.0 if act.neg_eigval else 1.0) * np_sigmoid(x.b)
    w = np_sigmoid(x.w)
    g = np_gate(act, x.g, x.A_log, x.dt_bias)
    return gdn2_numpy_loop(q, k, x.v, w, b, g, D**-0.5, x.h0)


def _run(name: str, x: Inputs, trainable: bool = True):
    if name == "reference":
        fn = op_function(gdn2_token_serial_reference, x)
    else:
        op = gdn2_forward_trainable if trainable else gdn2_forward
        fn = op_function(op, x, backend=name, config=BACKENDS[name])
    if not trainable:
        return fn(*x.diff_args)
    return outputs_and_grads(fn, x)


GATES = [pytest.param(SOFTPLUS, id="softplus"), pytest.param(BOUNDED, id="lower_bound")]


@functools.lru_cache(maxsize=2)
def _reference_grads(act: Activations) -> dict:
    return _check_backend("reference", act)


def _check_backend(name: str, act: Activations) -> dict:
    """o, h_final as the float64 NumPy loop (the kit's float32 tolerance, 1e-4: the activated
    inputs rounded to float32, a chunked sum order); gradients finite, exactly 0 where the gate is
    flat (saturated sigmoids, an infinite raw g, a clipped A_log) and, but for the reference
    itself, as the reference's autodiff (3e-4, the kit's float32 gradient tolerance). Returns the
    gradients by name."""
    x = _extreme_inputs(act)
    o, h, grads = _run(name, x)
    o_np, h_np = _numpy_truth(x, act)
    assert rel_err(o, o_np) <= tolerance("float32", "o"), (name, rel_err(o, o_np))
    assert rel_err(h, h_np) <= tolerance("float32", "h_final"), (name, rel_err(h, h_np))
    grads = dict(zip(x.grad_names, (np.asarray(a) for a in grads), strict=True))
    for label, a in grads.items():
        assert np.isfinite(a).all(), (name, label)
    b, w, g = (np.asarray(a) for a in (x.b, x.w, x.g))
    assert np.all(grads["db"][np.abs(b) >= 1e4] == 0.0), name  # flat sigmoids
    assert np.all(grads["dw"][np.abs(w) >= 1e4] == 0.0), name
    assert np.all(grads["dg"][np.isinf(g)] == 0.0), name  # saturated gate
    lo, hi = A_LOG_RANGE
    clipped = (np.asarray(x.A_log) < lo) | (np.asarray(x.A_log) > hi)
    assert np.all(grads["dA_log"][clipped] == 0.0), name
    if name != "reference":
        for label, a in _reference_grads(act).items():
            err = rel_err(grads[label], a)
            assert err <= tolerance("float32", label), (name, label, err)
    return grads


@pytest.mark.parametrize("act", GATES)
def test_extreme_gates_pallas_tpu(act):
    """The Pallas kernels (interpret mode; the gates fused in the kernels) at extreme raw gates:
    as the float64 NumPy loop, gradients finite, 0 where flat, and as the reference's (which is
    held to the same checks)."""
    _check_backend("pallas_tpu", act)


@pytest.mark.parametrize("backend", ["jax_ref", "scan_baseline"])
@pytest.mark.parametrize("act", GATES[::-1])
def test_extreme_gates_xla_path(act, backend):
    """jax_ref and scan_baseline, which get the gates from the core's XLA path, at extreme raw
    gates: the same checks as the kernels'."""
    _check_backend(backend, act)


@pytest.mark.parametrize("backend", ["reference", "jax_ref", "scan_baseline", "pallas_tpu"])
def test_infinite_raw_gate_is_a_full_erase(backend):
    """Softplus gate, head 0, raw g = +inf on every channel at ERASE_TOKEN: g = -inf erases the
    decayed state, so from that token on head 0's outputs and its final state do not depend on h0
    or on the earlier tokens (bit for bit), while the other heads do."""
    x = _extreme_inputs(SOFTPLUS)
    o, h = _run(backend, x, trainable=False)
    head0 = np.zeros((1, 1, H, 1), bool)
    head0[..., 0, :] = True
    early = (np.arange(T) < ERASE_TOKEN)[None, :, None, None]
    changed = dataclasses.replace(
        x,
        h0=x.h0 + 1.0,
        v=jnp.where(early, x.v + 1.0, x.v),
        k=jnp.where(early & head0, -x.k, x.k),
    )
    o2, h2 = _run(backend, changed, trainable=False)
    o, o2, h, h2 = (np.asarray(a) for a in (o, o2, h, h2))
    assert np.isfinite(o).all() and np.isfinite(h).all()
    assert np.array_equal(o[:, ERASE_TOKEN:, 0], o2[:, ERASE_TOKEN:, 0]), backend
    assert np.array_equal(h[:, 0], h2[:, 0]), backend
    assert not np.array_equal(o[:, ERASE_TOKEN:, 1], o2[:, ERASE_TOKEN:, 1])  # no erase there


@pytest.mark.tpu_compile
def test_bounded_gate_with_dt_bias_train_step_lowers_to_mosaic():
    """Deviceless compile for v5e of value_and_grad of the op with fla's safe gate (lower_bound
    and dt_bias, raw b and w, the q/k L2 norm) in q..g, A_log and dt_bias: the Mosaic kernels,
    not an XLA or interpret-mode fallback (the stable sigmoid, log1p and the clipped rate lower)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from gdn2_tools.tpu import compile_for_tpu, topology_mesh

    B, Tc, Hc, Dc = 1, 256, 2, 128
    sharding = NamedSharding(topology_mesh("v5e:1x1"), PartitionSpec())

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    x = spec((B, Tc, Hc, Dc))

    def loss(q, k, v, w, b, g, A_log, dt_bias):
        o, h = gdn2_forward_trainable(
            q, k, v, w, b, g, A_log=A_log, dt_bias=dt_bias, backend="pallas_tpu",
            **activation_options(BOUNDED),
        )  # fmt: skip
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(h)

    step = jax.value_and_grad(loss, argnums=tuple(range(8)))
    text = compile_for_tpu(
        step, x, x, x, x, x, x, spec((Hc,), jnp.float32), spec((Hc, Dc), jnp.float32)
    ).as_text()
    assert "tpu_custom_call" in text
    assert "gdn2_fwd_train" in text and "gdn2_bwd" in text
