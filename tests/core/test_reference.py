"""The token-serial reference: against a plain numpy loop, and its autodiff gradients against
float64 central differences (derivation-independent)."""

import jax.numpy as jnp
import pytest

from gdn2core import gdn2_token_serial_reference
from gdn2core.testing import Case, check_central_differences, cotangent_loss, make_inputs, rel_err
from gdn2core.testing.numpy_ref import gdn2_numpy_loop

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
