"""The bounded gate's fast path (``lower_bound``: every log decay in ``[lower_bound, 0)``): the
kernels merge the decay levels inside blocks of ``Plan.merged_block`` rows into one product per
score matrix (chunk_math.merged_levels). In TPU interpret mode against the token-serial reference
(outputs and every gradient, the gate parameters included) and against the level scheme itself
on the same inputs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_pallas_tpu import plan as plan_module
from gdn2_pallas_tpu.plan import make_plan
from gdn2core import KernelConfig, gdn2_forward_trainable, gdn2_token_serial_reference
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.options import Activations, GateMode

from .helpers import rel_err

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
