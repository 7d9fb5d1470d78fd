"""The conformance kit itself: it fails a subtly wrong backend naming the capability, it derives a
target from an installed backend's capabilities, and its metric and tolerances behave."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from gdn2_conformance import (
    GATED_FEATURES,
    Case,
    Feature,
    Quantity,
    Target,
    assert_close,
    make_inputs,
    rel_err,
    tolerance,
)
from gdn2_conformance.feature_suite import TOL_UNFUSED, unfused_tolerance
from gdn2core.registry import get_backend
from tests.support.plugins import installed_plugins, subprocess_env


def test_wrong_backend_fails_naming_the_capability(tmp_path):
    """``gdn2 conformance`` on a backend whose dg is half the true one: forward passes (its
    outputs are exact), trainable fails with dg named, and the exit code says so."""
    env = subprocess_env(tmp_path, "gdn2-wrong-backend")
    (tmp_path / "test_decoy.py").write_text("def test_decoy():\n    assert False\n")
    proc = subprocess.run(
        [sys.executable, "-m", "gdn2core.cli", "conformance", "wrong_grad"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600, check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    summary = [ln for ln in out.splitlines() if ln.startswith("wrong_grad: ")]
    assert summary, out
    assert "forward PASS" in summary[0] and "trainable FAIL" in summary[0], summary
    assert "not claimed: bfloat16, float64" in summary[0], summary
    assert "dg: relative error" in out and "> tolerance 3e-04" in out, out
    assert "test_decoy" not in out  # only the suite is collected, not the current directory


def _packing(name: str) -> set[Feature]:
    """The gated features (packed sequences, fused activations, decode, chunk states) the backend
    declares."""
    caps = get_backend(name).capabilities
    return {f for f, flag in GATED_FEATURES.items() if getattr(caps, flag)}


#: Resolved by the core for every backend: grouped value heads.
CORE_FEATURES = {Feature.GVA}


def test_target_is_derived_from_declared_capabilities(tmp_path):
    pallas = Target.for_backend("pallas_tpu")  # on this CPU host: interpret mode, no vmap
    assert pallas.config.interpret and pallas.head_sizes == ((64, 64), (64, 128), (128, 64))
    expected = {Feature.FORWARD, Feature.TRAINABLE, Feature.BFLOAT16} | CORE_FEATURES
    assert pallas.features == expected | _packing("pallas_tpu")
    assert {Feature.DECODE, Feature.CHUNK_STATES} <= pallas.features
    jax_ref = Target.for_backend("jax_ref")
    packing = _packing("jax_ref")
    assert jax_ref.features == set(Feature) - set(GATED_FEATURES) | packing
    assert not jax_ref.config.interpret
    assert {Feature.DECODE, Feature.CHUNK_STATES} <= jax_ref.features
    scan = Target.for_backend("scan_baseline")
    assert {Feature.SEGMENTS, Feature.VARLEN} <= scan.features
    assert Feature.FUSED_ACTIVATIONS not in scan.features  # the core applies them in XLA
    with installed_plugins(tmp_path, "gdn2-toy-backend"):
        toy = Target.for_backend("toy_serial")
    assert toy.head_sizes == ((4, 4), (4, 8), (8, 4))
    assert toy.features == {Feature.FORWARD, Feature.TRAINABLE, Feature.VMAP} | CORE_FEATURES


def test_a_target_claims_no_packing_its_backend_lacks():
    """An explicit claim of every feature is cut to what the backend declares; None means the
    declared features."""
    explicit = Target("jax_ref", features=frozenset(Feature))
    assert explicit.claimed() == set(Feature) - set(GATED_FEATURES) | _packing("jax_ref")
    assert Target("scan_baseline").claimed() == Target.for_backend("scan_baseline").features


def test_assert_close_names_array_error_and_tolerance():
    ref = np.linspace(1.0, 2.0, 10)
    assert_close("o", ref * (1 + 1e-6), ref, "float32")
    with pytest.raises(AssertionError, match=r"dg: relative error 1\.00e-02 > tolerance 3e-04"):
        assert_close("dg", ref + 0.02, ref, "float32")


def test_metric_and_tolerances():
    ref = np.linspace(-1.0, 2.0, 100)
    assert rel_err(ref, ref) == 0.0
    assert rel_err(ref + 0.02, ref) == pytest.approx(0.01)
    assert rel_err(np.full(100, np.nan), ref) == float("inf")
    with pytest.raises(ValueError, match="shape mismatch"):
        rel_err(ref[:5], ref)
    assert tolerance("float32", "o (fwd)") == tolerance("float32", Quantity.OUT) == 1e-4
    assert tolerance("float32", "dg") == 3e-4
    assert tolerance("float32", "dg", "tpu") == pytest.approx(3e-3)  # default-precision matmuls
    assert tolerance("bfloat16", "h_final", "tpu") == 3e-2


def test_the_fused_activation_bound_widens_off_a_cpu():
    """1e-5 where XLA computes the unfused activations and interpret mode the fused ones on a CPU;
    ten times that on a GPU or TPU, whose exp, log1p and rsqrt need not be correctly rounded: a TPU
    v5e gave 8.3e-5 (docs/results.md), which the CPU bound would fail and the TPU one passes."""
    assert unfused_tolerance("cpu") == TOL_UNFUSED == 1e-5
    assert unfused_tolerance("tpu") == unfused_tolerance("gpu") == pytest.approx(1e-4)
    assert unfused_tolerance("cpu") < 8.3e-5 < unfused_tolerance("tpu")


def test_one_generator_is_deterministic_and_honours_its_knobs():
    a, b = make_inputs(Case(seed=3)), make_inputs(Case(seed=3))
    assert all(np.array_equal(x, y) for x, y in zip(a.args, b.args, strict=True))
    strong = make_inputs(Case(T=200, decay="strong", seed=1))
    assert float(strong.g.min()) == -30.0
    weak = make_inputs(Case(decay="weak"))
    assert -1e-3 <= float(weak.g.min()) and float(weak.g.max()) <= 0
    model = make_inputs(Case(T=64, decay="model"))
    assert -20.0 < float(model.g.min()) and float(model.g.max()) < 0
    assert make_inputs(Case(h0=False)).h0 is None
    assert float(make_inputs(Case(b_max=2.0, T=200)).b.max()) > 1.0
