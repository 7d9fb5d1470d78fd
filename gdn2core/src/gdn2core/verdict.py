"""The one answer to "would this backend run this call here?" (docs/backends.md, section 2), for
every call, ``backend="auto"``, ``gdn2 info`` and the tools. The spec judged is the backend's view
of the call (``Capabilities.view``); a backend method that raises refuses only that call (logged).
"""

from __future__ import annotations

import logging

from gdn2core.backend import YES, Backend, Verdict, short_error
from gdn2core.config import DEFAULT_CONFIG, KernelConfig
from gdn2core.ops.decode.spec import DecodeSpec
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.platform import default_platform

log = logging.getLogger("gdn2core")


def judge(backend: Backend, spec: OpSpec | None, config: KernelConfig | None, *, trainable: bool,
          auto: bool, platform: str | None, chunk_states: bool = False) -> Verdict:  # fmt: skip
    """Whether ``backend`` would run a forward call of ``spec`` (None: judge all but the spec) with
    ``config`` (None: the default) here: ``trainable`` (needing gradients), asking for the chunk
    states, picked by ``auto`` rather than named, on ``platform`` (None inside ``jax.jit``: ``auto``
    then judges by the default platform). :data:`YES`, or the first reason it would not."""
    caps = backend.capabilities
    untrainable = trainable and not caps.trainable
    chunkless = chunk_states and not caps.chunk_states
    missing = "forward-only (gdn2_forward_trainable needs gradients)" if untrainable else ""
    no_chunks = "no chunk states (return_chunk_states=True)" if chunkless else ""
    return _judge(backend, spec, config, auto, platform, missing, no_chunks)


def judge_decode(backend: Backend, spec: DecodeSpec | None, config: KernelConfig | None, *,
                 auto: bool, platform: str | None) -> Verdict:  # fmt: skip
    """Whether ``backend`` would run a decode call (:func:`gdn2core.gdn2_decode`) here: as
    :func:`judge`, with ``Capabilities.decode`` for trainability and ``supports_decode()``."""
    no_decode = "" if backend.capabilities.decode else "no decode op (Capabilities.decode is False)"
    return _judge(backend, spec, config, auto, platform, no_decode, "")


def _judge(backend, spec, config, auto, platform, missing: str, no_chunks: str) -> Verdict:
    """The checks of both; ``missing``, ``no_chunks``: why a needed capability is absent, or ""."""
    caps, config = backend.capabilities, DEFAULT_CONFIG if config is None else config
    if not (available := ask(backend, "availability")):
        return available
    if missing:
        return Verdict(False, missing)
    if auto and not caps.auto:
        return Verdict(False, "used only when named (a baseline or reference)")
    where = default_platform() if platform is None and auto else platform
    interpreted = not auto and caps.interpret and config.interpret
    if where is not None and where not in caps.platforms and not interpreted:
        hint = "; KernelConfig(interpret=True) runs its kernels in interpret mode (slow)"
        hint = hint if caps.interpret and not auto else ""
        return Verdict(False, f"runs on {'/'.join(caps.platforms)}, this call on {where}{hint}")
    if no_chunks:
        return Verdict(False, no_chunks)
    if spec is None:
        return YES
    forward = isinstance(spec, OpSpec)
    view = caps.view(spec) if forward else spec
    admitted = caps.admits(view)
    if admitted:
        return ask(backend, "supports" if forward else "supports_decode", view, config)
    if view.dv == spec.dv:
        return admitted
    groups = f"the {spec.groups} value heads of each key head run as one head of dv={view.dv}"
    return Verdict(False, f"{admitted.reason} (grouped value heads: {groups})")


def ask(backend: Backend, method: str, *args) -> Verdict:
    """``backend.method(*args)`` as a Verdict; an exception or a non-Verdict answer refuses."""
    try:
        answer = getattr(backend, method)(*args)
    except Exception as err:
        why = f"{method}() raised {short_error(err)}"
        log.warning("gdn2 backend %r: %s", backend.name, why)
        return Verdict(False, why)
    if isinstance(answer, bool):
        return Verdict(answer, "" if answer else f"{method}() said no")
    wrong = f"{method}() returned {type(answer).__name__}, not a Verdict"
    return answer if isinstance(answer, Verdict) else Verdict(False, wrong)
