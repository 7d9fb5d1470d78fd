"""The token-serial reference: against a plain numpy loop, and its autodiff gradients against
float64 central differences (derivation-independent)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_conformance import (
    Case,
    FeatureCase,
    GateHeads,
    activate_numpy,
    check_central_differences,
    cotangent_loss,
    make_feature_inputs,
    make_inputs,
    op_function,
    outputs_and_grads,
    rel_err,
)
from gdn2_conformance.feature_suite import ACTIVATION_CASES, FUSED_CASES
from gdn2_conformance.numpy_ref import gdn2_numpy_loop
from gdn2core import Activations, GateMode, gdn2_token_serial_reference

CASES = [
    Case(B=1, T=9, H=2, dk=4, dv=6, h0=True),
    Case(B=2, T=7, H=1, dk=6, dv=3, h0=False, b_max=2.0),
    Case(B=1, T=12, H=1, dk=5, dv=5, h0=True, decay="strong", seed=3),
    Case(B=1, T=6, H=2, dk=3, dv=4, h0=True, decay="weak", seed=4),
]
NAMES = ("q", "k", "v", "w", "b", "g", "h0")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference_matches_numpy_loop(case, x64):
    x = make_inputs(case, jnp.float64)
    o, h = gdn2_token_serial_reference(*x.args, scale=0.7, h0=x.h0)
    o_np, h_np = gdn2_numpy_loop(*x.args, scale=0.7, h0=x.h0)
    # Same arithmetic in float64, different association order: rounding only (~1e-15).
    assert rel_err(o, o_np) < 1e-12
    assert rel_err(h, h_np) < 1e-12


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference_gradients_match_central_differences(case, x64):
    x = make_inputs(case, jnp.float64)
    h0 = x.h0 if x.h0 is not None else jnp.zeros((case.B, case.H, case.dk, case.dv))
    primals = (*x.args, h0)

    def loss(*args):
        o, h = gdn2_token_serial_reference(*args[:6], scale=0.7, h0=args[6])
        return cotangent_loss(o, h, x.do, x.dh)

    check_central_differences(loss, primals, seed=11)


def test_reference_finite_at_strong_decay():
    case = Case(B=1, T=40, H=1, dk=8, dv=8, decay="strong", seed=5)
    x = make_inputs(case)
    g = jnp.full_like(x.g, -80.0)  # exp(-80) underflows to ~0 in float32: state fully reset
    o, h = gdn2_token_serial_reference(*x.args[:5], g, h0=x.h0)
    assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(h)))


def test_reference_bf16_inputs_keep_f32_state():
    x = make_inputs(Case()).astype(jnp.bfloat16)
    o, h = gdn2_token_serial_reference(*x.args, h0=x.h0)
    assert o.dtype == jnp.bfloat16
    assert h.dtype == jnp.float32


# --- model features ------------------------------------------------------------------------------
# The reference implements each feature itself; here it meets independent formulations: separate
# calls per sequence (and the NumPy loop on them), the NumPy loop on repeated heads, and the
# activations applied in NumPy. float64 throughout: the same arithmetic reassociated, ~1e-15.

ROWS = ((3, 1, 1, 2, 9, 1, 3), (8, 8, 4))  # T = 20: length-1 sequences, starts anywhere
SEQLENS = (3, 0, 1, 10, 1, 2, 3, 0)  # two empty sequences, one of them last


def _numpy_sequence(x, t0, t1, row, h0):
    args = [np.asarray(a)[row : row + 1, t0:t1] for a in x.args]
    return gdn2_numpy_loop(*args, scale=0.7, h0=h0)


@pytest.mark.parametrize("groups", [1, 2])
def test_reference_segments_equal_separate_sequences(groups, x64):
    case = FeatureCase(B=2, T=20, H=2, dk=4, dv=3, groups=groups, rows=ROWS, seed=1)
    x = make_feature_inputs(case, jnp.float64)
    o, h = gdn2_token_serial_reference(*x.args, 0.7, x.h0, **x.options)
    rep = _repeat_keys(x, groups)
    for row, lengths in enumerate(ROWS):
        starts = np.cumsum((0, *lengths))
        for i in range(len(lengths)):
            t0, t1 = int(starts[i]), int(starts[i + 1])
            h_in = np.asarray(x.h0)[row : row + 1] if i == 0 else None  # h0 enters sequence 0
            o_np, h_np = _numpy_sequence(rep, t0, t1, row, h_in)
            assert rel_err(o[row : row + 1, t0:t1], o_np) < 1e-12, (row, i)
        assert rel_err(h[row : row + 1], h_np) < 1e-12, row  # h_final leaves the last sequence


def test_reference_varlen_equals_separate_sequences(x64):
    case = FeatureCase(B=1, T=20, H=2, dk=4, dv=3, groups=2, seqlens=SEQLENS, seed=2)
    x = make_feature_inputs(case, jnp.float64)
    o, h = gdn2_token_serial_reference(*x.args, 0.7, x.h0, **x.options)
    rep = _repeat_keys(x, 2)
    starts = np.cumsum((0, *SEQLENS))
    for n in range(len(SEQLENS)):
        t0, t1 = int(starts[n]), int(starts[n + 1])
        h_in = np.asarray(x.h0)[n : n + 1]
        if t0 == t1:  # an empty sequence hands its h0 back
            assert np.array_equal(h[n], x.h0[n]), n
            continue
        o_np, h_np = _numpy_sequence(rep, t0, t1, 0, h_in)
        assert rel_err(o[:, t0:t1], o_np) < 1e-12, n
        assert rel_err(h[n : n + 1], h_np) < 1e-12, n


def _repeat_keys(x, groups):
    """x with q, k (and b, g when they have key heads) repeated to the value heads."""
    import dataclasses

    HV, H = x.v.shape[2], x.q.shape[2]
    names = ["q", "k"] + (["b", "g"] if x.b.shape[2] == H else [])
    return dataclasses.replace(x, **{n: jnp.repeat(getattr(x, n), HV // H, axis=2) for n in names})


@pytest.mark.parametrize("gate_heads", list(GateHeads))
def test_reference_gva_equals_numpy_on_repeated_heads(gate_heads, x64):
    case = FeatureCase(B=2, T=9, H=2, dk=4, dv=3, groups=3, gate_heads=gate_heads, seed=3)
    x = make_feature_inputs(case, jnp.float64)
    o, h = gdn2_token_serial_reference(*x.args, 0.7, x.h0)
    assert o.shape == (2, 9, 6, 3) and h.shape == (2, 6, 4, 3)
    o_np, h_np = gdn2_numpy_loop(*_repeat_keys(x, 3).args, scale=0.7, h0=x.h0)
    assert rel_err(o, o_np) < 1e-12 and rel_err(h, h_np) < 1e-12


@pytest.mark.parametrize(
    ("act", "bias"),
    (*FUSED_CASES, (Activations(qk_l2norm=True), False)),
    ids=lambda v: str(v)[:60],
)
def test_reference_activations_equal_numpy_activated_inputs(act, bias, x64):
    """The bounded gate with dt_bias (fla's safe gate) and without one, among the others."""
    case = FeatureCase(
        B=1, T=11, H=2, dk=4, dv=3, groups=2, activations=act, gate_bias=bias, seed=4
    )
    x = make_feature_inputs(case, jnp.float64)
    o, h = gdn2_token_serial_reference(*x.args, 0.7, x.h0, A_log=x.A_log, dt_bias=x.dt_bias,
                                       **x.options)  # fmt: skip
    y = activate_numpy(x, act)
    o_np, h_np = gdn2_numpy_loop(*_repeat_keys(y, 2).args, scale=0.7, h0=x.h0)
    assert rel_err(o, o_np) < 1e-12 and rel_err(h, h_np) < 1e-12
    off, _ = gdn2_token_serial_reference(*x.args, 0.7, x.h0)  # the raw inputs, not activated
    assert rel_err(off, o_np) > 1e-2


@pytest.mark.parametrize("act", ACTIVATION_CASES, ids=str)
def test_reference_feature_gradients_match_central_differences(act, x64):
    """Gradients in every argument (A_log, dt_bias included) with segments, GVA and activations."""
    case = FeatureCase(B=2, T=10, H=1, dk=3, dv=2, groups=2, rows=((4, 1, 5), (10,)),
                       activations=act, seed=5)  # fmt: skip
    x = make_feature_inputs(case, jnp.float64)
    fn = op_function(gdn2_token_serial_reference, x)

    def loss(*args):
        o, h = fn(*args)
        return cotangent_loss(o, h, x.do, x.dh)

    check_central_differences(loss, x.diff_args, seed=12, names=x.grad_names)


def test_reference_bounded_gate_takes_dt_bias_as_fla(x64):
    """fla's safe gate: ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``. The reference with
    dt_bias equals the reference without it on raw g + dt_bias (float64: the same arithmetic,
    1e-12), differs from it on raw g (so the bias is used: O(1)), and its dt_bias gradient equals
    its raw-g gradient summed over tokens (the bias enters only through g + dt_bias; 1e-12)."""
    act = Activations(gate=GateMode.LOWER_BOUND, lower_bound=-2.0)
    x = make_feature_inputs(FeatureCase(T=9, H=2, dk=4, dv=3, activations=act, seed=6), jnp.float64)
    assert x.dt_bias is not None
    run = op_function(gdn2_token_serial_reference, x)
    o, h = run(*x.diff_args)
    shifted = dataclasses.replace(x, g=x.g + x.dt_bias, dt_bias=None)
    o_s, h_s = op_function(gdn2_token_serial_reference, shifted)(*shifted.diff_args)
    assert rel_err(o, o_s) < 1e-12 and rel_err(h, h_s) < 1e-12
    plain = dataclasses.replace(x, dt_bias=None)
    o_p, _ = op_function(gdn2_token_serial_reference, plain)(*plain.diff_args)
    assert rel_err(o, o_p) > 1e-2
    grads = dict(zip(x.grad_names, outputs_and_grads(run, x)[2], strict=True))
    assert rel_err(grads["ddt_bias"], jnp.sum(grads["dg"], axis=(0, 1))) < 1e-12
