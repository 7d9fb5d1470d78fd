"""``gdn2 bench`` and ``gdn2 memory`` (wired in ``gdn2core.cli``); each takes argv, returns a code."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from gdn2_tools.bench.programs import REFERENCE_ROW
from gdn2_tools.bench.shapes import SHAPE_LISTS, BenchShape, parse_shape
from gdn2_tools.chips import CHIPS
from gdn2_tools.preflight import missing
from gdn2core.config import PRESETS, KernelConfig

DTYPES = ("float32", "bfloat16")


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _shape_arg(text: str) -> BenchShape:
    try:
        return parse_shape(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _check_backends(p: argparse.ArgumentParser, names: Sequence[str] | None) -> None:
    """Refuse, before any work, a ``--backends`` name that is neither a row nor installed."""
    if not names:
        return
    from gdn2core.registry import installed_names, list_backends

    known = {i.name for i in list_backends()}
    unknown = [n for n in names if n != REFERENCE_ROW and n not in known]
    if unknown:
        rows = ", ".join([REFERENCE_ROW, *installed_names()])
        p.error(f"--backends: not installed: {', '.join(unknown)} (rows here: {rows})")


def _preflight(p: argparse.ArgumentParser, *needs: str | None) -> None:
    problems = [n for n in needs if n]
    if problems:
        p.exit(2, "\n".join(problems) + "\n")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shapes",
        choices=sorted(SHAPE_LISTS),
        default="cpu",
        help="named shape list (default cpu: a few minutes on 2 cores; seed: H=6, d=128, "
        "T up to 4096; packed: unpacked and packed rows of one B*T; gva: H=16, HV=32 and the "
        "plain call on repeated heads)",
    )
    p.add_argument(
        "--shape",
        action="append",
        type=_shape_arg,
        metavar="B,T,H,DK,DV",
        help="explicit shape (repeatable; replaces --shapes); append ,hv=N for grouped value "
        "heads, ,seqs=N for N packed sequences per row",
    )
    p.add_argument(
        "--backends",
        type=_csv,
        default=None,
        help="comma-separated rows (backend names, or reference_grad); default: all",
    )
    p.add_argument("--dtypes", type=_csv, default=list(DTYPES), help="default float32,bfloat16")
    p.add_argument(
        "--config",
        choices=sorted(PRESETS),
        default=None,
        help="KernelConfig preset (default: none, each op's default config)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="report folder (default %(default)s)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _shapes(args) -> list[BenchShape]:
    return list(args.shape) if args.shape else list(SHAPE_LISTS[args.shapes])


def _config(args) -> KernelConfig | None:
    return PRESETS[args.config] if args.config else None


def _check_dtypes(dtypes: Sequence[str]) -> None:
    bad = [d for d in dtypes if d not in ("float32", "bfloat16", "float64")]
    if bad:
        raise SystemExit(f"--dtypes: unknown {bad}; choose from float32, bfloat16, float64")


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[tuple]:
    """``(describe, advance)`` callbacks driving a rich progress bar on stderr."""
    if not enabled:
        yield (lambda _d: None), (lambda: None)
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=False) as prog:
        task = prog.add_task("starting", total=total)

        def describe(d):
            prog.update(task, description=d)

        def advance():
            prog.advance(task)

        yield describe, advance


def _print_table(results, note: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    from gdn2_tools.bench.programs import MODES
    from gdn2_tools.bench.runner import baselines

    bases = baselines()
    table = Table(title="gdn2 bench (median ms, compile excluded)" + (f"; {note}" if note else ""))
    for col in ("shape", "dtype", "backend", "status", "fwd", "bwd", "fwd+bwd", "pipelined"):
        table.add_column(col)
    for b in bases:
        table.add_column(f"x vs {b}")
    for r in results:
        status = "ok" if r.status == "ok" else f"{r.status}: {r.reason}"[:90]
        cells = [r.shape.label, r.dtype, r.backend, status]
        cells += [f"{r.median(m) * 1e3:.2f}" if r.median(m) else "-" for m in MODES]
        fb = r.modes.get("fwdbwd") if r.median("fwdbwd") else None
        cells.append(f"{fb.pipelined_s * 1e3:.2f}" if fb and fb.pipelined_s else "-")
        for b in bases:
            s = r.speedup.get("fwdbwd", {}).get(b)
            cells.append("-" if s is None else f"{s:.2f}")
        table.add_row(*cells)
    Console(width=200).print(table)


def bench_main(argv: Sequence[str]) -> int:
    """Run ``gdn2 bench``.

    Args:
        argv: the arguments after ``gdn2 bench`` (``--help`` lists them).

    Returns:
        0; 1 when a row was rejected by the gate or failed; 2 for a usage error or a missing extra.
    """
    if "--decode" in argv:
        from gdn2_tools.bench.decode import decode_main

        return decode_main([a for a in argv if a != "--decode"])
    if "--serve" in argv:
        from gdn2_tools.bench.serve import serve_main

        return serve_main([a for a in argv if a != "--serve"])
    p = argparse.ArgumentParser(
        prog="gdn2 bench",
        description="Time every available backend (correctness-gated) for forward, backward and "
        "forward+backward; writes bench.json and bench.md into --out.",
    )
    p.add_argument(
        "--decode",
        action="store_true",
        help="time one decode step per backend instead (gdn2 bench --decode --help)",
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="time one serving step through gdn2_ragged instead (gdn2 bench --serve --help)",
    )
    _common(p)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per program (default 5)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=10.0,
        metavar="S",
        help="cut the repeats of a program whose warm-up run took w seconds to max(3, S / w) "
        "(default 10; 0 disables: always --repeats)",
    )
    p.add_argument("--seed", type=int, default=0, help="input seed (default %(default)s)")
    p.add_argument("--plot", action="store_true", help="also write bench.png (time against T)")
    p.add_argument(
        "--interpret",
        action="store_true",
        help="run TPU-only (Pallas) backends off a TPU in interpret mode (very slow)",
    )
    p.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="JSON",
        help="add the rows of another report in the same schema (e.g. a peer's) to the table",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        metavar="N",
        help="shard the batch over N devices (simulated CPU devices when fewer are present; "
        "re-runs itself in a subprocess): checks outputs and gradients against the "
        "single-device reference; timings are not a speed claim. Every B must divide by N. "
        "Reports go to --out/devices-N (default 1: no sharding)",
    )
    args = p.parse_args(list(argv))
    _check_dtypes(args.dtypes)
    _preflight(
        p,
        missing("rich", why="gdn2 bench (table and progress bar)"),
        missing("matplotlib", extra="plot", why="gdn2 bench --plot") if args.plot else None,
    )
    _check_backends(p, args.backends)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.devices < 1:
        p.error("--devices must be >= 1")
    shapes = _shapes(args)
    place, note, out = None, "", args.out
    if args.devices > 1:
        bad = [s.label for s in shapes if s.B % args.devices]
        if bad:
            p.error(f"--devices {args.devices}: batch B must divide by it; not at {bad}")
        from gdn2_tools.bench import devices as devices_mod

        found = devices_mod.find_devices(args.devices)
        if found is None:
            return devices_mod.reexec(list(argv), args.devices)
        mesh = devices_mod.make_mesh(found)
        place, note = devices_mod.batch_placer(mesh), devices_mod.SPEED_NOTE
        out = args.out / f"devices-{args.devices}"
        print(devices_mod.describe(mesh))
        for s in shapes:
            print(f"  {s.label}: {devices_mod.plan_label(mesh, s)}")

    from gdn2_tools.bench import checks as checks_mod
    from gdn2_tools.bench import report
    from gdn2_tools.bench.runner import Bench, plan_rows, trusted_backend

    plans = plan_rows(args.backends, interpret=args.interpret, config=_config(args))
    with _progress(len(plans) * len(shapes) * len(args.dtypes), not args.no_progress) as (
        describe,
        advance,
    ):
        bench = Bench(
            plans,
            shapes,
            args.dtypes,
            repeats=args.repeats,
            budget_s=args.time_budget or None,
            seed=args.seed,
            progress=describe,
            advance=advance,
            place=place,
        )
        results = bench.run()
    # simulated devices share this host's cores: no speed targets are judged on them
    subject = trusted_backend() if args.devices == 1 else None
    checks = checks_mod.speed_checks(results, subject)
    checks += checks_mod.feature_checks(results, subject)
    for path in args.include:
        results += report.rows_from_json(path)
    meta = {
        "command": "gdn2 bench " + " ".join(argv),
        "repeats": args.repeats,
        "time_budget_s": args.time_budget,
        "seed": args.seed,
        "config": args.config or "default",
    }
    if args.devices > 1:
        meta["devices"] = args.devices
        meta["note"] = note + " (outputs and gradients gated against the single-device reference)"
    json_path, md_path = report.write_reports(out, results, checks, meta)
    print(f"wrote {json_path} and {md_path}")
    _print_table(results, note)
    if args.plot:
        png = report.plot(results, out / "bench.png")
        print(f"wrote {png}" if png else "no timed rows to plot")
    for c in checks:
        print(c.line())
    bad = [r for r in results if r.status in ("rejected", "error") and r.source == "this run"]
    for r in bad:
        print(f"{r.status.upper()}: {r.backend} {r.dtype} {r.shape.label}: {r.reason}")
    return 1 if bad else 0


def memory_main(argv: Sequence[str]) -> int:
    """Run ``gdn2 memory``.

    Args:
        argv: the arguments after ``gdn2 memory`` (``--help`` lists them).

    Returns:
        0; 1 when a row failed; 2 for a usage error or a missing extra.
    """
    p = argparse.ArgumentParser(
        prog="gdn2 memory",
        description="Compiled fwd+bwd memory (memory_analysis: temp, argument, output bytes) per "
        "backend and shape, locally or for a TPU target from a deviceless compile.",
    )
    _common(p)
    p.add_argument(
        "--target",
        choices=sorted(CHIPS),
        default=None,
        help="compile for this TPU without one (libtpu); its default rows: the backends auto may "
        "pick on a TPU (default: none, compile and measure here)",
    )
    p.add_argument(
        "--rss",
        action="store_true",
        help="also measure peak RSS of one fwd+bwd, one subprocess per measurement (local only)",
    )
    args = p.parse_args(list(argv))
    _check_dtypes(args.dtypes)
    _preflight(
        p,
        missing("rich", why="gdn2 memory (progress bar)") if not args.no_progress else None,
        missing("libtpu", extra="tpu", why=f"gdn2 memory --target {args.target}")
        if args.target
        else None,
    )
    _check_backends(p, args.backends)

    from gdn2_tools.bench import memory
    from gdn2_tools.bench.checks import memory_check
    from gdn2_tools.bench.runner import trusted_backend

    shapes = _shapes(args)
    names = args.backends or memory.default_rows(args.target)
    if not names:
        print("gdn2 memory: no backend to measure", file=sys.stderr)
        return 2
    total = len(names) * len(shapes) * len(args.dtypes)
    with _progress(total, not args.no_progress) as (describe, advance):

        def progress(d):
            if d is None:
                advance()
            else:
                describe(d)

        rows = memory.measure(
            names,
            shapes,
            args.dtypes,
            config=_config(args),
            target=args.target,
            rss=args.rss,
            progress=progress,
        )
    checks = memory_check(rows, trusted_backend())
    md = memory.to_markdown(rows, checks)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"memory-{args.target}" if args.target else "memory"
    (args.out / f"{stem}.json").write_text(
        json.dumps(
            {
                "schema": "gdn2-memory/1",
                "command": "gdn2 memory " + " ".join(argv),
                "rows": rows,
                "checks": [c.as_dict() for c in checks],
            },
            indent=2,
        )
        + "\n"
    )
    (args.out / f"{stem}.md").write_text(md)
    print(md)
    print(f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.md')}")
    return 1 if any(r["status"] == "error" for r in rows) else 0
