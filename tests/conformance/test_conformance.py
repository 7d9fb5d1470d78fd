"""gdn2's own backends through the conformance kit (gdn2_conformance): one line per target.

The cases, tolerances (with their reasons) and checks live in the kit, so that these targets and
a third party's backend (``gdn2 conformance NAME``) are held to the same suite. A target claims
what its backend declares (``features=None``: jax_ref also decode and chunk states); an explicit
claim never includes a gated feature the backend does not declare (``Capabilities.segments`` /
``varlen`` / ``fused_activations`` / ``decode`` / ``chunk_states``).
"""

from __future__ import annotations

import pytest
from jax.experimental.pallas import tpu as pltpu

from gdn2_conformance import SMALL_CONFIG, ConformanceSuite, Feature, Target
from gdn2_pallas_tpu import PallasTpuConfig
from gdn2core import KernelConfig

HEADS = ((8, 8), (8, 12), (12, 6))


class TestJaxRef(ConformanceSuite):
    targets = (
        Target("jax_ref", SMALL_CONFIG, HEADS),
        Target("jax_ref", KernelConfig(), ((16, 16), (16, 32)), quick=True, name="jax_ref-default"),
    )


class TestScanBaseline(ConformanceSuite):
    targets = (Target("scan_baseline", SMALL_CONFIG, HEADS),)


class TestPallasTpuInterpret(ConformanceSuite):
    """The Pallas TPU kernels on the CPU in TPU interpret mode (``pltpu.InterpretParams()``); the
    same kernels are compiled for real TPU targets in tests/pallas_tpu/test_compile.py. No float64
    (not a capability), no chunk states (not a capability yet; the explicit claim drops it); vmap
    claimed although interpret mode (the kernels fold vmap into the batch axis)."""

    targets = (
        Target(
            "pallas_tpu",
            KernelConfig(bt=16, interpret=True),
            ((64, 64), (64, 128), (128, 64)),
            frozenset(Feature) - {Feature.FLOAT64},
            quick=True,
            name="pallas_tpu-interpret",
        ),
    )


class TestPallasTpuRaces(ConformanceSuite):
    """The same kernels in TPU interpret mode with its race detector on, two simulated cores and
    the "parallel" grid axes (batch, head group; decode head blocks) in a random order
    (``PallasTpuConfig``'s interpret knobs): a race raises in the interpreter (``RACE
    DETECTED``) and fails the test. tests/pallas_tpu/test_races.py runs every kernel so with
    shapes that keep both cores busy, each checked against the reference, in CI; this target runs
    the suite so, in the long sweeps (`make test-slow`, tests/tiers.py). The interpreter's state
    is reset around every test, also after one that raised inside a kernel (its docs require
    it)."""

    targets = (
        Target(
            "pallas_tpu",
            PallasTpuConfig(
                bt=16,
                interpret=True,
                interpret_detect_races=True,
                interpret_cores=2,
                interpret_seed=2024,
            ),
            ((64, 64), (64, 128), (128, 64)),
            frozenset(Feature) - {Feature.FLOAT64},
            quick=True,
            name="pallas_tpu-races",
        ),
    )

    @pytest.fixture(autouse=True)
    def _fresh_interpreter(self):
        pltpu.reset_tpu_interpret_mode_state()
        yield
        pltpu.reset_tpu_interpret_mode_state()
