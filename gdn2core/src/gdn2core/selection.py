"""Choosing the backend for a call. A name (the ``backend`` argument, or ``GDN2_BACKEND`` under
``"auto"``) is strict: a backend not installed, or not able to run the call here, raises with the
reason. ``"auto"`` picks the highest-priority backend whose verdict (:mod:`gdn2core.verdict`) is yes.
"""

from __future__ import annotations

import os
from typing import Final

from gdn2core import registry
from gdn2core.backend import Backend
from gdn2core.config import KernelConfig
from gdn2core.install import any_backend_hint
from gdn2core.ops.decode.spec import DecodeSpec
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.verdict import judge, judge_decode

ENV_VAR: Final = "GDN2_BACKEND"
AUTO: Final = "auto"


def resolve_backend(spec: OpSpec, config: KernelConfig, backend: str | None = AUTO, *,
                    trainable: bool = False, platform: str | None = None,
                    chunk_states: bool = False) -> Backend:  # fmt: skip
    """The backend that will run a forward call of ``spec``: BackendNotFoundError when the named
    one is missing or, under ``"auto"``, none would run the call (each one's reason listed);
    BackendUnsupportedError when the named one would not run it.

    Args:
        spec, config, trainable, chunk_states, platform: the call, as :func:`gdn2core.verdict.judge`
            takes it; backend: a backend name, or ``"auto"`` (or None).

    Returns:
        The backend.
    """
    options = dict(trainable=trainable, platform=platform, chunk_states=chunk_states)
    return _choose(backend, lambda b, a: judge(b, spec, config, auto=a, **options))


def resolve_decode_backend(spec: DecodeSpec, config: KernelConfig, backend: str | None = AUTO, *,
                           platform: str | None) -> Backend:  # fmt: skip
    """The backend that will run a decode call of ``spec``: as :func:`resolve_backend`, judged by
    :func:`gdn2core.verdict.judge_decode`."""
    return _choose(backend, lambda b, a: judge_decode(b, spec, config, auto=a, platform=platform))


def _choose(backend: str | None, verdict) -> Backend:
    """The backend ``backend`` names, or the first one that ``verdict(candidate, auto)`` accepts."""
    name = AUTO if backend is None else backend
    if not isinstance(name, str):
        raise TypeError(f"backend: expected a backend name or 'auto', got {type(name).__name__}")
    env = os.environ.get(ENV_VAR, "").strip() if name == AUTO else ""
    name, origin = (env, f" (from {ENV_VAR}={env})") if env else (name, "")
    if name == AUTO:
        refusals = []
        for candidate in registry.usable_backends():
            if answer := verdict(candidate, True):
                registry.log.debug("gdn2: auto-selected backend %r", candidate.name)
                return candidate
            refusals.append(f"{candidate.name}: {answer.reason}")
        detail = "; ".join(refusals) or "no backend is installed"
        why = f"no gdn2 backend can run this call ({detail}); {any_backend_hint()}"
        raise registry.BackendNotFoundError(why)
    try:
        chosen = registry.get_backend(name)
    except registry.BackendNotFoundError as err:
        if not origin:
            raise
        raise registry.BackendNotFoundError(f"{ENV_VAR}={name}: {err}") from None
    if not (answer := verdict(chosen, False)):
        why = f"gdn2 backend {name!r}{origin} cannot run this call: {answer.reason}"
        raise registry.BackendUnsupportedError(why)
    registry.log.debug("gdn2: using backend %r (named%s)", name, origin)
    return chosen
