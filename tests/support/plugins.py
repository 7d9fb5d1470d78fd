"""Make plugin distributions discoverable without pip, as an installed wheel would be.

A distribution is a ``<name>-<version>.dist-info`` folder (METADATA with its Requires-Dist, and
entry_points.txt) in a temporary site directory on ``sys.path``: importlib.metadata then finds
its entry points exactly as for an installed wheel. Its modules are either a folder under
``tests/plugins/`` (:func:`installed_plugins`) or source text written next to the dist-info
(:func:`fake_distribution`, for the fault-injection tests).
"""

from __future__ import annotations

import contextlib
import sys
import tomllib
from pathlib import Path

from gdn2core import registry

PLUGINS = Path(__file__).resolve().parent.parent / "plugins"


def write_dist_info(
    site: Path,
    name: str,
    version: str,
    entry_points: dict[str, dict[str, str]],
    requires: tuple[str, ...] = (),
) -> None:
    """Write the metadata of one distribution into ``site``."""
    dist = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir(parents=True)
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    (dist / "METADATA").write_text("\n".join(meta) + "\n")
    lines = []
    for group, entries in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{ep} = {target}" for ep, target in entries.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")


def fake_distribution(
    site: Path,
    name: str,
    modules: dict[str, str],
    backends: dict[str, str],
    *,
    version: str = "1.0",
    requires: tuple[str, ...] = (),
) -> None:
    """A distribution whose modules are the given source texts (``{"mod_name": source}``) and
    whose ``gdn2.backends`` entry points are ``backends`` (``{"name": "mod_name"}``)."""
    for mod, source in modules.items():
        (site / f"{mod}.py").write_text(source)
    write_dist_info(site, name, version, {"gdn2.backends": backends}, requires)


@contextlib.contextmanager
def on_path(site: Path, *extra: Path, prefixes: tuple[str, ...] = ()):
    """``site`` (and ``extra`` source folders) on ``sys.path`` for the block, the registry
    rediscovering plugins on entry and exit; modules starting with ``prefixes`` are forgotten."""
    added = [str(site), *map(str, extra)]
    sys.path[:0] = added
    registry.refresh()
    try:
        yield
    finally:
        for path in added:
            sys.path.remove(path)
        for mod in [m for m in sys.modules if prefixes and m.startswith(prefixes)]:
            del sys.modules[mod]
        registry.refresh()


@contextlib.contextmanager
def installed_plugins(site: Path, *names: str):
    """Expose the named ``tests/plugins`` distributions for the duration of the block."""
    sources = []
    for name in names:
        meta = tomllib.loads((PLUGINS / name / "pyproject.toml").read_text())["project"]
        write_dist_info(site, meta["name"], meta["version"], meta.get("entry-points", {}))
        sources.append(PLUGINS / name / "src")
    with on_path(site, *sources, prefixes=("gdn2_toy", "gdn2_broken", "gdn2_wrong")):
        yield


def subprocess_env(site: Path, *names: str) -> dict[str, str]:
    """Environment for a child process that sees the named ``tests/plugins`` distributions."""
    import os

    sources = []
    for name in names:
        meta = tomllib.loads((PLUGINS / name / "pyproject.toml").read_text())["project"]
        write_dist_info(site, meta["name"], meta["version"], meta.get("entry-points", {}))
        sources.append(str(PLUGINS / name / "src"))
    path = os.pathsep.join([str(site), *sources, os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep), "JAX_PLATFORMS": "cpu"}
