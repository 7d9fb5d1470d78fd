"""Backend discovery (entry points of ``gdn2.backends``, driven by pluggy) and lookup.

Discovery runs once, lazily, on first use. Every plugin is loaded and asked for its backend on its
own: one that fails to import or raises is recorded as broken with its error and never takes the
others down. ``register_backend`` adds an in-process backend on top of the discovered ones.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import logging
import threading
import traceback
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import pluggy

from gdn2core.backend import Backend, Capabilities, Verdict
from gdn2core.hooks import ENTRY_POINT_GROUP, PROJECT, BackendSpec

log = logging.getLogger("gdn2core")

#: Distributions of the first-party backends, for the "how to install" hint.
KNOWN_DISTRIBUTIONS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "jax_ref": "gdn2-jax-ref",
        "scan_baseline": "gdn2-scan-baseline",
        "pallas_tpu": "gdn2-pallas-tpu",
    }
)


@dataclasses.dataclass(frozen=True, slots=True)
class BackendInfo:
    """One row of ``list_backends()``."""

    name: str
    version: str
    available: bool
    reason: str  # why not available (or broken); empty when available
    priority: int | None
    capabilities: Capabilities | None
    source: str  # "entry point <value> (<distribution>)" or "register_backend"
    broken: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    info: BackendInfo
    backend: Backend | None  # None when broken


class BackendNotFoundError(LookupError):
    """A backend was named that is not installed (or failed to load)."""


class BackendUnsupportedError(ValueError):
    """The named backend is installed but cannot run this spec/config."""


_lock = threading.Lock()
_discovered: Mapping[str, _Entry] | None = None
_in_process: dict[str, _Entry] = {}


def _plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(BackendSpec)
    return pm


def _broken(name: str, version: str, source: str, err: BaseException) -> _Entry:
    msg = f"broken: {type(err).__name__}: {err}"
    log.warning("gdn2 backend plugin %r failed to load: %s", name, msg)
    log.debug("traceback of %r:\n%s", name, traceback.format_exc())
    info = BackendInfo(name, version, False, msg, None, None, source, broken=True)
    return _Entry(info, None)


def _entry_from_backend(backend: Backend, version: str, source: str) -> _Entry:
    if not isinstance(backend, Backend):
        raise TypeError(f"expected a gdn2core.Backend instance, got {type(backend).__name__}")
    avail = backend.availability()
    info = BackendInfo(
        name=backend.name,
        version=version,
        available=avail.ok,
        reason="" if avail.ok else avail.reason,
        priority=backend.priority,
        capabilities=backend.capabilities,
        source=source,
    )
    return _Entry(info, backend)


def _discover() -> Mapping[str, _Entry]:
    entries: dict[str, _Entry] = {}
    pm = _plugin_manager()
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        version = ep.dist.version if ep.dist is not None else "unknown"
        dist = ep.dist.name if ep.dist is not None else "?"
        source = f"entry point {ep.value} ({dist})"
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
            impls = [i for i in pm.hook.gdn2_backend.get_hookimpls() if i.plugin is plugin]
            if len(impls) != 1:
                raise TypeError(f"plugin {ep.value} must implement gdn2_backend() exactly once")
            backend = impls[0].function()
            entry = _entry_from_backend(backend, version, source)
        except Exception as err:  # a broken plugin is listed, never fatal
            entries[ep.name] = _broken(ep.name, version, source, err)
            continue
        if entry.info.name != ep.name:
            err = ValueError(f"entry point {ep.name!r} returned backend named {entry.info.name!r}")
            entries[ep.name] = _broken(ep.name, version, source, err)
            continue
        entries[ep.name] = entry
    return MappingProxyType(entries)


def _all() -> Mapping[str, _Entry]:
    global _discovered
    with _lock:
        if _discovered is None:
            _discovered = _discover()
        merged = dict(_discovered)
        merged.update(_in_process)
    return merged


def refresh() -> None:
    """Forget discovered plugins (e.g. after installing one in this process)."""
    global _discovered
    with _lock:
        _discovered = None


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Register an in-process backend instance (a third party's, or a test's).

    Raises ``ValueError`` if the name is taken and ``replace`` is false.
    """
    entry = _entry_from_backend(backend, "in-process", "register_backend")
    existing = _all()
    if entry.info.name in existing and not replace:
        raise ValueError(
            f"backend {entry.info.name!r} is already registered "
            f"({existing[entry.info.name].info.source}); pass replace=True to override"
        )
    with _lock:
        _in_process[entry.info.name] = entry


def unregister_backend(name: str) -> None:
    """Remove a backend added by ``register_backend``."""
    with _lock:
        if _in_process.pop(name, None) is None:
            raise KeyError(f"backend {name!r} was not added by register_backend")


def list_backends() -> list[BackendInfo]:
    """Every discovered or registered backend, highest priority first, broken ones last."""
    infos = [e.info for e in _all().values()]
    return sorted(infos, key=lambda i: (i.broken, -(i.priority or 0), i.name))


def install_hint(name: str) -> str:
    dist = KNOWN_DISTRIBUTIONS.get(name)
    if dist is None:
        return f"install the package that provides the {name!r} gdn2 backend"
    folder = name
    return f"pip install {dist}  (from a checkout: pip install -e backends/{folder})"


def get_backend(name: str) -> Backend:
    """The backend instance registered under ``name``.

    Raises :class:`BackendNotFoundError` listing the installed backends and how to install it.
    """
    entries = _all()
    entry = entries.get(name)
    if entry is None:
        installed = ", ".join(sorted(entries)) or "none"
        raise BackendNotFoundError(
            f"gdn2 backend {name!r} is not installed (installed: {installed}); {install_hint(name)}"
        )
    if entry.backend is None:
        raise BackendNotFoundError(f"gdn2 backend {name!r} failed to load: {entry.info.reason}")
    return entry.backend


def available_backends() -> list[Backend]:
    """Loaded, available backends, highest priority first."""
    out = [e.backend for e in _all().values() if e.backend is not None and e.info.available]
    return sorted(out, key=lambda be: -be.priority)


def availability_of(name: str) -> Verdict:
    entry = _all().get(name)
    if entry is None:
        return Verdict(False, "not installed")
    return Verdict(entry.info.available, entry.info.reason)
