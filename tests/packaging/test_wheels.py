"""Every distribution builds a wheel that ships its README (as the long description), the license
file and ``py.typed``, and declares its entry points."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = {
    "gdn2core": ("gdn2core", "gdn2core"),
    "conformance": ("gdn2_conformance", "gdn2_conformance"),
    "backends/jax_ref": ("gdn2_jax_ref", "gdn2_jax_ref"),
    "backends/scan_baseline": ("gdn2_scan_baseline", "gdn2_scan_baseline"),
    "backends/pallas_tpu": ("gdn2_pallas_tpu", "gdn2_pallas_tpu"),
    "tools": ("gdn2_tools", "gdn2_tools"),
}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out)]
    subprocess.run([*cmd, *(str(ROOT / d) for d in DISTRIBUTIONS)], check=True, timeout=600)
    return {w.name.split("-")[0]: w for w in out.glob("*.whl")}


@pytest.mark.parametrize("folder", sorted(DISTRIBUTIONS))
def test_wheel_ships_readme_license_and_types(wheels, folder):
    stem, package = DISTRIBUTIONS[folder]
    with zipfile.ZipFile(wheels[stem]) as whl:
        names = whl.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = whl.read(meta).decode()
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
        assert f"{package}/py.typed" in names
        assert "License-Expression: Apache-2.0" in metadata
        assert "Description-Content-Type: text/markdown" in metadata
        readme = (ROOT / folder / "README.md").read_text().splitlines()[0]
        assert readme in metadata
        if folder != "gdn2core":  # built from this repository: pinned to this gdn2core
            assert "Requires-Dist: gdn2core==0.1.0" in metadata
        entry_points = [n for n in names if n.endswith("entry_points.txt")]
        assert entry_points, "no entry points"
        text = whl.read(entry_points[0]).decode()
        groups = {
            "gdn2core": ["[console_scripts]"],
            "conformance": ["[pytest11]", "[gdn2.tools]"],
            "tools": ["[gdn2.tools]"],
        }.get(folder, ["[gdn2.backends]"])
        assert all(group in text for group in groups), text
