"""Backend discovery (entry points of ``gdn2.backends``, driven by pluggy) and lookup.

Rules (docs/backends.md states them for users):

- Discovery runs once, lazily, on first use. Each plugin is loaded, asked for its backend, and its
  backend's fields validated on its own: one that fails to import, raises, or hands over a
  malformed backend is listed as broken with a one-line reason and never affects the others.
- Hooks run outside the registry's lock, and a hook may call back into the registry (a wrapper
  backend's ``gdn2_backend()`` may call :func:`get_backend`): the name it asks for is loaded on
  demand.
- Names: when several distributions provide the same backend name, a first-party one wins and the
  others are listed as shadowed. A distribution is first-party when it requires ``gdn2core`` at
  exactly this gdn2core's version (``gdn2core==X.Y.Z``), as every distribution built from the gdn2
  repository does. Without exactly one first-party provider, every provider of that name is listed
  as conflicting, with its distribution, and the name cannot be used until all but one are
  uninstalled. Other names are unaffected.
- :func:`register_backend` adds an in-process backend; it takes precedence over a discovered one
  of the same name only with ``replace=True``.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.metadata as md
import logging
import re
import threading
from collections.abc import Mapping
from typing import Any

import pluggy

from gdn2core.backend import Backend, Capabilities, short_error, validate_backend
from gdn2core.hooks import BACKENDS_GROUP, PROJECT, HookSpecs
from gdn2core.install import backend_hint
from gdn2core.platform import default_platform
from gdn2core.verdict import verdict

log = logging.getLogger("gdn2core")


class BackendNotFoundError(LookupError):
    """A backend was named that is not installed, failed to load, or whose name is contested."""


class BackendUnsupportedError(ValueError):
    """The named backend is installed but would not run this call here."""


class Status(enum.StrEnum):
    """The state of one discovered provider of a backend name."""

    OK = "ok"
    BROKEN = "broken"  # failed to import, raised, or handed over a malformed backend
    SHADOWED = "shadowed"  # a first-party distribution provides the same name
    CONFLICT = "conflict"  # several providers of the name, none (or several) first-party


@dataclasses.dataclass(frozen=True, slots=True)
class BackendInfo:
    """One row of :func:`list_backends`: a provider of a backend name and what a call would do.

    Attributes:
        name: the backend name.
        version: the providing distribution's version (``"in-process"`` for
            :func:`register_backend`).
        distribution: the providing distribution's name ("" for an in-process backend).
        source: where it came from (entry point and distribution, or ``register_backend``).
        status: ok, broken, shadowed or conflict.
        priority: its priority (None when broken).
        capabilities: its capabilities (None when broken).
        available: whether a call naming it, on this host's default device with the default
            config, would run.
        reason: why not ("" when available).
        auto: whether ``backend="auto"`` may pick it here.
        auto_reason: why not ("" when it may).
    """

    name: str
    version: str
    distribution: str
    source: str
    status: Status
    priority: int | None
    capabilities: Capabilities | None
    available: bool
    reason: str
    auto: bool
    auto_reason: str

    @property
    def broken(self) -> bool:
        """True unless the status is ok."""
        return self.status is not Status.OK


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    """One provider of a name: a loaded plugin, a broken one, or an in-process backend."""

    name: str
    version: str
    distribution: str
    source: str
    first_party: bool
    backend: Backend | None
    error: str = ""
    plugin: Any = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Slot:
    """Every provider of one name, and the one the name resolves to (None: unusable)."""

    winner: _Entry | None
    rows: tuple[tuple[_Entry, Status, str], ...]
    reason: str  # why the name is unusable ("" when it resolves)


def _core_version() -> str | None:
    try:
        return md.version("gdn2core")
    except md.PackageNotFoundError:
        return None


_PIN = re.compile(r"\s*gdn2core\s*==\s*([^\s;,]+)\s*")


def _is_first_party(dist: md.Distribution | None) -> bool:
    own = _core_version()
    if dist is None or own is None:
        return False
    for req in dist.requires or ():
        match = _PIN.fullmatch(req)
        if match and match.group(1) == own:
            return True
    return False


class _Discovery:
    """Loads the ``gdn2.backends`` plugins, one name at a time, each in isolation."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(HookSpecs)
        self.eps: dict[str, list[md.EntryPoint]] = {}
        for ep in md.entry_points(group=BACKENDS_GROUP):
            self.eps.setdefault(ep.name, []).append(ep)
        self.done: dict[str, list[_Entry]] = {}
        self.running: set[str] = set()

    def entries(self, name: str) -> list[_Entry]:
        """The providers of ``name``, loaded now if they were not yet."""
        if name in self.done:
            return self.done[name]
        if name in self.running:  # a hook asked for its own name (or a cycle of wrappers)
            return []
        self.running.add(name)
        try:
            found = [self._load(ep) for ep in self.eps.get(name, ())]
        finally:
            self.running.discard(name)
        self.done[name] = found
        return found

    def all(self) -> dict[str, list[_Entry]]:
        for name in self.eps:
            self.entries(name)
        return dict(self.done)

    def _load(self, ep: md.EntryPoint) -> _Entry:
        dist = ep.dist
        dist_name = dist.metadata["Name"] if dist is not None else "unknown"
        version = dist.version if dist is not None else "unknown"
        source = f"entry point {ep.value} ({dist_name} {version})"
        first_party = _is_first_party(dist)
        try:
            plugin = ep.load()
            if not self.pm.is_registered(plugin):
                self.pm.register(plugin, name=f"{dist_name}:{ep.name}:{ep.value}")
            impls = [i for i in self.pm.hook.gdn2_backend.get_hookimpls() if i.plugin is plugin]
            if len(impls) != 1:
                raise TypeError(
                    f"plugin {ep.value} must implement gdn2_backend() once, found {len(impls)}"
                )
            backend = validate_backend(impls[0].function())
            if backend.name != ep.name:
                raise ValueError(
                    f"name: the entry point is {ep.name!r} but the backend is named "
                    f"{backend.name!r}"
                )
        except Exception as err:  # a broken plugin is listed, never fatal
            reason = f"broken: {short_error(err)}"
            log.warning("gdn2 backend plugin %r (%s) is unusable: %s", ep.name, dist_name, reason)
            return _Entry(ep.name, version, dist_name, source, first_party, None, reason)
        return _Entry(ep.name, version, dist_name, source, first_party, backend, "", plugin)


