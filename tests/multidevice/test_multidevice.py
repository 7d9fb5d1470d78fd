"""Multi-device sharding tests.

The checks in ``md_sharding.py`` and ``md_features.py`` (packed sequences, GVA and fused
activations under batch/head sharding and context parallelism) need 8 devices, and XLA's device
count is fixed when JAX starts, while the rest of the suite runs in one process with one CPU
device: so they run in a child process started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (about 2-3 minutes).
The deviceless TPU compile of the sharded train step is in tests/tools/test_reports.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def test_eight_simulated_devices():
    flags = os.environ.get("XLA_FLAGS", "")
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8".strip(),
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(HERE / "md_sharding.py"),
        str(HERE / "md_features.py"),
        str(HERE / "md_ragged.py"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout[-8000:] + "\n" + proc.stderr[-4000:]).strip()
    assert proc.returncode == 0, f"multi-device tests failed (rc={proc.returncode}):\n{tail}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], tail


def test_single_device_calls_take_the_plain_path():
    """No mesh anywhere: no plan (the unsharded call is unchanged); axis keywords need a mesh."""
    import jax
    import jax.numpy as jnp

    from gdn2core import OpSpec
    from gdn2core.sharding import resolve_plan

    q = jnp.zeros((2, 8, 2, 4))
    spec = OpSpec.from_inputs(q, q, q, q, q, q)
    assert resolve_plan(spec, q) is None
    assert jax.jit(lambda x: jnp.float32(resolve_plan(spec, x) is None))(q) == 1.0
    with pytest.raises(ValueError, match="no mesh"):
        resolve_plan(spec, q, batch_axes="data")
