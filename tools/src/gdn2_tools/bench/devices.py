"""``gdn2 bench --devices N``: the bench with the batch sharded over N (simulated) devices.

For correctness and the shape of scaling, not for speed claims: without N real devices the run
uses N CPU devices that XLA simulates on this host (``--xla_force_host_platform_device_count``),
which share its cores. XLA fixes the device count when JAX starts, so a process with fewer devices
re-executes ``gdn2 bench`` in a child process with the flag set (and ``JAX_PLATFORMS=cpu``).

Each row's programs run on inputs placed on a 1-D mesh ``("data",)`` with a ``NamedSharding`` over
the batch axis, so the public ops take their sharded path (the backend runs once per device on its
batch shard, inside ``shard_map``); the correctness gate compares the outputs and gradients with the
single-device token-serial reference of the same inputs (:mod:`gdn2_tools.bench.gate`), exactly as in
the single-device bench.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence

SPEED_NOTE = "simulated devices: not a speed claim"
CHILD_ENV = "GDN2_BENCH_DEVICES_CHILD"
AXIS = "data"
_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def find_devices(n: int) -> list | None:
    """``n`` devices of the default platform, else of the CPU; None when there are fewer."""
    import jax

    for devices in (jax.devices(), jax.devices("cpu")):
        if len(devices) >= n:
            return list(devices[:n])
    return None


def child_env(n: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default ``os.environ``) with XLA asked for ``n`` CPU devices, the CPU platform,
    and no libtpu logs (``TPU_LOG_DIR=disabled`` unless set)."""
    env = dict(os.environ if env is None else env)
    flags = _COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("TPU_LOG_DIR", "disabled")  # libtpu, if loaded, writes no logs to /tmp
    env[CHILD_ENV] = "1"
    return env


def reexec(argv: Sequence[str], n: int) -> int:
    """Run ``gdn2 bench argv`` in a child process with ``n`` simulated CPU devices; its exit code."""
    if os.environ.get(CHILD_ENV):
        print(
            f"gdn2 bench --devices {n}: still fewer than {n} devices after setting XLA_FLAGS "
            f"({os.environ.get('XLA_FLAGS', '')!r})",
            file=sys.stderr,
        )
        return 2
    print(f"gdn2 bench --devices {n}: re-running with {n} simulated CPU devices", flush=True)
    cmd = [sys.executable, "-m", "gdn2core.cli", "bench", *argv]
    return subprocess.run(cmd, env=child_env(n), check=False).returncode


def make_mesh(devices: list):
    """A 1-D mesh ``("data",)`` over ``devices`` (Auto axes: the ops are told nothing but the
    inputs' ``NamedSharding``, as a user's jitted train step would)."""
    import jax
    from jax.sharding import AxisType

    return jax.make_mesh((len(devices),), (AXIS,), (AxisType.Auto,), devices=devices)


def batch_placer(mesh) -> Callable:
    """``place(xs, h0, cts)``: every array sharded over the batch axis (dim 0) on ``mesh``, or
    replicated where the batch does not divide by the mesh size (e.g. a B=1 fallback check)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    n = mesh.size
    split = NamedSharding(mesh, PartitionSpec(AXIS))
    whole = NamedSharding(mesh, PartitionSpec())

    def put(a):
        return jax.device_put(a, split if a.shape[0] % n == 0 else whole)

    def place(xs, h0, cts):
        return jax.tree.map(put, (xs, h0, cts))

    return place


def describe(mesh) -> str:
    devices = list(mesh.devices.flat)
    kind = devices[0].platform
    label = f" ({SPEED_NOTE})" if kind == "cpu" else ""
    return (
        f"devices: {len(devices)} {kind}; mesh {dict(mesh.shape)}; batch sharded over "
        f"{AXIS!r}{label}"
    )


def plan_label(mesh, shape) -> str:
    """How the public ops split a call at ``shape`` on ``mesh`` (from the placed inputs)."""
    import jax.numpy as jnp

    from gdn2core.ops.forward.spec import OpSpec
    from gdn2core.sharding import resolve_plan

    n = mesh.size
    if shape.B % n:
        return f"B={shape.B} does not divide by {n}: replicated, plain path"
    place = batch_placer(mesh)
    q = place((jnp.zeros((shape.B, shape.T, shape.H, shape.dk)),), None, ())[0][0]
    v = jnp.zeros((shape.B, shape.T, shape.H, shape.dv))
    spec = OpSpec.from_inputs(q, q, v, v, q, q, None, None)
    plan = resolve_plan(spec, q)
    if plan is None:
        return "plain path (no split)"
    return f"batch over {plan.batch_axes} x{plan.batch_shards}, heads x{plan.head_shards}"
