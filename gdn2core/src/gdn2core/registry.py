"""Backend discovery (entry points of ``gdn2.backends``, driven by pluggy) and lookup, by the
rules of docs/backends.md: a plugin that fails is listed as broken, alone; hooks run unlocked and
may call back in; a first-party provider of a name shadows the others, or they all conflict.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import importlib.metadata as md
import logging
import threading

import pluggy

from gdn2core.backend import Backend, Capabilities, short_error, validate_backend
from gdn2core.hooks import BACKENDS_GROUP, PROJECT, HookSpecs
from gdn2core.install import backend_hint
from gdn2core.platform import default_platform
from gdn2core.verdict import judge

log = logging.getLogger("gdn2core")


class BackendNotFoundError(LookupError):
    """A backend was named that is not installed, failed to load, or whose name is contested."""


class BackendUnsupportedError(ValueError):
    """The named backend is installed but would not run this call here."""


class Status(enum.StrEnum):
    """The state of one provider of a backend name."""

    OK = "ok"
    BROKEN = "broken"  # failed to import, raised, or handed over a malformed backend
    SHADOWED = "shadowed"  # a first-party distribution provides the same name
    CONFLICT = "conflict"  # several providers of the name, none (or several) first-party


@dataclasses.dataclass(frozen=True, slots=True)
class BackendInfo:
    """One row of :func:`list_backends`: a provider of a backend name and whether a call naming it
    (``available``; ``reason``: why not) or ``backend="auto"`` (``auto``, ``auto_reason``) would
    run it here, with the default config; ``priority``, ``capabilities``: None unless ok."""

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


#: One provider of a name: its BackendInfo's first five fields, why it is not ok, what it loaded,
#: and whether it is first-party (requires ``gdn2core==`` this version, as gdn2's own do).
_Entry = collections.namedtuple(
    "_Entry", "name version distribution source status reason backend pm first_party",
    defaults=(Status.OK, "", None, None, False),
)  # fmt: skip


def _resolve(name: str, found: list[_Entry]) -> list[_Entry]:
    """Several providers of ``name``: one first-party one shadows the others, or all conflict."""
    firsts = [e for e in found if e.first_party]
    if len(found) < 2:
        return found
    if len(firsts) == 1:
        top, owner = firsts[0], f"{firsts[0].distribution} {firsts[0].version}"
        why = f"shadowed: the name {name!r} belongs to the first-party {owner}; this provider is ignored"
        return [e if e is top else e._replace(status=Status.SHADOWED, reason=why) for e in found]
    listing = ", ".join(sorted(f"{e.distribution} {e.version}" for e in found))
    why = f"conflict: {len(found)} distributions provide the backend {name!r} ({listing}); "
    return [e._replace(status=Status.CONFLICT, reason=why + "uninstall all but one") for e in found]


class _Discovery:
    """The ``gdn2.backends`` plugins, loaded one name at a time (on demand), each on its own."""

    def __init__(self) -> None:
        eps = md.entry_points(group=BACKENDS_GROUP)
        self.eps = {name: [ep for ep in eps if ep.name == name] for name in sorted(eps.names)}
        self.done: dict[str, list[_Entry]] = {}
        self.running: set[str] = set()  # names whose hooks run now: absent to those hooks
        self.pin = "gdn2core==" + next((d.version for d in md.distributions(name="gdn2core")), "?")

    def entries(self, name: str) -> list[_Entry]:
        if name in self.eps and name not in self.done and name not in self.running:
            self.running.add(name)  # an interrupted discovery is dropped: no need to discard it
            self.done[name] = _resolve(name, [self._load(ep) for ep in self.eps[name]])
        return self.done.get(name, [])

    def _load(self, ep: md.EntryPoint) -> _Entry:
        dist = ep.dist
        dist_name, version = ("unknown", "unknown") if dist is None else (dist.name, dist.version)
        pins = ["".join(req.split()) for req in (dist.requires or [])] if dist is not None else []
        source = f"entry point {ep.value} ({dist_name} {version})"
        entry = _Entry(ep.name, version, dist_name, source, first_party=self.pin in pins)
        try:
            pm = pluggy.PluginManager(PROJECT)  # one per plugin: its hooks alone
            pm.add_hookspecs(HookSpecs)
            pm.register(ep.load())
            impls = pm.hook.gdn2_backend.get_hookimpls()
            if len(impls) != 1:
                raise TypeError(f"plugin {ep.value}: expected one gdn2_backend(), got {len(impls)}")
            backend = validate_backend(impls[0].function())
            if backend.name != ep.name:
                why = f"the entry point is {ep.name!r} but the backend is named {backend.name!r}"
                raise ValueError(f"name: {why}")
        except Exception as err:  # a broken plugin is listed, never fatal
            reason = f"broken: {short_error(err)}"
            log.warning("gdn2 backend plugin %r (%s) is unusable: %s", ep.name, dist_name, reason)
            return entry._replace(status=Status.BROKEN, reason=reason)
        return entry._replace(backend=backend, pm=pm)


_lock = threading.Lock()
_local = threading.local()  # .active: the _Discovery whose hooks this thread is running
_discovery: _Discovery | None = None
_in_process: dict[str, _Entry] = {}


def _providers() -> list[_Entry]:
    """Every provider, in-process ones replacing discovered ones of their name. Discovery runs
    unlocked, once; a hook that calls back in reads (and extends) the discovery it runs in."""
    global _discovery
    active, cached = getattr(_local, "active", None), _discovery
    current = _local.active = active or cached or _Discovery()
    try:
        found = [e for name in current.eps for e in current.entries(name)]
    finally:
        _local.active = active
    with _lock:
        if not (active or cached) and _discovery is None:  # a fresh discovery: keep it
            _discovery = current
        return [e for e in found if e.name not in _in_process] + list(_in_process.values())


def refresh() -> None:
    """Forget the discovered plugins (the next lookup discovers them again); keep in-process ones."""
    global _discovery
    with _lock:
        _discovery = None


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Register an in-process backend instance (a third party's, or a test's).

    Args:
        backend: the instance, validated as at discovery (TypeError, ValueError: a bad field).
        replace: allow taking a name already registered or discovered (else ValueError).
    """
    name = validate_backend(backend).name
    if (taken := [e.source for e in _providers() if e.name == name]) and not replace:
        why = f"is already registered ({'; '.join(taken)}); pass replace=True to override"
        raise ValueError(f"backend {name!r} {why}")
    with _lock:
        _in_process[name] = _Entry(name, "in-process", "", "register_backend", backend=backend)


