"""``gdn2 memory``: compiled peak memory of forward+backward per backend and shape.

Two sources:

- ``memory_analysis()`` of the compiled fwd+bwd program (temp, argument, output, alias and code
  bytes), on the local device or, with a TPU target, from a deviceless TPU compile
  (``jax.experimental.topologies``; no TPU needed, only the libtpu wheel). Compiling measures
  nothing live, so it runs in this process.
- ``--rss``: the peak resident set of one fwd+bwd executed on the local device. That is a property
  of a live process, so each measurement runs in its own subprocess
  (``python -m gdn2_tools.bench.rss_probe``), isolated from the others and from this one.

Default rows: locally, reference_grad and every backend whose verdict here is yes; for a TPU
target, every backend ``backend="auto"`` may pick on a TPU (by its declared platforms).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gdn2_tools.bench.programs import REFERENCE_ROW, programs_for
from gdn2_tools.bench.shapes import BenchShape
from gdn2_tools.tpu import TOPOLOGIES, compile_for_tpu, topology_mesh
from gdn2core import registry
from gdn2core.config import KernelConfig
from gdn2core.verdict import judge


def _specs(shape: BenchShape, dtype: str, sharding=None):
    def sds(s, dt):
        return jax.ShapeDtypeStruct(s, jnp.dtype(dt), sharding=sharding)

    kshape = (shape.B, shape.T, shape.H, shape.dk)
    vshape = (shape.B, shape.T, shape.H, shape.dv)
    hshape = (shape.B, shape.H, shape.dk, shape.dv)
    xs = tuple(sds(kshape if n in "qkbg" else vshape, dtype) for n in "qkvwbg")
    return xs, sds(hshape, "float32"), (sds(vshape, dtype), sds(hshape, "float32"))


def _analysis_dict(ma) -> dict[str, int]:
    names = {
        "temp_bytes": "temp_size_in_bytes",
        "argument_bytes": "argument_size_in_bytes",
        "output_bytes": "output_size_in_bytes",
        "alias_bytes": "alias_size_in_bytes",
        "generated_code_bytes": "generated_code_size_in_bytes",
    }
    return {k: int(getattr(ma, attr, 0) or 0) for k, attr in names.items()}


def compiled_memory(
    name: str,
    shape: BenchShape,
    dtype: str,
    *,
    config: KernelConfig | None = None,
    target: str | None = None,
) -> dict[str, Any]:
    """``memory_analysis()`` of the jitted fwd+bwd of row ``name``.

    Args:
        name: a backend or ``reference_grad``.
        shape: the shape.
        dtype: the input dtype.
        config: the kernel config.
        target: None for this host, else a TPU generation of :data:`TOPOLOGIES` (compiled
            deviceless).

    Returns:
        Temp, argument, output, alias and code bytes.
    """
    progs = programs_for(name, config)
    if target is None:
        xs, h0, cts = _specs(shape, dtype)
        compiled = jax.jit(progs.fwdbwd).lower(xs, h0, cts).compile()
    else:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = topology_mesh(TOPOLOGIES[target])
        xs, h0, cts = _specs(shape, dtype, NamedSharding(mesh, P()))
        compiled = compile_for_tpu(progs.fwdbwd, xs, h0, cts)
    ma = compiled.memory_analysis()
    if ma is None:
        raise RuntimeError("memory_analysis() returned None on this platform")
    return _analysis_dict(ma)


def rss_in_subprocess(
    name: str, shape: BenchShape, dtype: str, *, timeout: float = 900.0
) -> dict[str, Any]:
    """Peak RSS of one fwd+bwd, measured in a fresh interpreter (one per measurement)."""
    payload = json.dumps({"backend": name, "shape": shape.as_dict(), "dtype": dtype})
    proc = subprocess.run(
        [sys.executable, "-m", "gdn2_tools.bench.rss_probe", payload],
        env={"TPU_LOG_DIR": "disabled", **os.environ},  # libtpu, if loaded, writes no logs
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"rss probe exited {proc.returncode}: {tail[0]}")
    return json.loads(lines[-1])


def measure(
    names: Sequence[str],
    shapes: Sequence[BenchShape],
    dtypes: Sequence[str],
    *,
    config: KernelConfig | None = None,
    target: str | None = None,
    rss: bool = False,
    progress=None,
) -> list[dict[str, Any]]:
    rows = []
    for shape in shapes:
        for dtype in dtypes:
            for name in names:
                if progress is not None:
                    progress(f"{name} {dtype} {shape.label}")
                itemsize = jnp.dtype(dtype).itemsize
                row: dict[str, Any] = {
                    "backend": name,
                    "shape": shape.as_dict(),
                    "dtype": dtype,
                    "target": target or jax.devices()[0].platform,
                    "input_bytes": shape.input_bytes(itemsize),
                    "status": "ok",
                    "reason": "",
                }
                local = _platform_refusal(name) if target is None else ""
                if local:
                    row.update(status="skipped", reason=local)
                    rows.append(row)
                    continue
                try:
                    row.update(compiled_memory(name, shape, dtype, config=config, target=target))
                    if rss and target is None:
                        row.update(rss_in_subprocess(name, shape, dtype))
                except registry.BackendUnsupportedError as err:
                    row.update(status="skipped", reason=str(err))
                except Exception as err:
                    row.update(status="error", reason=f"{type(err).__name__}: {err}")
                rows.append(row)
                if progress is not None:
                    progress(None)
    return rows


def _platform_refusal(name: str) -> str:
    """Why a backend's local compile would measure nothing here (its verdict for a call on this
    host is no, e.g. kernels for another platform), else ""."""
    if name == REFERENCE_ROW:
        return ""
    info = {i.name: i for i in registry.list_backends() if not i.broken}.get(name)
    if info is None or info.available:
        return ""
    return f"{info.reason}; --target v5e compiles for a TPU without one"


def default_rows(target: str | None) -> list[str]:
    """The rows ``gdn2 memory`` measures when none are named.

    Args:
        target: None for this host, else a TPU generation.

    Returns:
        Locally: reference_grad and every backend that would run here. For a target: every
        backend ``backend="auto"`` may pick on a TPU.
    """
    if target is None:
        return [REFERENCE_ROW, *(i.name for i in registry.list_backends() if i.available)]
    return [
        b.name
        for b in registry.usable_backends()
        if judge(b, None, None, trainable=True, auto=True, platform="tpu")
    ]


def to_markdown(rows: Sequence[dict[str, Any]], checks) -> str:
    def mib(x):
        return "-" if x is None else f"{x / 2**20:.1f}"

    lines = [
        "# gdn2 memory (compiled fwd+bwd, MiB)",
        "",
        "| shape | dtype | backend | target | status | temp | argument | output | inputs | "
        "temp/inputs | peak RSS (+ during the step) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shape = BenchShape.from_dict(r["shape"])
        status = "ok" if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
        status = status.replace("|", "/").replace("\n", " ")
        temp = r.get("temp_bytes")
        rss = r.get("peak_rss_bytes")
        rss_cell = "-" if rss is None else f"{mib(rss)} (+{mib(rss - r['baseline_rss_bytes'])})"
        ratio = "-" if temp is None else f"{temp / r['input_bytes']:.2f}"
        lines.append(
            f"| {shape.label} | {r['dtype']} | {r['backend']} | {r['target']} | {status} | "
            f"{mib(temp)} | {mib(r.get('argument_bytes'))} | {mib(r.get('output_bytes'))} | "
            f"{mib(r['input_bytes'])} | {ratio} | {rss_cell} |"
        )
    if checks:
        lines += ["", "## Acceptance target", ""] + [f"- {c.line()}" for c in checks]
    return "\n".join(lines) + "\n"
