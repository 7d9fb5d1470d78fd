"""The one answer to "would this backend run this call here?", used by every call, by
``backend="auto"``, by ``gdn2 info`` and by the tools.

The checks, in order, each with its own reason: the backend's :meth:`~Backend.availability`;
trainability (for a decode call, :attr:`Capabilities.decode`; for chunk states,
:attr:`Capabilities.chunk_states`); whether ``auto`` may pick it (:attr:`Capabilities.auto`); the platform
(:attr:`Capabilities.platforms`, enforced for ``auto``; a named call elsewhere needs
:attr:`Capabilities.interpret` and ``KernelConfig(interpret=True)``); the spec against the
capabilities; and the backend's own :meth:`~Backend.supports`. A backend method that raises refuses
only that call, and the exception is logged.

The spec judged is the one the backend would see (:meth:`Capabilities.view <gdn2core.backend.Capabilities.view>`:
grouped value heads resolved, activations off unless it fuses them), so a refusal names the
argument the backend lacks (``segment_ids``, ``cu_seqlens``) or the size it would get.
"""

from __future__ import annotations

import logging

from gdn2core.backend import YES, Backend, Verdict, short_error
from gdn2core.config import DEFAULT_CONFIG, KernelConfig
from gdn2core.ops.decode.spec import DecodeSpec
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.platform import default_platform

log = logging.getLogger("gdn2core")


def verdict(
    backend: Backend,
    spec: OpSpec | None,
    config: KernelConfig | None,
    *,
    trainable: bool,
    auto: bool,
    platform: str | None,
    chunk_states: bool = False,
) -> Verdict:
    """Whether ``backend`` would run a call here.

    Args:
        backend: the candidate.
        spec: the call's spec; None judges everything but the spec (``gdn2 info``).
        config: the call's kernel config; None for the default.
        trainable: the call needs gradients (``gdn2_forward_trainable``).
        auto: the backend would be picked by ``backend="auto"`` rather than named.
        platform: where the call runs (:func:`gdn2core.platform.call_platform`); None when not
            known yet (inside ``jax.jit``): ``auto`` then judges by the default platform and a
            named call is left to the backend's lowering.
        chunk_states: the call asks for the chunk states (``return_chunk_states=True``).

    Returns:
        :data:`YES`, or a :class:`Verdict` with the first reason it would not run.
    """
    config = DEFAULT_CONFIG if config is None else config
    caps = backend.capabilities
    avail = _ask(backend, "availability")
    if not avail:
        return avail
    if trainable and not caps.trainable:
        return Verdict(False, "forward-only (gdn2_forward_trainable needs gradients)")
    placed = _placement(backend, config, auto=auto, platform=platform)
    if not placed:
        return placed
    if chunk_states and not caps.chunk_states:
        return Verdict(False, "no chunk states (return_chunk_states=True)")
    if spec is not None:
        view = caps.view(spec)
        admitted = caps.admits(view)
        if not admitted:
            if view.dv != spec.dv:
                return Verdict(
                    False,
                    f"{admitted.reason} (grouped value heads: the {spec.groups} value heads of "
                    f"each key head run as one head of dv={view.dv})",
                )
            return admitted
        return _ask(backend, "supports", view, config)
    return YES


def decode_verdict(
    backend: Backend,
    spec: DecodeSpec | None,
    config: KernelConfig | None,
    *,
    auto: bool,
    platform: str | None,
) -> Verdict:
    """Whether ``backend`` would run a decode call (:func:`gdn2core.gdn2_decode`) here.

    The checks of :func:`verdict` (availability, ``auto``, the platform, dtype and head sizes),
    with :attr:`Capabilities.decode` in place of trainability (checked right after availability) and the backend's
    :meth:`~Backend.supports_decode` in place of ``supports``.

    Args:
        backend: the candidate.
        spec: the call's resolved decode spec; None judges everything but the spec.
        config: the call's kernel config; None for the default.
        auto: picked by ``backend="auto"`` rather than named.
        platform: where the call runs (None inside ``jax.jit``, as for :func:`verdict`).

    Returns:
        :data:`YES`, or a :class:`Verdict` with the first reason it would not run.
    """
    config = DEFAULT_CONFIG if config is None else config
    avail = _ask(backend, "availability")
    if not avail:
        return avail
    caps = backend.capabilities
    if not caps.decode:
        return Verdict(False, "no decode op (Capabilities.decode is False)")
    placed = _placement(backend, config, auto=auto, platform=platform)
    if not placed:
        return placed
    if spec is not None:
        admitted = caps.admits(spec)
        if not admitted:
            return admitted
        return _ask(backend, "supports_decode", spec, config)
    return YES


def _placement(
    backend: Backend, config: KernelConfig, *, auto: bool, platform: str | None
) -> Verdict:
    """Whether ``auto`` may pick the backend, and whether it runs on ``platform``."""
    caps = backend.capabilities
    if auto and not caps.auto:
        return Verdict(False, "used only when named (a baseline or reference)")
    where = platform if platform is not None or not auto else default_platform()
    if where is not None and where not in caps.platforms:
        runs_on = "/".join(caps.platforms)
        if auto:
            return Verdict(False, f"runs on {runs_on}, this call on {where}")
        if not (caps.interpret and config.interpret):
            hint = (
                "; KernelConfig(interpret=True) runs its kernels in interpret mode (slow)"
                if caps.interpret
                else ""
            )
            return Verdict(False, f"runs on {runs_on}, this call on {where}{hint}")
    return YES


def _ask(backend: Backend, method: str, *args) -> Verdict:
    """``backend.method(*args)`` as a Verdict; an exception or a non-Verdict answer refuses."""
    try:
        answer = getattr(backend, method)(*args)
    except Exception as err:
        log.warning(
            "gdn2 backend %r: %s() raised %s: %s", backend.name, method, type(err).__name__, err
        )
        return Verdict(False, f"{method}() raised {short_error(err)}")
    if isinstance(answer, Verdict):
        return answer
    if isinstance(answer, bool):
        return Verdict(answer, "" if answer else f"{method}() said no")
    return Verdict(False, f"{method}() returned {type(answer).__name__}, not a Verdict")