def unregister_backend(name: str) -> None:
    """Remove a backend added by :func:`register_backend` (KeyError when there is none).

    Args:
        name: its name.
    """
    with _lock:
        if _in_process.pop(name, None) is None:
            raise KeyError(f"backend {name!r} was not added by register_backend")


def list_backends() -> list[BackendInfo]:
    """Every discovered or registered provider of a backend, and what a call would do here.

    Returns:
        One :class:`BackendInfo` per provider: usable ones by priority, then the others.
    """
    rows, here = [], default_platform()
    for e in _providers():
        head, be = e[:5], e.backend  # name, version, distribution, source, status
        if be is None or e.status is not Status.OK:
            rows.append(BackendInfo(*head, None, None, False, e.reason, False, e.reason))
            continue
        named = judge(be, None, None, trainable=False, auto=False, platform=here)
        auto = judge(be, None, None, trainable=False, auto=True, platform=here)
        verdicts = (named.ok, named.reason, auto.ok, auto.reason)
        rows.append(BackendInfo(*head, be.priority, be.capabilities, *verdicts))
    return sorted(rows, key=lambda i: (i.broken, -(i.priority or 0), i.name, i.distribution))


def installed_names() -> list[str]:
    """The names :func:`get_backend` accepts (they resolve to a loaded backend), sorted."""
    return sorted(e.name for e in _providers() if e.status is Status.OK)


def get_backend(name: str) -> Backend:
    """The backend instance registered under ``name``; BackendNotFoundError when it is not
    installed (the message lists what is, and how to install it), broken, or contested.

    Args:
        name: a backend name (see :func:`list_backends`).

    Returns:
        The backend.
    """
    if not isinstance(name, str):
        raise TypeError(f"backend: expected a backend name, got {type(name).__name__}")
    entries = [e for e in _providers() if e.name == name]
    if not entries:
        installed = ", ".join(installed_names()) or "none"
        why = f"is not installed (installed: {installed}); {backend_hint(name, installed_names())}"
        raise BackendNotFoundError(f"gdn2 backend {name!r} {why}")
    for e in entries:
        if e.status is Status.OK:
            return e.backend
    why = next(e.reason for e in entries if e.status is not Status.SHADOWED)
    raise BackendNotFoundError(f"gdn2 backend {name!r} cannot be used: {why}")


def usable_backends() -> list[Backend]:
    """The loaded backends that names resolve to, highest priority first."""
    found = [e.backend for e in _providers() if e.status is Status.OK]
    return sorted(found, key=lambda be: (-be.priority, be.name))


def plugin_hook(name: str, hook: str, **kwargs: object) -> list:
    """Call ``hook`` (of :class:`gdn2core.hooks.HookSpecs`, with ``kwargs``) on the plugin module
    that provides backend ``name`` only; the non-None results (none for an in-process backend)."""
    winner = next((e for e in _providers() if e.name == name and e.status is Status.OK), None)
    return [] if winner is None or winner.pm is None else getattr(winner.pm.hook, hook)(**kwargs)
