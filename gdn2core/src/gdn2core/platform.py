"""Which platform a call runs on."""

from __future__ import annotations

import functools
import os
from typing import Any

import jax


def _normalise(platform: str) -> str:
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


@functools.cache
def default_platform() -> str:
    """The platform of JAX's default devices.

    Returns:
        ``"cpu"``, ``"gpu"`` or ``"tpu"``.
    """
    return _normalise(jax.devices()[0].platform)


def is_tpu_available() -> bool:
    """Whether JAX's default devices are TPUs.

    Returns:
        True on a TPU host.
    """
    try:
        return default_platform() == "tpu"
    except RuntimeError:
        return False


def call_platform(x: Any) -> str | None:
    """The platform a call on input ``x`` runs on.

    Args:
        x: the first input array of the call.

    Returns:
        The platform of ``x``'s devices for a concrete array, the default platform for a host
        array, and None for a tracer: inside ``jax.jit`` the platform is decided when the program
        is lowered (a CPU host may lower for a TPU).
    """
    if isinstance(x, jax.core.Tracer):
        return None
    devices = getattr(x, "devices", None)
    if callable(devices):
        try:
            found = devices()
        except Exception:  # e.g. a deleted array: let the call itself report that
            found = ()
        if found:
            return _normalise(next(iter(found)).platform)
    return default_platform()


def device_memory_bytes() -> int:
    """Memory of the default device.

    Returns:
        Its allocator limit, else (a CPU) the host's physical memory, in bytes.
    """
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # some platforms do not implement memory_stats
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
