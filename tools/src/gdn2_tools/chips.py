"""The TPU chips the tools compile for and price: one table, read by the topologies of the
deviceless compiles (tpu.py), the clocks of the static profile (static_profile.py), the rooflines
(tpu_estimate.py, tpu_report.py) and the HBM bounds of the decode and serving benches.

Per chip (one JAX device): bf16 matmul FLOP/s and HBM bytes/s are the published figures; the
clock turns the profiler's cycles into time. v5e: 197 TFLOP/s / (4 MXUs x 128 x 128 x 2) =
1.5 GHz. v6e: not published; 918 TFLOP/s / (4 x 256 x 256 x 2) = 1.75 GHz matches what the
profiler charges for a bf16 matmul. v5p: 459 TFLOP/s / (2 TensorCores x 4 MXUs x 128 x 128 x 2)
= 1.75 GHz, the published clock; its two cores (megacore) are one device, and the profile
simulates both (a kernel's "parallel" grid points split between them, the chip's cycles are
those of the busier core). The profiler's bf16 8192^3 matmul estimates 1.04x (v5e), 1.11x (v6e),
1.05x (v5p) of these peaks; HBM time is modelled on v5e only (an HBM-bound add estimates 0.90x
of 819 GB/s there, 0.14x of v6e's and 0.12x of v5p's), so HBM-bound ops read as too fast on v6e
and v5p.
"""

from __future__ import annotations

import dataclasses
from typing import Final


@dataclasses.dataclass(frozen=True, slots=True)
class Chip:
    """One TPU chip (a JAX device) as the tools see it.

    Attributes:
        topology: the one-chip topology of a deviceless compile (``get_topology_desc``).
        clock_hz: the TensorCore clock (cycles of the static profile to seconds).
        peak_flops: bf16 matmul FLOP/s of the chip (all its TensorCores).
        hbm_bytes_per_s: HBM bandwidth of the chip.
        tensor_cores: TensorCores per device (they split a kernel's "parallel" grid points).
    """

    topology: str
    clock_hz: float
    peak_flops: float
    hbm_bytes_per_s: float
    tensor_cores: int = 1


CHIPS: Final = {
    "v5e": Chip("v5e:1x1", 1.5e9, 197e12, 819e9),
    "v6e": Chip("v6e:1x1", 1.75e9, 918e12, 1640e9),
    "v5p": Chip("v5p:1x1x1", 1.75e9, 459e12, 2765e9, tensor_cores=2),
}
