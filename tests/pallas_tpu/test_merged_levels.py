"""Merged decay levels: the kernels merge the levels inside blocks of rows into one product per
score matrix (chunk_math.merged_levels) where the log decays are bounded. With the bounded gate
(``lower_bound``: every log decay in ``[lower_bound, 0)``) the block is the plan's
(``Plan.merged_block``); otherwise each grid step picks it from its own decays
(``Plan.runtime_merged_blocks``, chunk_math.by_decay_bound). In TPU interpret mode against the
token-serial reference (outputs and every gradient, the gate parameters included) and against the
level scheme itself on the same inputs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2_pallas_tpu import activations as act
from gdn2_pallas_tpu import chunk_math as cm
from gdn2_pallas_tpu import plan as plan_module
from gdn2_pallas_tpu.plan import make_plan
from gdn2core import KernelConfig, gdn2_forward_trainable, gdn2_token_serial_reference
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.options import Activations, GateMode

from .helpers import (
    GRAD_NAMES,
    TOL,
    make_inputs,
    outputs_and_grads,
    reference_value_and_grad,
    rel_err,
)

B, T, H, DK, DV = 1, 150, 2, 64, 64
#: The conformance kit's float32 bounds (1e-4 on outputs, 3e-4 on gradients): the kernels run
#: float32 products as three bf16 passes (1.7e-5 / 2.2e-5 measured, docs/algorithm.md section 10).
TOL_OUT, TOL_GRAD = 1e-4, 3e-4
#: (lower_bound, bt, merged block): |lower_bound| * block / 2 <= 64 (plan.MERGED_EXPONENT).
CASES = {
    "lb-5_bt64_block16": (-5.0, 64, 16),
    "lb-2_bt32_block32": (-2.0, 32, 32),
    "lb-1_bt64_whole-chunk": (-1.0, 64, 64),
}


def _inputs(seed: int):
    rng = np.random.default_rng(seed)

    def arr(*shape, lo=-1.0, hi=1.0):
        return jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32)

    # raw gates up to 6 with exp(A_log) up to 4.5: most tokens' sigmoids near 1, so decays near
    # lower_bound, the largest exponents the merged factors meet
    args = (arr(B, T, H, DK), arr(B, T, H, DK), arr(B, T, H, DV), arr(B, T, H, DV),
            arr(B, T, H, DK), arr(B, T, H, DK, lo=-3.0, hi=6.0))  # fmt: skip
    params = (arr(H, lo=0.5, hi=1.5), arr(H, DK, lo=-0.5, hi=0.5))
    cot = (arr(B, T, H, DV), arr(B, H, DK, DV))
    return args, arr(B, H, DK, DV), params, cot


def _loss(fn, lower_bound, do, dh):
    def loss(q, k, v, w, b, g, h0, A_log, dt_bias):
        o, h = fn(q, k, v, w, b, g, h0, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                  lower_bound=lower_bound, use_qk_l2norm_in_kernel=True)  # fmt: skip
        return jnp.sum(o * do) + jnp.sum(h * dh), (o, h)

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(9)), has_aux=True))


def _pallas(config):
    def fn(*args, **kw):
        return gdn2_forward_trainable(*args[:6], h0=args[6], config=config, backend="pallas_tpu",
                                      **kw)  # fmt: skip

    return fn


def _reference(*args, **kw):
    return gdn2_token_serial_reference(*args[:6], h0=args[6], **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_merged_block_of_the_plan(case):
    lower_bound, bt, block = CASES[case]
    x = jnp.zeros((B, T, H, DK))
    spec = OpSpec.from_inputs(x, x, x, x, x, x, None, None)
    act = Activations(qk_l2norm=True, gate=GateMode.LOWER_BOUND, lower_bound=lower_bound)
    plan = make_plan(spec, KernelConfig(bt=bt, interpret=True), activations=act)
    assert plan.merged_block == block
    softplus = dataclasses.replace(act, gate=GateMode.SOFTPLUS, lower_bound=None)
    assert make_plan(spec, KernelConfig(bt=bt), activations=softplus).merged_block == 1
    packed = make_plan(spec, KernelConfig(bt=bt), activations=act, segments=True)
    assert packed.merged_block == 1  # a block's middle row may lie in another sequence


@pytest.mark.parametrize("case", list(CASES))
def test_merged_levels_match_the_reference_and_the_level_scheme(case, monkeypatch):
    """o, h_final and the nine gradients against the token-serial reference's autodiff; and
    the same call with the levels kept (``merged_block`` forced to 1) agrees within 5e-5: each
    side is within the documented 1.7e-5 (outputs) / 2.2e-5 (gradients) of the exact result,
    with independent roundings, so their difference is within twice that."""
    lower_bound, bt, _ = CASES[case]
    args, h0, params, (do, dh) = _inputs(seed=int(-lower_bound) + bt)
    inputs = (*args, h0, *params)
    config = KernelConfig(bt=bt, interpret=True)
    (_, (o, h)), grads = _loss(_pallas(config), lower_bound, do, dh)(*inputs)
    with jax.default_matmul_precision("highest"):
        (_, (o_ref, h_ref)), grads_ref = _loss(_reference, lower_bound, do, dh)(*inputs)
    assert rel_err(o, o_ref) <= TOL_OUT and rel_err(h, h_ref) <= TOL_OUT
    names = ("q", "k", "v", "w", "b", "g", "h0", "A_log", "dt_bias")
    for name, gx, gr in zip(names, grads, grads_ref, strict=True):
        assert rel_err(gx, gr) <= TOL_GRAD, (name, rel_err(gx, gr))

    monkeypatch.setattr(plan_module.Plan, "merged_block", property(lambda self: 1))
    (_, (o_lv, h_lv)), grads_lv = _loss(_pallas(config), lower_bound, do, dh)(*inputs)
    assert rel_err(o, o_lv) <= 5e-5 and rel_err(h, h_lv) <= 5e-5
    for name, gx, gl in zip(names, grads, grads_lv, strict=True):
        assert rel_err(gx, gl) <= 5e-5, (name, rel_err(gx, gl))


def _plan(bt=64, **kw):
    x = jnp.zeros((B, T, H, DK))
    spec = OpSpec.from_inputs(x, x, x, x, x, x, None, None)
    return make_plan(spec, KernelConfig(bt=bt, interpret=True), **kw)


def test_runtime_merged_blocks_of_the_plan():
    """Blocks of 16 and 8 rows, at most the chunk, where nothing fixes the blocking (the softplus
    gate included): none with the bounded gate (its own block), packed sequences or a scalar
    decay."""
    assert _plan().runtime_merged_blocks == (16, 8)
    assert _plan(bt=16).runtime_merged_blocks == (16, 8)
    l2norm = Activations(qk_l2norm=True)  # g passes the kernels as given
    assert _plan(activations=l2norm).runtime_merged_blocks == (16, 8)
    bounded = Activations(gate=GateMode.LOWER_BOUND, lower_bound=-5.0)
    assert _plan(activations=bounded).runtime_merged_blocks == ()
    softplus = Activations(gate=GateMode.SOFTPLUS)  # by a bound on the activated g
    assert _plan(activations=softplus).runtime_merged_blocks == (16, 8)
    assert _plan(segments=True).runtime_merged_blocks == ()
    assert _plan(scalar_gates=("g",)).runtime_merged_blocks == ()  # a scalar decay: no levels


def test_a_block_merges_while_its_factors_stay_within_exp_64():
    """Every ``block / 2`` consecutive rows of a unit sum to ``|g| <= 64`` (by the bound of
    chunk_math.window_maxima): exactly at the bound it merges, just above it does not, a NaN
    never does."""

    def merges(g, block, nc=1):  # in a kernel (TPU interpret mode): the windows roll on sublanes
        width = block // 2

        def kernel(g_ref, out_ref):
            bound = cm.decay_row_bound(g_ref[...], nc)  # [nc, C, K]
            out_ref[...] = jnp.full(out_ref.shape, cm.window_maxima(bound, (width,))[width])

        out = jax.ShapeDtypeStruct((8, 128), jnp.float32)
        window_max = pl.pallas_call(kernel, out_shape=out, interpret=pltpu.InterpretParams())(g)
        return bool(cm.mergeable(window_max[0, 0]))

    g = jnp.full((2, 16, 128), -1.0).at[1, 3:11, 7].set(-8.0)  # 8 rows of -8 on one channel
    assert merges(g, 16) and merges(g, 8)  # 64 over those 8 rows, 32 over any 4
    g = g.at[1, 10, 7].set(-8.0001)
    assert not merges(g, 16) and merges(g, 8)
    # One strong decay among mild ones: the old bound (every |g| * block / 2 <= 64) refused both.
    one = jnp.full((2, 16, 128), -0.25).at[1, 5, 7].set(-60.0)
    assert merges(one, 16)  # 60 + 7 * 0.25 over 8 rows
    one = one.at[1, 5, 7].set(-63.0)
    assert not merges(one, 16) and merges(one, 8)  # 64.75 over 8 rows, 63.75 over 4
    assert not merges(g.at[0, 0, 0].set(np.nan), 8)
    # The bound sums the heads' largest |g| of each chunk row by row (units head * nc + chunk),
    # and its windows wrap around the rows: strong decays of two heads at neighbouring rows of a
    # chunk, or at its first and last row, add up; in two chunks they do not.
    alone = jnp.full((2, 16, 128), -0.25).at[0, 3, 0].set(-40.0)
    assert merges(alone, 8)
    assert not merges(alone.at[1, 4, 0].set(-40.0), 8)  # two heads of one chunk
    assert merges(alone.at[1, 4, 0].set(-40.0), 8, nc=2)  # one head's two chunks
    assert merges(alone.at[1, 4, 1].set(-40.0), 8)  # another channel: its own windows
    wrap = alone.at[0, 3, 0].set(-0.25).at[0, 0, 0].set(-40.0).at[1, 15, 0].set(-40.0)
    assert not merges(wrap, 8)


#: Log decays of a whole call (one grid step), each letting one copy of the step run: the mild
#: decays of :func:`_regime_inputs` (all in [-2.7, 0]) with, on channel 5 of every head, one token
#: at -30 (at most 30 + 7 * 2.7 over 8 rows: 16-row blocks, which the bound of every |g| <= 8
#: refused before), two at -33 four rows apart (66 over the 8 rows holding both, at most 33 +
#: 3 * 2.7 over any 4: 8-row blocks), or one at -70 (the levels).
REGIMES = {
    "blocks-16": (((77, -30.0),), 16),
    "blocks-8": (((77, -33.0), (81, -33.0)), 8),
    "levels": (((77, -70.0),), 1),
}


def _regime_inputs(strong):
    """float32 inputs of mild decays (the kit's mixed ones, clipped to [-8, 0]), with the
    ``(row, log decay)`` of ``strong`` on channel 5 of every head."""
    args, do, dh = make_inputs(1, 150, 2, 64, 64, "float32", seed=31, strong=0.0)
    g = jnp.clip(args[5], -8.0, 0.0)
    for row, value in strong:
        g = g.at[0, row, :, 5].set(value)
    return (*args[:5], g, args[6]), do, dh


def _poisoned(block, original=cm.merged_levels):
    """``merged_levels`` whose row factors are NaN for ``block``-row blocks: an output with a NaN
    shows that a copy of the step with that block ran."""

    def merged_levels(gamma_cum, rows):
        lv = original(gamma_cum, rows)
        return dataclasses.replace(lv, F=lv.F * np.float32(np.nan)) if rows == block else lv

    return merged_levels


def _call(args, do, dh):
    """A new function each call (_pallas), so that a jit traces the kernels again."""
    return outputs_and_grads(_pallas(KernelConfig(interpret=True)), args, do, dh)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_each_grid_step_runs_the_copy_its_decays_allow(regime, monkeypatch):
    """The forward and the backward run the merged copy of the step that the call's decays allow
    (a NaN planted in that copy reaches o and the gradients; one planted in another copy does
    not), and the unplanted call matches the token-serial reference (the kit's float32 bounds:
    three-pass products, docs/algorithm.md section 10)."""
    strong, block = REGIMES[regime]
    args, do, dh = _regime_inputs(strong)
    o, h, grads = _call(args, do, dh)
    o_ref, h_ref, grads_ref = reference_value_and_grad(args, do, dh)
    assert rel_err(o, o_ref) <= TOL["float32"]["o"]
    assert rel_err(h, h_ref) <= TOL["float32"]["h_final"]
    for name, gx, gr in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        assert rel_err(gx, gr) <= TOL["float32"]["grad"], (name, rel_err(gx, gr))
    for planted in (16, 8):
        monkeypatch.setattr(cm, "merged_levels", _poisoned(planted))
        o_p, _, grads_p = _call(args, do, dh)
        ran = planted == block
        assert bool(jnp.isnan(o_p).any()) is ran, planted
        assert bool(jnp.isnan(grads_p[0]).any()) is ran, planted  # dq: the backward's copy too
        if not ran:  # the copy that ran is the one of the unplanted call
            np.testing.assert_array_equal(np.asarray(o_p), np.asarray(o))


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("training", [False, True])
def test_the_rule_outside_the_kernels_names_the_copy_they_ran(regime, training):
    """gdn2_pallas_tpu.merged_steps (``python -m gdn2_tools.merged_steps``) on the inputs whose
    copy :func:`test_each_grid_step_runs_the_copy_its_decays_allow` saw the kernels run."""
    from gdn2_pallas_tpu.merged_steps import step_blocks

    strong, block = REGIMES[regime]
    (*_, g, _), _, _ = _regime_inputs(strong)
    plan = _plan(training=training)
    assert plan.grid() == (1, 1, 1)  # one step: the call's copy is the step's
    np.testing.assert_array_equal(step_blocks(g, plan), np.full((1, 1, 1), block))
    with pytest.raises(ValueError, match=r"g: expected shape \(1, 150, 2, 64\)"):
        step_blocks(g[:, :100], plan)
    with pytest.raises(ValueError, match="plan: expected one without a fused gate"):
        step_blocks(g, _plan(activations=Activations(gate=GateMode.SOFTPLUS)))


#: Raw decay inputs of the fused softplus gate (``exp(A_log) = 1``, ``dt_bias = 0``: ``g =
#: -softplus(raw)``), each letting one copy of the (one) grid step run: raw in [-3, 1] (``|g| <=
#: 1.32``) with, on channel 5 of every head, one token at 30 (at most 30 + 7 * 1.32 over 8 rows),
#: two at 33 four rows apart (66 over 8 rows, at most 33 + 3 * 1.32 over 4), or one at 70.
GATE_REGIMES = {
    "blocks-16": (((77, 30.0),), 16),
    "blocks-8": (((77, 33.0), (81, 33.0)), 8),
    "levels": (((77, 70.0),), 1),
}


@pytest.mark.parametrize("regime", list(GATE_REGIMES))
def test_the_softplus_gate_runs_the_copy_its_activated_decays_allow(regime, monkeypatch):
    """With the decay gate fused (``use_gate_in_kernel``), the step's copy follows the bound on
    the activated decays (activations.softplus_decay_bound): a NaN planted in that copy reaches
    o and dq, one planted in another does not; the unplanted call matches the token-serial
    reference's outputs and nine gradients (A_log and dt_bias included) within the kit's float32
    bounds."""
    strong, block = GATE_REGIMES[regime]
    args, h0, _, (do, dh) = _inputs(seed=7)
    raw = args[5].at[...].set(jnp.clip(args[5], -3.0, 1.0))
    for row, value in strong:
        raw = raw.at[0, row, :, 5].set(value)
    params = (jnp.zeros((H,)), jnp.zeros((H, DK)))
    inputs = (*args[:5], raw, h0, *params)
    (_, (o, h)), grads = _loss(_pallas(KernelConfig(interpret=True)), None, do, dh)(*inputs)
    with jax.default_matmul_precision("highest"):
        (_, (o_ref, h_ref)), grads_ref = _loss(_reference, None, do, dh)(*inputs)
    assert rel_err(o, o_ref) <= TOL_OUT and rel_err(h, h_ref) <= TOL_OUT
    for gx, gr in zip(grads, grads_ref, strict=True):
        assert rel_err(gx, gr) <= TOL_GRAD
    for planted in (16, 8):
        monkeypatch.setattr(cm, "merged_levels", _poisoned(planted))
        fn = _loss(_pallas(KernelConfig(interpret=True)), None, do, dh)
        (_, (o_p, _)), grads_p = fn(*inputs)
        assert bool(jnp.isnan(o_p).any()) is (planted == block), planted
        assert bool(jnp.isnan(grads_p[0]).any()) is (planted == block), planted  # dq: backward


def test_the_softplus_bound_is_never_below_the_activated_decays():
    """activations.softplus_decay_bound against the heads' largest activated ``|g|`` per chunk,
    row and channel (3 heads of 2 chunks, units ``head * nc + chunk``), on rates and biases that
    differ by unit (the bound takes the largest of each)."""
    rng = np.random.default_rng(3)
    U, nc, C, K = 6, 2, 16, 128
    raw = jnp.asarray(rng.normal(0.0, 4.0, (U, C, K)), jnp.float32)
    params = jnp.asarray(
        np.concatenate([rng.uniform(0.5, 16.0, (U, 1, K)), rng.normal(0.0, 2.0, (U, 1, K))], 1),
        jnp.float32,
    )  # [U, 2, K]: exp(A_log), dt_bias
    g = -params[:, :1] * jax.nn.softplus(raw + params[:, 1:])  # [U, C, K] activated
    bound = act.softplus_decay_bound(raw, params, nc)  # [nc, C, K]
    exact = jnp.max(jnp.abs(g).reshape(U // nc, nc, C, K), axis=0)  # [nc, C, K]
    assert bound.shape == (nc, C, K)
    assert bool(jnp.all(bound >= exact * (1 - 1e-6)))
    assert float(jnp.max(bound / exact)) > 1.5  # a bound, not the maximum itself
