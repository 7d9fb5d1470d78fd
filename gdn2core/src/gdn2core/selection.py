"""Choosing the backend for a call: a name, ``backend="auto"``, or ``GDN2_BACKEND``."""

from __future__ import annotations

import logging
import os

from gdn2core import registry
from gdn2core.backend import Backend
from gdn2core.config import KernelConfig
from gdn2core.spec import OpSpec

log = logging.getLogger("gdn2core")

ENV_VAR = "GDN2_BACKEND"
AUTO = "auto"


def requested_backend(backend: str | None) -> str:
    """The name asked for: the argument, unless it is "auto" and ``GDN2_BACKEND`` is set."""
    name = AUTO if backend is None else backend
    if not isinstance(name, str):
        raise TypeError(f"backend: expected a backend name or 'auto', got {type(name).__name__}")
    if name == AUTO:
        env = os.environ.get(ENV_VAR, "").strip()
        if env:
            return env
    return name


def resolve_backend(
    spec: OpSpec, config: KernelConfig, backend: str | None = AUTO, *, trainable: bool = False
) -> Backend:
    """The backend that will run ``spec``.

    A named backend (argument or ``GDN2_BACKEND``) is strict: not installed, unavailable, or unable
    to run this spec raises with the reason; there is no fallback. ``"auto"`` picks the
    highest-priority backend that is auto-selectable here and supports the spec.
    """
    name = requested_backend(backend)
    if name != AUTO:
        chosen = registry.get_backend(name)
        avail = chosen.availability()
        if not avail:
            raise registry.BackendUnsupportedError(
                f"gdn2 backend {name!r} is unavailable here: {avail.reason}"
            )
        verdict = chosen.supports(spec, config)
        if not verdict:
            raise registry.BackendUnsupportedError(
                f"gdn2 backend {name!r} cannot run this call: {verdict.reason}"
            )
        if trainable and not chosen.capabilities.trainable:
            raise registry.BackendUnsupportedError(
                f"gdn2 backend {name!r} is forward-only; gdn2_forward_trainable needs gradients"
            )
        log.debug("gdn2: using backend %r (named)", name)
        return chosen

    refusals: list[str] = []
    for candidate in registry.available_backends():
        if trainable and not candidate.capabilities.trainable:
            refusals.append(f"{candidate.name}: forward-only")
            continue
        auto_ok = candidate.auto_selectable()
        if not auto_ok:
            refusals.append(f"{candidate.name}: {auto_ok.reason}")
            continue
        verdict = candidate.supports(spec, config)
        if verdict:
            log.debug("gdn2: auto-selected backend %r for %s", candidate.name, spec)
            return candidate
        refusals.append(f"{candidate.name}: {verdict.reason}")
    detail = "; ".join(refusals) or "no backend installed"
    raise registry.BackendNotFoundError(
        f"no gdn2 backend can run this call ({detail}); {registry.install_hint('jax_ref')}"
    )
