"""Multi-device sharding tests.

The checks in ``md_sharding.py`` need 8 devices, and XLA's device count is fixed when JAX starts,
while the rest of the suite runs in one process with one CPU device: so they run in a child
process started with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (about 1-2 minutes).
The deviceless TPU compile of the sharded train step runs here (it needs no devices).
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
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout[-8000:] + "\n" + proc.stderr[-4000:]).strip()
    assert proc.returncode == 0, f"multi-device tests failed (rc={proc.returncode}):\n{tail}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], tail


def _tpu_backends() -> list[str]:
    return ["default", "pallas_tpu"]


@pytest.mark.tpu_compile
@pytest.mark.parametrize("backend", _tpu_backends())
def test_mesh_report_compiles_small_v5e_2x4(backend):
    """The sharded train step compiles for 8 v5e chips (jax_ref, or the reference while jax_ref
    is unavailable; and the Pallas kernels, which only shard_map can distribute)."""
    from gdn2core.sharding import report

    rows = report.run(
        report.ReportArgs(
            topology="v5e:2x4",
            backend=report.default_backend() if backend == "default" else backend,
            shapes=(
                report.Shape("batch", B=8, T=256, H=2, d=64),
                report.Shape("context", B=1, T=1024, H=2, d=64),
            ),
        )
    )
    by_mode = {r.shape.mode: r for r in rows}
    for row in rows:
        assert row.error is None, row.error
        assert row.per_chip_bytes > 0
    # Batch sharding: the compiled TPU program has no all-gather (no collective but the loss's).
    assert all(c.bytes <= 8 for c in by_mode["batch"].collectives), by_mode["batch"].collectives
    # Context parallelism: only the state summaries, 8 x dk x (dk + dv) floats per head at most.
    bound = 4 * 8 * 1 * 2 * 64 * 128
    ctx = by_mode["context"].collectives
    assert any(c.op == "all-gather" for c in ctx)
    assert all(c.bytes <= bound for c in ctx), ctx


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


def test_mesh_report_shape_option():
    from gdn2core.sharding.report import Shape, _shape

    assert _shape("batch:8,4096,6,128") == Shape("batch", 8, 4096, 6, 128)
    with pytest.raises(Exception, match="mode:B,T,H,d"):
        _shape("batch:8,4096")
