"""scan_baseline, the independent check of the chunked backends, at g = -inf and below float32's
exp underflow (issue 11.6): finite and equal to the token-serial reference, forward and backward.

It lives next to the jax_ref edge cases it backs up and needs gdn2-scan-baseline installed.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from tests.jax_ref.test_edge_numerics import (
    FORGET_CASE,
    FORGET_VALUES,
    GRAD_NAMES,
    TOL_F64,
    TOL_FWD_F32,
    TOL_GRAD_F32,
    all_finite,
    forget_inputs,
    forget_mask,
    in_float64,
    run,
)
from tests.support.inputs import rel_err


@pytest.mark.parametrize("value", FORGET_VALUES, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_scan_baseline_forgets_like_the_reference(x64, value, dtype):
    """Tolerances as for jax_ref (float32 against the float64 reference; float64 rounding)."""
    inp = forget_inputs(value, jnp.dtype(dtype))
    (o_ref, h_ref), g_ref = run("reference", in_float64(inp))
    (o, h), grads = run("scan_baseline", inp)
    assert all_finite(o, h, *grads)
    tol_fwd, tol_grad = (TOL_F64, TOL_F64) if dtype == "float64" else (TOL_FWD_F32, TOL_GRAD_F32)
    assert rel_err(o, o_ref) < tol_fwd and rel_err(h, h_ref) < tol_fwd
    for name, a, e in zip(GRAD_NAMES, grads, g_ref, strict=True):
        assert rel_err(a, e) < tol_grad, (name, rel_err(a, e))
    assert bool(jnp.all(grads[5][forget_mask(FORGET_CASE)] == 0))
