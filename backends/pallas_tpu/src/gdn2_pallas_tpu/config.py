"""``PallasTpuConfig``: pallas_tpu's own config.

The Pallas kernels read only the core fields: ``bt`` (the chunk length C of the level scheme; one
of ``plan.SUPPORTED_CHUNKS``, checked by ``supports()``), ``wy_eps`` (the WY damping) and
``interpret`` (TPU interpret mode, for tests off a TPU). Their scheme forms scores and the WY
inverse by levels (docs/algorithm.md), so they have no score sub-chunk, no WY micro-block and no
clip (it never forms a positive exponent: chunk_math.py); the rest of a call's blocking (heads and
chunks per grid step, the VMEM limit) follows from the shape and the VMEM byte model (plan.py,
decode_plan.py), not from a knob. So the class adds no field: it is the class this backend owns,
so that a config meant for it says so, and a config meant for another backend is refused.

The backend reads its config only through :meth:`PallasTpuConfig.from_config` (plan.py and
decode_plan.py; backend.py through their checks): a core ``KernelConfig`` becomes a
``PallasTpuConfig`` with the same fields, and another backend's config class (a ``JaxRefConfig``,
say) is refused by name: ``config: expected a KernelConfig or PallasTpuConfig, got JaxRefConfig``
(a refusing verdict from ``supports()`` / ``supports_decode()``, a ``TypeError`` from the plans).
"""

from __future__ import annotations

from gdn2core.plugin import KernelConfig


class PallasTpuConfig(KernelConfig):
    """The core fields only (``bt``, ``wy_eps``, ``interpret``; module docstring). Frozen,
    hashable, strict and closed like the core class."""
