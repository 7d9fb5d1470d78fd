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
    """Blocks of 16 and 8 rows, at most the chunk, where nothing fixes the blocking: none with
    the bounded gate (its own block), packed sequences, a scalar decay or a fused gate."""
    assert _plan().runtime_merged_blocks == (16, 8)
    assert _plan(bt=16).runtime_merged_blocks == (16, 8)
    l2norm = Activations(qk_l2norm=True)  # g passes the kernels as given
    assert _plan(activations=l2norm).runtime_merged_blocks == (16, 8)
    bounded = Activations(gate=GateMode.LOWER_BOUND, lower_bound=-5.0)
    assert _plan(activations=bounded).runtime_merged_blocks == ()
    assert _plan(activations=Activations(gate=GateMode.SOFTPLUS)).runtime_merged_blocks == ()
    assert _plan(segments=True).runtime_merged_blocks == ()
    assert _plan(scalar_gates=("g",)).runtime_merged_blocks == ()  # a scalar decay: no levels


def test_a_block_merges_while_its_factors_stay_within_exp_64():
    """``|g| * block / 2 <= 64``: exactly at the bound it merges, just above it does not, and a
    NaN never does."""
    g = jnp.full((2, 8, 128), -1.0).at[1, 3, 7].set(-8.0)
    assert bool(cm.mergeable(g, 16)) and bool(cm.mergeable(g, 8))
    g = g.at[1, 3, 7].set(np.nextafter(np.float32(-8.0), np.float32(-9.0)))
    assert not bool(cm.mergeable(g, 16)) and bool(cm.mergeable(g, 8))
    assert not bool(cm.mergeable(g.at[0, 0, 0].set(-16.5), 8))
    assert not bool(cm.mergeable(g.at[0, 0, 0].set(np.nan), 8))


#: Log decays of a whole call, each letting one copy of the grid step run: every |g| <= 8 (16-row
#: blocks), one token at -12 (8-row blocks), one at -30 (the levels).
REGIMES = {"blocks-16": (None, 16), "blocks-8": (-12.0, 8), "levels": (-30.0, 1)}


def _regime_inputs(strongest):
    """float32 inputs of mild decays (the kit's mixed ones, clipped to [-8, 0]), with one token
    of every head at ``strongest`` (None: none)."""
    args, do, dh = make_inputs(1, 150, 2, 64, 64, "float32", seed=31, strong=0.0)
    g = jnp.clip(args[5], -8.0, 0.0)
    if strongest is not None:
        g = g.at[0, 77, :, 5].set(strongest)
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
    strongest, block = REGIMES[regime]
    args, do, dh = _regime_inputs(strongest)
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