_lock = threading.Lock()
_local = threading.local()  # .active: the _Discovery this thread is running, if any
_discovery: _Discovery | None = None
_in_process: dict[str, _Entry] = {}


def _discovered(name: str | None = None) -> Mapping[str, list[_Entry]]:
    """Discovered providers by name (all names, or at least ``name``). Hooks run unlocked."""
    global _discovery
    active: _Discovery | None = getattr(_local, "active", None)
    if active is not None:  # a plugin's hook called back into the registry
        if name is not None:
            return {name: active.entries(name)}
        return active.all()
    with _lock:
        done = _discovery
    if done is not None:
        return done.done
    fresh = _Discovery()
    _local.active = fresh
    try:
        fresh.all()
    finally:
        _local.active = None
    with _lock:
        if _discovery is None:
            _discovery = fresh
        return _discovery.done


def _resolve(name: str, entries: list[_Entry]) -> _Slot:
    if len(entries) == 1:
        (only,) = entries
        status = Status.OK if only.backend is not None else Status.BROKEN
        winner = only if only.backend is not None else None
        return _Slot(winner, ((only, status, only.error),), only.error)
    firsts = [e for e in entries if e.first_party]
    if len(firsts) == 1:
        (first,) = firsts
        status = Status.OK if first.backend is not None else Status.BROKEN
        shadow = (
            f"shadowed: the name {name!r} belongs to the first-party {first.distribution} "
            f"{first.version}; this provider is ignored"
        )
        rows = [(first, status, first.error)]
        rows += [(e, Status.SHADOWED, shadow) for e in entries if e is not first]
        return _Slot(first if first.backend is not None else None, tuple(rows), first.error)
    listing = ", ".join(sorted(f"{e.distribution} {e.version}" for e in entries))
    reason = (
        f"conflict: {len(entries)} distributions provide the backend {name!r} ({listing}); "
        "uninstall all but one"
    )
    return _Slot(None, tuple((e, Status.CONFLICT, reason) for e in entries), reason)


def _slots(name: str | None = None) -> dict[str, _Slot]:
    by_name = {n: _resolve(n, es) for n, es in _discovered(name).items() if es}
    with _lock:
        in_process = dict(_in_process)
    for n, entry in in_process.items():
        by_name[n] = _Slot(entry, ((entry, Status.OK, ""),), "")
    return by_name


