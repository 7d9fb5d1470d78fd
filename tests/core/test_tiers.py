"""The quick tier (`make test`, tests/tiers.py) still runs every backend and every option once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.tiers import is_full, is_slow

ROOT = Path(__file__).resolve().parents[2]
#: What each of our conformance targets must run in the quick tier (the features it claims; the
#: fused activations are claimed by the backend that fuses them, the core's XLA path is
#: tests/core/test_features.py).
MUST_RUN = {
    "jax_ref": ("forward", "gradients", "bfloat16", "float64_central_differences", "gva",
                "segments", "varlen", "decode", "chunk_states"),
    "scan_baseline": ("forward", "gradients", "gva", "segments", "varlen"),
    "pallas_tpu-interpret": ("forward", "gradients", "bfloat16", "gva", "segments", "varlen",
                             "fused_activations", "fused_activations_gradients", "decode"),
}  # fmt: skip


def _quick_conformance_ids() -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow and not full",
           "-p", "no:xdist", "tests/conformance/test_conformance.py"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "::" in line]


def test_every_backend_and_option_runs_in_the_quick_tier():
    ids = _quick_conformance_ids()
    for target, checks in MUST_RUN.items():
        ran = {i.split("::")[-1].split("[")[0].removeprefix("test_")
               for i in ids if f"[{target}" in i and f"[{target}-default" not in i}  # fmt: skip
        missing = [c for c in checks if c not in ran]
        assert not missing, f"{target}: the quick tier runs no {missing}"


def test_the_rules():
    conformance = "tests/conformance/test_conformance.py::TestJaxRef::"
    assert not is_full(f"{conformance}test_forward[jax_ref-B1T5]", True)
    assert is_full(f"{conformance}test_forward[jax_ref-B2T9]", False)  # a second case
    assert is_full(f"{conformance}test_jit_vmap_grad[jax_ref]", True)
    assert is_full("tests/multidevice/test_multidevice.py::test_eight_simulated_devices", True)
    assert not is_full("tests/core/test_spec.py::test_shapes", True)
    # the second targets, whole: the long sweeps; the other targets and files stay
    assert is_slow(f"{conformance}test_forward[jax_ref-default-B1T5]")
    assert is_slow(f"{conformance}test_jit_vmap_grad[jax_ref-default]")
    races = "tests/conformance/test_conformance.py::TestPallasTpuRaces::"
    assert is_slow(f"{races}test_varlen_no_leakage[pallas_tpu-races]")
    assert is_slow(f"{races}test_gradients[pallas_tpu-races-B1T33H1k64v128-h0-b1-strong-s2]")
    assert not is_slow(f"{conformance}test_forward[jax_ref-B1T5]")
    assert not is_slow(f"{conformance}test_jit_vmap_grad[jax_ref]")
    assert not is_slow("tests/pallas_tpu/test_races.py::test_kernel_is_race_free[train_B2_H1]")
