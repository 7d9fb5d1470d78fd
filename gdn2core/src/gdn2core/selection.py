"""Choosing the backend for a call: a name, ``backend="auto"``, or the ``GDN2_BACKEND`` variable."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Final

from gdn2core import registry
from gdn2core.backend import Backend, Verdict
from gdn2core.config import KernelConfig
from gdn2core.install import any_backend_hint
from gdn2core.ops.decode.spec import DecodeSpec
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.verdict import decode_verdict, verdict

log = logging.getLogger("gdn2core")

ENV_VAR: Final = "GDN2_BACKEND"
AUTO: Final = "auto"


def requested_backend(backend: str | None) -> tuple[str, str]:
    """The name asked for and where it came from.

    Args:
        backend: the ``backend`` argument (None means ``"auto"``).

    Returns:
        ``(name, origin)``: the argument, or, when it is ``"auto"`` and ``GDN2_BACKEND`` is set,
        that variable's value; ``origin`` is ``""`` or ``" (from GDN2_BACKEND=...)"`` for messages.

    Raises:
        TypeError: ``backend`` is not a string.
    """
    name = AUTO if backend is None else backend
    if not isinstance(name, str):
        raise TypeError(f"backend: expected a backend name or 'auto', got {type(name).__name__}")
    if name == AUTO:
        env = os.environ.get(ENV_VAR, "").strip()
        if env:
            return env, f" (from {ENV_VAR}={env})"
    return name, ""


def resolve_backend(
    spec: OpSpec,
    config: KernelConfig,
    backend: str | None = AUTO,
    *,
    trainable: bool = False,
    platform: str | None = None,
    chunk_states: bool = False,
) -> Backend:
    """The backend that will run a call of ``spec``.

    A named backend (the argument or ``GDN2_BACKEND``) is strict: not installed, or not able to run
    this call here, raises with the reason; there is no fallback. ``"auto"`` picks the
    highest-priority backend whose verdict (:func:`gdn2core.verdict.verdict`) is yes.

    Args:
        spec: the call's spec.
        config: its kernel config.
        backend: a backend name, or ``"auto"``.
        trainable: the call needs gradients.
        platform: where the call runs (None: not known yet, inside ``jax.jit``).
        chunk_states: the call asks for the chunk states.

    Returns:
        The backend.

    Raises:
        BackendNotFoundError: the named backend is not installed or cannot load; or, under
            ``"auto"``, no backend would run the call (each one's reason is listed).
        BackendUnsupportedError: the named backend would not run this call here.
    """

    def judge(candidate: Backend, auto: bool) -> Verdict:
        return verdict(
            candidate, spec, config, trainable=trainable, auto=auto, platform=platform,
            chunk_states=chunk_states,
        )  # fmt: skip

    return _choose(backend, judge, spec)


def resolve_decode_backend(
    spec: DecodeSpec, config: KernelConfig, backend: str | None = AUTO, *, platform: str | None
) -> Backend:
    """The backend that will run a decode call of ``spec`` (the same rules as
    :func:`resolve_backend`, judged by :func:`gdn2core.verdict.decode_verdict`).

    Args:
        spec: the call's resolved decode spec.
        config: its kernel config.
        backend: a backend name, or ``"auto"``.
        platform: where the call runs (None inside ``jax.jit``).

    Returns:
        The backend.

    Raises:
        As :func:`resolve_backend`.
    """

    def judge(candidate: Backend, auto: bool) -> Verdict:
        return decode_verdict(candidate, spec, config, auto=auto, platform=platform)

    return _choose(backend, judge, spec)


def _choose(backend: str | None, judge: Callable[[Backend, bool], Verdict], spec) -> Backend:
    name, origin = requested_backend(backend)
    if name != AUTO:
        try:
            chosen = registry.get_backend(name)
        except registry.BackendNotFoundError as err:
            if not origin:
                raise
            raise registry.BackendNotFoundError(f"{ENV_VAR}={name}: {err}") from None
        answer = judge(chosen, False)
        if not answer:
            raise registry.BackendUnsupportedError(
                f"gdn2 backend {name!r}{origin} cannot run this call: {answer.reason}"
            )
        log.debug("gdn2: using backend %r (named%s)", name, origin)
        return chosen

    refusals: list[str] = []
    for candidate in registry.usable_backends():
        answer = judge(candidate, True)
        if answer:
            log.debug("gdn2: auto-selected backend %r for %s", candidate.name, spec)
            return candidate
        refusals.append(f"{candidate.name}: {answer.reason}")
    detail = "; ".join(refusals) or "no backend is installed"
    raise registry.BackendNotFoundError(
        f"no gdn2 backend can run this call ({detail}); {any_backend_hint()}"
    )