def refresh() -> None:
    """Forget the discovered plugins, so that the next lookup discovers them again (e.g. after
    installing one in this process). In-process registrations are kept."""
    global _discovery
    with _lock:
        _discovery = None


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Register an in-process backend instance (a third party's, or a test's).

    Args:
        backend: the instance; its fields are validated as at discovery.
        replace: allow taking a name that is already registered or discovered.

    Raises:
        TypeError, ValueError: a malformed backend (the message names the field).
        ValueError: the name is taken and ``replace`` is false.
    """
    validate_backend(backend)
    name = backend.name
    slots = _slots(name)
    if name in slots and not replace:
        where = "; ".join(e.source for e, _, _ in slots[name].rows)
        raise ValueError(
            f"backend {name!r} is already registered ({where}); pass replace=True to override"
        )
    entry = _Entry(name, "in-process", "", "register_backend", False, backend)
    with _lock:
        _in_process[name] = entry


def unregister_backend(name: str) -> None:
    """Remove a backend added by :func:`register_backend`.

    Args:
        name: its name.

    Raises:
        KeyError: no backend of that name was added by ``register_backend``.
    """
    with _lock:
        if _in_process.pop(name, None) is None:
            raise KeyError(f"backend {name!r} was not added by register_backend")


def _info(entry: _Entry, status: Status, reason: str) -> BackendInfo:
    backend = entry.backend
    if status is not Status.OK or backend is None:
        return BackendInfo(
            entry.name, entry.version, entry.distribution, entry.source, status,
            None, None, False, reason, False, reason,
        )  # fmt: skip
    here = default_platform()
    named = verdict(backend, None, None, trainable=False, auto=False, platform=here)
    auto = verdict(backend, None, None, trainable=False, auto=True, platform=here)
    return BackendInfo(
        entry.name, entry.version, entry.distribution, entry.source, status,
        backend.priority, backend.capabilities, named.ok, named.reason, auto.ok, auto.reason,
    )  # fmt: skip


def list_backends() -> list[BackendInfo]:
    """Every discovered or registered provider of a backend, and what a call would do here.

    Returns:
        One :class:`BackendInfo` per provider: usable ones first, highest priority first, then
        broken, shadowed and conflicting ones.
    """
    infos = [
        _info(e, status, reason) for slot in _slots().values() for e, status, reason in slot.rows
    ]
    return sorted(infos, key=lambda i: (i.broken, -(i.priority or 0), i.name, i.distribution))


def installed_names() -> list[str]:
    """Names that resolve to a loaded backend, sorted.

    Returns:
        The names :func:`get_backend` accepts.
    """
    return sorted(n for n, s in _slots().items() if s.winner is not None)


def get_backend(name: str) -> Backend:
    """The backend instance registered under ``name``.

    Args:
        name: a backend name (see :func:`list_backends`).

    Returns:
        The backend.

    Raises:
        BackendNotFoundError: not installed (the message lists what is, and how to install it),
            broken, or contested by several distributions (the message says which).
    """
    if not isinstance(name, str):
        raise TypeError(f"backend: expected a backend name, got {type(name).__name__}")
    slot = _slots(name).get(name)
    if slot is None:
        installed = ", ".join(installed_names()) or "none"
        raise BackendNotFoundError(
            f"gdn2 backend {name!r} is not installed (installed: {installed}); {backend_hint(name)}"
        )
    if slot.winner is None or slot.winner.backend is None:
        raise BackendNotFoundError(f"gdn2 backend {name!r} cannot be used: {slot.reason}")
    return slot.winner.backend


def usable_backends() -> list[Backend]:
    """The backends that names resolve to, highest priority first.

    Returns:
        Loaded backends (their verdict for a given call is separate: :mod:`gdn2core.verdict`).
    """
    out = [s.winner.backend for s in _slots().values() if s.winner and s.winner.backend]
    return sorted(out, key=lambda be: (-be.priority, be.name))


def plugin_hook(name: str, hook: str, **kwargs: Any) -> list[Any]:
    """Call ``hook`` on the plugin module that provides backend ``name`` only.

    Args:
        name: a backend name.
        hook: a hook of :class:`gdn2core.hooks.HookSpecs` (e.g. ``"gdn2_kernel_costs"``).
        **kwargs: the hook's arguments.

    Returns:
        The non-None results (empty for an in-process backend or a plugin without the hook).
    """
    slot = _slots(name).get(name)
    if slot is None or slot.winner is None or slot.winner.plugin is None:
        return []
    with _lock:
        discovery = _discovery
    if discovery is None:
        return []
    caller = getattr(discovery.pm.hook, hook)
    results = []
    for impl in caller.get_hookimpls():
        if impl.plugin is slot.winner.plugin:
            out = impl.function(**{a: kwargs[a] for a in impl.argnames})
            if out is not None:
                results.append(out)
    return results
