"""``gdn2 memory``: compiled peak memory of forward+backward per backend and shape.

Two sources:

- ``memory_analysis()`` of the compiled fwd+bwd program (temp, argument, output, alias and code
  bytes), on the local device or, with a TPU target, from a deviceless TPU compile
  (``jax.experimental.topologies``; no TPU needed, only the libtpu wheel). Compiling measures
  nothing live, so it runs in this process.
- ``--rss``: the peak resident set of one fwd+bwd executed on the local device. That is a property
  of a live process, so each measurement runs in its own subprocess
  (``python -m gdn2core.bench.rss_probe``), isolated from the others and from this one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gdn2core import registry
from gdn2core.bench.programs import REFERENCE_ROW, Programs, direct_backend_programs, programs_for
from gdn2core.bench.shapes import BenchShape
from gdn2core.config import DEFAULT_CONFIG, KernelConfig

#: Backends whose programs lower for TPU (pure JAX or Pallas TPU); the default rows for a target.
TPU_TARGET_ROWS = ("jax_ref", "pallas_tpu")
TARGETS = {"v5e": "v5e:1x1", "v6e": "v6e:1x1"}


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


def _programs(name: str, config: KernelConfig | None, target: str | None) -> Programs:
    if name == REFERENCE_ROW:
        return programs_for(name)
    backend = registry.get_backend(name)
    cfg = config or DEFAULT_CONFIG
    if target is not None:
        # Deviceless: this host's availability says nothing about the TPU we compile for.
        return direct_backend_programs(backend, cfg)
    return programs_for(name, config)


def compiled_memory(
    name: str,
    shape: BenchShape,
    dtype: str,
    *,
    config: KernelConfig | None = None,
    target: str | None = None,
) -> dict[str, Any]:
    """``memory_analysis()`` of the jitted fwd+bwd of row ``name`` (locally or for ``target``)."""
    progs = _programs(name, config, target)
    if target is None:
        xs, h0, cts = _specs(shape, dtype)
        compiled = jax.jit(progs.fwdbwd).lower(xs, h0, cts).compile()
    else:
        from jax.experimental import topologies
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        topo = topologies.get_topology_desc(platform="tpu", topology_name=TARGETS[target])
        mesh = Mesh(topo.devices, ("x",))
        xs, h0, cts = _specs(shape, dtype, NamedSharding(mesh, P()))
        traced = jax.jit(progs.fwdbwd).trace(xs, h0, cts)
        compiled = traced.lower(lowering_platforms=("tpu",)).compile()
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
        [sys.executable, "-m", "gdn2core.bench.rss_probe", payload],
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
    """Why a backend's local compile would measure nothing here (its kernels need another
    platform: on a CPU, pallas_tpu compiles to the callback that raises), else ""."""
    if name == REFERENCE_ROW:
        return ""
    info = {i.name: i for i in registry.list_backends()}.get(name)
    platform = jax.devices()[0].platform
    if info is None or info.capabilities is None or platform in info.capabilities.platforms:
        return ""
    return (
        f"its kernels run on {'/'.join(info.capabilities.platforms)}, not {platform}; "
        "use --target v5e for a deviceless TPU compile"
    )


def default_rows(target: str | None) -> list[str]:
    infos = registry.list_backends()
    if target is not None:
        return [i.name for i in infos if i.name in TPU_TARGET_ROWS and not i.broken]
    return [REFERENCE_ROW, *(i.name for i in infos if i.available)]


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
