"""pallas_tpu kernels in TPU interpret mode (``KernelConfig(interpret=True)``) against the
token-serial reference: o, h_final and the seven gradients of sum(o*dO) + sum(h_final*dh)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from gdn2core import DEFAULT_CONFIG, SHORT_CHUNKS, KernelConfig, gdn2_forward, get_backend
from gdn2core.ops.forward.spec import OpSpec

from .helpers import (
    GRAD_NAMES,
    TOL,
    make_inputs,
    outputs_and_grads,
    reference_value_and_grad,
    rel_err,
)

SMALL = KernelConfig(bt=16, interpret=True)
C32 = KernelConfig(bt=32, interpret=True)

# (T, H, dk, dv, dtype, with_h0, config, strong). The plan puts hb heads (the largest divisor of
# H up to 8) and up to 24 / hb chunks in a grid step: H=2 runs 2 heads x 4 chunks, H=3 and H=6
# several heads with padding of T to whole steps, H=8 8 heads x 3 chunks. T=1 and T below a chunk
# run one chunk per step; T=200 at C=16 runs several steps (the carried state and dS), with the
# chain of entry states inside a step; T=300 bf16 runs three steps from states saved in bfloat16.
CASES = {
    "T1_H2_d64_f32": (1, 2, 64, 64, "float32", True, SMALL, 0.1),
    "T16_H2_k64v128_f32_noh0": (16, 2, 64, 128, "float32", False, SMALL, 0.1),
    "T40_H8_k128v64_f32": (40, 8, 128, 64, "float32", True, SMALL, 0.1),
    "T200_H2_d64_f32_several_steps": (200, 2, 64, 64, "float32", True, SMALL, 0.1),
    "T100_H3_k64v128_f32_C32": (100, 3, 64, 128, "float32", True, C32, 0.1),
    "T48_H2_d128_f32_strong_decay": (48, 2, 128, 128, "float32", True, SMALL, 0.6),
    "T50_H2_d64_bf16": (50, 2, 64, 64, "bfloat16", True, SMALL, 0.1),
    "T300_H2_d128_bf16_several_steps": (300, 2, 128, 128, "bfloat16", True, SMALL, 0.1),
    "T150_H6_k64v128_bf16_noh0": (150, 6, 64, 128, "bfloat16", False, SMALL, 0.1),
    "T130_H2_d64_f32_default_config": (
        130, 2, 64, 64, "float32", True, DEFAULT_CONFIG.model_copy(update={"interpret": True}), 0.1,
    ),
    "T70_H2_d64_bf16_small_preset": (
        70, 2, 64, 64, "bfloat16", True, SHORT_CHUNKS.model_copy(update={"interpret": True}), 0.1,
    ),
}  # fmt: skip


def _run_backend(args, config, trainable):
    backend = get_backend("pallas_tpu")
    spec = OpSpec.from_inputs(*args[:6], None, args[6])
    method = backend.forward_trainable if trainable else backend.forward

    def fn(q, k, v, w, b, g, h0):
        return method(q, k, v, w, b, g, h0, spec=spec, config=config)

    return fn


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_match_reference(case):
    T, H, dk, dv, dtype, with_h0, config, strong = CASES[case]
    args, do, dh = make_inputs(1, T, H, dk, dv, getattr(jnp, dtype), strong=strong, with_h0=with_h0)
    o_ref, hT_ref, g_ref = reference_value_and_grad(args, do, dh)
    tol = TOL[dtype]
    o, h_final, grads = outputs_and_grads(_run_backend(args, config, True), args, do, dh)
    assert o.dtype == args[2].dtype and o.shape == o_ref.shape
    assert h_final.dtype == jnp.float32
    assert rel_err(o, o_ref) < tol["o"], rel_err(o, o_ref)
    assert rel_err(h_final, hT_ref) < tol["h_final"], rel_err(h_final, hT_ref)
    for name, gx, gr, x in zip(GRAD_NAMES, grads, g_ref, args, strict=True):
        assert gx.dtype == x.dtype and gx.shape == x.shape, name
        assert np.all(np.isfinite(np.asarray(gx, np.float32))), name
        err = rel_err(gx, gr)
        assert err < tol["grad"], f"d{name}: rel err {err:.2e} >= {tol['grad']:.0e}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_inference_forward_very_strong_decay_without_clip(dtype):
    """The inference kernel (no residuals) at g = -30 on every entry: the split
    exp(Γ_r) exp(-Γ_s) would overflow (|Γ_C| = 480 at C=16); the kernels form only exponents
    <= 0 (scores and inverse by levels), so the result is finite and exact."""
    args, do, dh = make_inputs(1, 40, 2, 64, 128, getattr(jnp, dtype), strong=1.0)
    o_ref, hT_ref, _ = reference_value_and_grad(args, do, dh)
    o, h_final = gdn2_forward(*args[:6], None, args[6], SMALL, backend="pallas_tpu")
    assert np.all(np.isfinite(np.asarray(o, np.float32)))
    assert rel_err(o, o_ref) < TOL[dtype]["o"]
    assert rel_err(h_final, hT_ref) < TOL[dtype]["h_final"]


def test_matmul_precision_per_dtype():
    """float32 inputs run bf16x3 products (written out in interpret mode, Mosaic's bf16x3 on a
    TPU), bfloat16 inputs one bf16 pass; residuals are stored in the dtype their readers round
    to."""
    from gdn2_pallas_tpu.matmul import MatmulPrecision
    from gdn2_pallas_tpu.plan import make_plan

    f32 = make_plan(OpSpec(1, 64, 2, 64, 64, "float32", 0.125), SMALL)
    assert {f32.precisions.scores, f32.precisions.state} == {MatmulPrecision.BF16X3_SPLIT}
    assert f32.residual_dtype == jnp.float32
    on_tpu = make_plan(
        OpSpec(1, 64, 2, 64, 64, "float32", 0.125), SMALL.model_copy(update={"interpret": False})
    )
    assert on_tpu.precisions.inverse is MatmulPrecision.BF16X3
    bf16 = make_plan(OpSpec(1, 64, 2, 64, 64, "bfloat16", 0.125), SMALL)
    assert bf16.precisions.inverse is MatmulPrecision.BF16 and bf16.residual_dtype == jnp.bfloat16
