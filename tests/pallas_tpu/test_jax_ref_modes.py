"""Modes that involve the jax_ref backend: hybrid_forward (jax_ref forward + Pallas backward) and
the damped WY system (wy_eps > 0), where jax_ref, not the undamped serial reference, is the
comparison (same damped operator)."""

from __future__ import annotations

import jax.numpy as jnp

from gdn2core import KernelConfig, get_backend
from gdn2core.spec import OpSpec

from .helpers import (
    GRAD_NAMES,
    TOL,
    make_inputs,
    outputs_and_grads,
    reference_value_and_grad,
    rel_err,
)


def _method(name, args, config):
    backend = get_backend(name)
    spec = OpSpec.from_inputs(*args[:6], None, args[6])

    def fn(q, k, v, w, b, g, h0):
        return backend.forward_trainable(q, k, v, w, b, g, h0, spec=spec, config=config)

    return fn


def test_hybrid_forward_matches_reference():
    config = KernelConfig(bt=16, bc=8, mb=8, interpret=True, hybrid_forward=True)
    args, do, dh = make_inputs(1, 40, 2, 64, 128, jnp.float32)
    o_ref, hT_ref, g_ref = reference_value_and_grad(args, do, dh)
    o, h_final, grads = outputs_and_grads(_method("pallas_tpu", args, config), args, do, dh)
    assert rel_err(o, o_ref) < TOL["float32"]["o"]
    assert rel_err(h_final, hT_ref) < TOL["float32"]["h_final"]
    for name, gx, gr in zip(GRAD_NAMES, grads, g_ref, strict=True):
        assert rel_err(gx, gr) < TOL["float32"]["grad"], name


def test_wy_eps_matches_jax_ref():
    """wy_eps = 1e-2 biases the operator by O(eps) (docs/algorithm.md 5.3); both backends must apply
    the same damping in the forward and the backward."""
    pallas = KernelConfig(bt=16, bc=8, mb=8, wy_eps=1e-2, interpret=True)
    ref = KernelConfig(bt=16, bc=8, mb=8, wy_eps=1e-2)
    args, do, dh = make_inputs(1, 40, 2, 64, 64, jnp.float32)
    o_r, hT_r, g_r = outputs_and_grads(_method("jax_ref", args, ref), args, do, dh)
    o_u, _, _ = reference_value_and_grad(args, do, dh)
    assert rel_err(o_r, o_u) > 1e-4  # the damping is visible
    o, h_final, grads = outputs_and_grads(_method("pallas_tpu", args, pallas), args, do, dh)
    assert rel_err(o, o_r) < TOL["float32"]["o"]
    assert rel_err(h_final, hT_r) < TOL["float32"]["h_final"]
    for name, gx, gr in zip(GRAD_NAMES, grads, g_r, strict=True):
        assert rel_err(gx, gr) < TOL["float32"]["grad"], name
