"""Make the distributions under tests/plugins/ discoverable without pip.

For each folder, write ``<name>-<version>.dist-info`` (METADATA and entry_points.txt, from its
pyproject.toml) into a temporary site directory and put that directory and the folder's ``src``
on ``sys.path``: importlib.metadata then finds the entry points exactly as for an installed wheel.
"""

from __future__ import annotations

import contextlib
import sys
import tomllib
from pathlib import Path

from gdn2core import registry

PLUGINS = Path(__file__).resolve().parent.parent / "plugins"


def write_dist_info(project_dir: Path, site: Path) -> None:
    meta = tomllib.loads((project_dir / "pyproject.toml").read_text())["project"]
    dist = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n"
    )
    lines = []
    for group, entries in meta.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")


@contextlib.contextmanager
def installed_plugins(site: Path, *names: str):
    """Expose the named tests/plugins distributions for the duration of the block."""
    added = [str(site)]
    for name in names:
        write_dist_info(PLUGINS / name, site)
        added.append(str(PLUGINS / name / "src"))
    sys.path[:0] = added
    registry.refresh()
    try:
        yield
    finally:
        for path in added:
            sys.path.remove(path)
        for mod in [m for m in sys.modules if m.startswith(("gdn2_toy", "gdn2_broken"))]:
            del sys.modules[mod]
        registry.refresh()
