"""Optional dependencies, checked before any work starts (a missing one is named with the command
that installs it, never found after minutes of benchmarking)."""

from __future__ import annotations

import importlib.util

from gdn2core.install import pip_command


def missing(module: str, *, extra: str = "", why: str) -> str | None:
    """A message when ``module`` cannot be imported, else None.

    Args:
        module: the top-level module (e.g. ``"matplotlib"``).
        extra: the gdn2-tools extra that installs it ("" when it is a plain dependency).
        why: what needs it (e.g. ``"--plot"``).

    Returns:
        "``why`` needs ``module``: <install command>", naming whether it is absent or broken.
    """
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        try:
            importlib.import_module(module)
            return None
        except Exception as err:  # installed but broken: say so, do not say "install it"
            return f"{why} needs {module}, which is installed but fails to import ({type(err).__name__}: {err})"
    return (
        f"{why} needs {module}, which is not installed: {pip_command('gdn2-tools', 'tools', extra)}"
    )
