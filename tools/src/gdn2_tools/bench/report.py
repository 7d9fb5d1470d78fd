"""Report writers: JSON (schema ``gdn2-bench/1``), a Markdown table, and the optional PNG plot.

The JSON is the exchange format: a peer script (``benchmarks/peers``) writes rows in the same
schema, and ``gdn2 bench --include FILE`` adds them to the table, marked with their source.
"""

from __future__ import annotations

import datetime as dt
import json
import platform as py_platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gdn2_conformance.metrics import TOLERANCES
from gdn2_tools.bench.checks import Check
from gdn2_tools.bench.programs import MODE_LABELS, MODES
from gdn2_tools.bench.runner import RowResult, baselines
from gdn2_tools.bench.shapes import BenchShape
from gdn2_tools.bench.timing import Timing

SCHEMA = "gdn2-bench/1"


def environment() -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "platform": dev.platform,
        "device_kind": getattr(dev, "device_kind", str(dev)),
        "device_count": jax.device_count(),
        "python": py_platform.python_version(),
        "host": py_platform.node(),
    }


def to_json(
    results: Sequence[RowResult], checks: Sequence[Check], meta: dict[str, Any]
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "environment": environment(),
        "gate_tolerances": {
            d: {str(q): t for q, t in tol.items()} for d, tol in TOLERANCES.items()
        },
        **meta,
        "rows": [r.as_dict() for r in results],
        "checks": [c.as_dict() for c in checks],
    }


def rows_from_json(path: str | Path) -> list[RowResult]:
    """Rows of a JSON report (e.g. a peer's), marked with their file as the source."""
    data = json.loads(Path(path).read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: expected schema {SCHEMA!r}, got {data.get('schema')!r}")
    env = data.get("environment", {})
    where = f"{Path(path).name} ({env.get('device_kind', '?')})"
    rows = []
    for r in data["rows"]:
        row = RowResult(
            r["backend"],
            BenchShape.from_dict(r["shape"]),
            r["dtype"],
            r["status"],
            r.get("reason", ""),
            source=where,
        )
        for mode, t in (r.get("modes") or {}).items():
            row.modes[mode] = Timing(
                t.get("compile_s") or 0.0, list(t.get("times_s") or []), t.get("pipelined_s")
            )
        row.speedup = r.get("speedup") or {}
        rows.append(row)
    return rows


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _cell(row: RowResult, mode: str) -> str:
    t = row.modes.get(mode)
    if t is None or not t.times_s:
        return "-"
    d = t.as_dict()
    return f"{_ms(d['median_s'])} [{_ms(d['min_s'])}-{_ms(d['max_s'])}]"


def to_markdown(results: Sequence[RowResult], checks: Sequence[Check], meta: dict[str, Any]) -> str:
    env = environment()
    lines = [
        "# gdn2 bench",
        "",
        f"jax {env['jax']} on {env['platform']} ({env['device_kind']}); "
        f"repeats {meta.get('repeats')} (fewer, at least 3, for programs slower than "
        f"{meta.get('time_budget_s')} s / repeats; see each row's JSON), after one warm-up run; "
        "compile excluded. Times in ms: median [min-max] of blocking calls; "
        "fwd+bwd pipelined: as many calls back to back, one wait at the end, per call "
        "(a training loop's way); speed-up = baseline median / row median (same run).",
        "",
    ]
    if meta.get("devices"):
        lines += [f"**{meta['devices']} devices, batch sharded: {meta.get('note', '')}.**", ""]
    bases = [b for b in baselines() if any(r.backend == b for r in results)]
    header = ["shape", "dtype", "backend", "status"]
    header += [f"{MODE_LABELS[m]} ms" for m in MODES]
    header += ["fwd+bwd pipelined ms"]
    header += [f"compile {MODE_LABELS[m]} s" for m in ("fwd", "fwdbwd")]
    header += [f"fwd+bwd vs {b}" for b in bases]
    header += ["gate (worst rel err)", "source"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for r in results:
        if r.status == "ok":
            status = "ok"
        else:
            status = f"{r.status}: {r.reason}".replace("|", "/").replace("\n", " ")
        cells = [r.shape.label, r.dtype, r.backend, status]
        cells += [_cell(r, m) for m in MODES]
        fb = r.modes.get("fwdbwd")
        cells.append(_ms(fb.pipelined_s) if fb is not None and fb.times_s else "-")
        cells += [f"{r.modes[m].compile_s:.2f}" if m in r.modes else "-" for m in ("fwd", "fwdbwd")]
        for b in bases:
            s = r.speedup.get("fwdbwd", {}).get(b)
            cells.append("-" if s is None else f"{s:.2f}x")
        if r.gate is not None and r.gate.errors:
            worst = max(r.gate.errors, key=r.gate.errors.get)
            cells.append(f"{worst} {r.gate.errors[worst]:.1e} vs {r.gate.against}")
        else:
            cells.append("-")
        cells.append(r.source)
        lines.append("| " + " | ".join(cells) + " |")
    if checks:
        lines += ["", "## Acceptance targets", ""]
        lines += [f"- {c.line()}" for c in checks]
    lines += ["", "Gate tolerances (max|x - ref| / max|ref|; gdn2_conformance.metrics):", ""]
    for dtype, tol in TOLERANCES.items():
        lines.append(f"- {dtype}: " + ", ".join(f"{k} {v:.0e}" for k, v in tol.items()))
    return "\n".join(lines) + "\n"


def write_reports(
    out: Path, results: Sequence[RowResult], checks: Sequence[Check], meta: dict[str, Any]
) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "bench.json", out / "bench.md"
    json_path.write_text(json.dumps(to_json(results, checks, meta), indent=2) + "\n")
    md_path.write_text(to_markdown(results, checks, meta))
    return json_path, md_path


def plot(results: Sequence[RowResult], path: Path) -> Path | None:
    """PNG: median time per (batch x head) against T, one panel per mode; a colour per backend,
    a line style per dtype. Normalising by B*H puts shapes of different batch and head counts on
    one line per backend (head sizes still differ between shapes; the table has the details)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.status == "ok" and r.modes]
    if not ok:
        return None
    fig, axes = plt.subplots(1, len(MODES), figsize=(5 * len(MODES), 4), squeeze=False)
    styles = {"float32": "-", "bfloat16": "--", "float64": ":"}
    backends = sorted({r.backend for r in ok})
    colours = {b: f"C{i % 10}" for i, b in enumerate(backends)}
    for ax, mode in zip(axes[0], MODES, strict=True):
        for backend in backends:
            for dtype in sorted({r.dtype for r in ok}):
                pts = sorted(
                    (r.shape.T, r.median(mode) * 1e3 / (r.shape.B * r.shape.H))
                    for r in ok
                    if r.backend == backend and r.dtype == dtype and r.median(mode)
                )
                if not pts:
                    continue
                xs, ys = zip(*pts, strict=True)
                ax.plot(
                    xs,
                    ys,
                    styles.get(dtype, "-"),
                    color=colours[backend],
                    marker="o",
                    label=f"{backend} {dtype}",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("median ms per (batch x head)")
        ax.set_title(MODE_LABELS[mode])
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("gdn2 bench: " + ", ".join(sorted({r.shape.label for r in ok})), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
