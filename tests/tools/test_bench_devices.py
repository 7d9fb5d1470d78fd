"""``gdn2 bench --devices 2``: re-runs itself with two simulated CPU devices, shards the batch,
gates against the single-device reference and labels the timings (subprocess, one tiny shape)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gdn2_tools.bench.devices import SPEED_NOTE, child_env


def test_bench_two_simulated_devices(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("GDN2_BENCH_DEVICES_CHILD", None)
    argv = ["--devices", "2", "--shape", "2,16,1,8,8", "--repeats", "2", "--dtypes", "float32"]
    argv += ["--backends", "jax_ref", "--no-progress", "--out", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "gdn2core.cli", "bench", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"{out}\n{proc.stderr}"
    assert "devices: 2 cpu; mesh {'data': 2}" in out, out
    assert "batch over ('data',) x2" in out, out
    assert SPEED_NOTE in out, out
    data = json.loads((tmp_path / "devices-2" / "bench.json").read_text())
    assert data["devices"] == 2 and data["environment"]["device_count"] >= 2
    assert data["checks"] == []  # no speed targets judged on simulated devices
    (row,) = data["rows"]
    assert row["status"] == "ok" and row["gate"]["ok"], row
    assert row["gate"]["against"] == "reference"
    assert {"o", "h_final", "dq", "dg", "dh0"} <= set(row["gate"]["errors"])
    assert SPEED_NOTE in (tmp_path / "devices-2" / "bench.md").read_text()


def test_child_env_replaces_the_device_count():
    env = child_env(4, {"XLA_FLAGS": "--foo --xla_force_host_platform_device_count=8"})
    assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=4"
    assert env["JAX_PLATFORMS"] == "cpu"
