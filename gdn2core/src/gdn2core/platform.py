"""Which accelerator this process runs on."""

from __future__ import annotations

import functools

import jax


@functools.cache
def default_platform() -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: the platform of ``jax.devices()[0]``."""
    platform = jax.devices()[0].platform
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def is_tpu_available() -> bool:
    """True when JAX's default devices are TPUs."""
    try:
        return default_platform() == "tpu"
    except RuntimeError:
        return False
