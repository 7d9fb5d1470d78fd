"""Print pip constraints pinning every declared dependency floor (``name>=X`` -> ``name==X``).

Reads the dependencies (and the extras named on the command line, e.g. ``gdn2core:flax``) of the
distributions in this repository; where two declare a floor for the same package, the higher one
is pinned. ``make test-floors`` installs the packages under these constraints, so that the tests run
against the lowest versions the pyproject files claim to support.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECTS = {
    "gdn2core": ROOT / "gdn2core",
    "conformance": ROOT / "conformance",
    "jax_ref": ROOT / "backends" / "jax_ref",
    "scan_baseline": ROOT / "backends" / "scan_baseline",
    "pallas_tpu": ROOT / "backends" / "pallas_tpu",
    "tools": ROOT / "tools",
}
FLOOR = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][^,;\s]*)\s*$")


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def floors(extras: list[str]) -> dict[str, str]:
    pins: dict[str, str] = {}
    wanted = {e.split(":")[0]: e.split(":")[1:] for e in extras}
    for key, folder in PROJECTS.items():
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        reqs = list(project.get("dependencies", []))
        for extra in wanted.get(key, []):
            reqs += project["optional-dependencies"][extra]
        for req in reqs:
            match = FLOOR.match(req)
            if match is None:
                continue
            name, version = match.group(1).lower(), match.group(2)
            if name not in pins or _version_key(version) > _version_key(pins[name]):
                pins[name] = version
    return pins


if __name__ == "__main__":
    for name, version in sorted(floors(sys.argv[1:]).items()):
        print(f"{name}=={version}")
