"""gdn2core's own ``gdn2`` subcommand ``info`` (registered through the same ``gdn2_commands`` hook
as every plugin's; ``gdn2 conformance`` comes with the kit, ``gdn2-conformance``)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from gdn2core.hooks import Command, hookimpl


@hookimpl
def gdn2_commands() -> list[Command]:
    """gdn2core's subcommands.

    Returns:
        ``info``.
    """
    return [
        Command(
            "info", "the backends here and what a call to each would do", f"{__name__}:info_main"
        ),
    ]


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [line.format(*header), line.format(*("-" * w for w in widths))]
    return [ln.rstrip() for ln in out + [line.format(*r) for r in rows]]


def info_main(argv: Sequence[str]) -> int:
    """``gdn2 info``: every backend, its state, and what a call to it would do here.

    Args:
        argv: the arguments after ``gdn2 info`` (none are accepted).

    Returns:
        0.
    """
    argparse.ArgumentParser(
        prog="gdn2 info", description="The gdn2 backends here and what a call would do."
    ).parse_args(list(argv))
    import jax

    from gdn2core.platform import default_platform
    from gdn2core.registry import list_backends
    from gdn2core.selection import ENV_VAR

    platform = default_platform()
    infos = list_backends()
    rows, notes = [], []
    for info in infos:
        prio = "-" if info.priority is None else str(info.priority)
        caps = info.capabilities.describe() if info.capabilities else "-"
        named = "yes" if info.available else "no (1)"
        auto = "yes" if info.auto else "no (2)"
        rows.append((info.name, info.version, str(info.status), prio, named, auto, caps))
        if not info.available:
            notes.append(f"{info.name} ({info.distribution or 'in-process'}): (1) {info.reason}")
        if info.available and not info.auto:
            notes.append(f"{info.name}: (2) {info.auto_reason}")
    header = ("backend", "version", "status", "priority", "named call", "auto", "capabilities")
    print("\n".join(_table(header, rows)) if rows else "(no backend installed)")
    if notes:
        print("\nwhy not: (1) a call naming it, (2) backend='auto'")
        print("\n".join(f"  {n}" for n in notes))
    print(
        f"\nhere: jax {jax.__version__}, platform {platform}, {jax.device_count()} device(s). "
        "'named call': a call with backend=NAME on this platform and the default config."
    )
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        known = {i.name: i for i in list_backends() if not i.broken}
        state = "" if env in known else " (NOT INSTALLED: such calls fail)"
        print(f"{ENV_VAR}={env}: calls with backend='auto' run {env!r}{state}.")
    else:
        print(
            f"{ENV_VAR} is not set: backend='auto' picks the highest-priority backend that would run the call."
        )
    return 0
