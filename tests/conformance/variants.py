"""The backends the conformance suite runs, each with its capability flags.

A variant is a backend name plus a config and what it can do; the suite derives its cases from the
flags (head sizes, dtypes, float64, trainability) and the chunk length (T shorter than a chunk, T
not a multiple of it). Adding a backend to the suite is adding a line here.
"""

from __future__ import annotations

import dataclasses

from gdn2core import KernelConfig

SMALL = KernelConfig(bt=16, bc=8, mb=4)  # small chunks: several chunks at tiny T, fast on CPU


@dataclasses.dataclass(frozen=True)
class Variant:
    id: str
    backend: str
    config: KernelConfig
    head_sizes: tuple[tuple[int, int], ...]  # (dk, dv) pairs, the first one square
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    float64: bool = True  # runs with x64 enabled (finite-difference checks)
    trainable: bool = True
    full: bool = True  # every case; False: the quick subset (expensive variants)
    vmap: bool = True  # jax.vmap of the call runs here


VARIANTS: tuple[Variant, ...] = (
    Variant("jax_ref", "jax_ref", SMALL, head_sizes=((8, 8), (8, 12), (12, 6))),
    Variant(
        "jax_ref-default-config",
        "jax_ref",
        KernelConfig(),
        head_sizes=((16, 16), (16, 32)),
        full=False,
    ),
    Variant("scan_baseline", "scan_baseline", SMALL, head_sizes=((8, 8), (8, 12), (12, 6))),
    # The Pallas TPU kernels on the CPU through TPU interpret mode (pltpu.InterpretParams()); the
    # same kernels are compiled for real TPU targets in tests/pallas_tpu/test_compile.py.
    Variant(
        "pallas_tpu-interpret",
        "pallas_tpu",
        KernelConfig(bt=16, bc=8, mb=8, interpret=True),
        head_sizes=((64, 64), (64, 128), (128, 64)),
        float64=False,
        full=False,
        # JAX's TPU interpret mode does not batch a pallas_call's dimension_semantics, so vmap
        # runs only on the TPU compile path (tests/pallas_tpu/test_compile.py compiles it).
        vmap=False,
    ),
)
