"""gdn2's own backends through the conformance kit (gdn2_conformance): one line per target.

The cases, tolerances (with their reasons) and checks live in the kit, so that these targets and
a third party's backend (``gdn2 conformance NAME``) are held to the same suite. A target claims
what its backend declares (``features=None``: jax_ref also decode and chunk states); an explicit
claim never includes a gated feature the backend does not declare (``Capabilities.segments`` /
``varlen`` / ``fused_activations`` / ``decode`` / ``chunk_states``).
"""

from __future__ import annotations

from gdn2_conformance import SMALL_CONFIG, ConformanceSuite, Feature, Target
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
