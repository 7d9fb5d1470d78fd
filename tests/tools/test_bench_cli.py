"""``gdn2 bench``: the CLI writes its reports; the gate rejects a wrong backend; the checks; bad
arguments and missing extras are refused before any work starts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gdn2_conformance import tolerance
from gdn2_tools.bench import gate
from gdn2_tools.bench.checks import speed_checks
from gdn2_tools.bench.cli import bench_main, memory_main
from gdn2_tools.bench.runner import RowResult
from gdn2_tools.bench.shapes import ACCEPT_REF, ACCEPT_SCAN, CPU_SHAPES, BenchShape, parse_shape
from gdn2_tools.bench.timing import Timing

TINY = "1,16,1,8,8"


def _run(tmp_path, backends, *extra):
    out = tmp_path / "out"
    argv = ["--shape", TINY, "--repeats", "2", "--dtypes", "float32", "--no-progress"]
    rc = bench_main([*argv, "--backends", backends, "--out", str(out), *extra])
    return rc, json.loads((out / "bench.json").read_text()), (out / "bench.md").read_text()


def test_bench_writes_json_and_markdown(tmp_path, test_backends):
    rc, data, md = _run(tmp_path, "reference_grad,test_reference", "--plot")
    assert rc == 0
    assert data["schema"] == "gdn2-bench/1"
    rows = {r["backend"]: r for r in data["rows"]}
    assert set(rows) == {"reference_grad", "test_reference"}
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["gate"]["ok"] and row["gate"]["against"] == "reference"
        assert set(row["modes"]) == {"fwd", "bwd", "fwdbwd"}
        for t in row["modes"].values():
            assert t["repeats"] == 2 and len(t["times_s"]) == 2
            assert t["min_s"] <= t["median_s"] <= t["max_s"]
            assert t["compile_s"] > 0
            assert t["pipelined_s"] > 0  # the same count of calls back to back, per call
    assert rows["test_reference"]["speedup"]["fwdbwd"]["reference_grad"] > 0
    pipelined = rows["test_reference"]["modes"]["fwdbwd"]["pipelined_s"] * 1e3
    assert "| fwd+bwd pipelined ms |" in md and f"| {pipelined:.2f} |" in md
    assert "| B=1 T=16 H=1 dk=8 dv=8 | float32 | test_reference | ok |" in md
    assert (tmp_path / "out" / "bench.png").stat().st_size > 0


def test_gate_rejects_a_wrong_backend(tmp_path, test_backends, capsys):
    rc, data, md = _run(tmp_path, "test_perturbed")
    assert rc == 1
    (row,) = data["rows"]
    assert row["status"] == "rejected"
    assert row["modes"] == {}  # never timed
    assert not row["gate"]["ok"]
    assert any(f.startswith("o:") for f in row["gate"]["failures"])
    assert row["gate"]["errors"]["dq"] <= tolerance("float32", "dq")  # only o is wrong
    assert "rejected" in md
    assert "REJECTED: test_perturbed" in capsys.readouterr().out


def test_unknown_backend_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        _run(tmp_path, "no_such_backend")
    assert exit_.value.code == 2
    assert "--backends: not installed: no_such_backend (rows here: reference_grad, jax_ref" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "out").exists()


def test_a_bad_shape_says_what_is_expected(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_main(["--shape", "1,2,3", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert (
        "argument --shape: expected B,T,H,DK or B,T,H,DK,DV (4 or 5 integers), got 3 in '1,2,3'"
        in err
    )


def test_missing_extras_are_named_before_any_work(tmp_path, capsys, monkeypatch):
    """No rich (or no matplotlib with --plot): exit 2 at once, naming the install command; with
    rich broken (installed but failing to import), say that instead."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exit_:
        _run(tmp_path, "reference_grad", "--plot")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "gdn2 bench --plot needs matplotlib" in err and "gdn2-tools[plot] @ git+" in err
    assert not (tmp_path / "out").exists()
    monkeypatch.setitem(sys.modules, "rich", None)
    with pytest.raises(SystemExit):
        _run(tmp_path, "reference_grad")
    assert "gdn2 bench (table and progress bar) needs rich, which is not installed" in (
        capsys.readouterr().err
    )
    broken = tmp_path / "site" / "rich"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('rich built for another Python')\n")
    monkeypatch.delitem(sys.modules, "rich")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(SystemExit):
        _run(tmp_path, "reference_grad")
    err = capsys.readouterr().err
    assert "needs rich, which is installed but fails to import (ImportError: rich built" in err


def test_results_are_written_before_the_table(tmp_path, test_backends, monkeypatch):
    """A failure after the run (here: printing the table) cannot lose the results."""
    from gdn2_tools.bench import cli

    def broken_table(*_a, **_k):
        raise RuntimeError("terminal went away")

    monkeypatch.setattr(cli, "_print_table", broken_table)
    with pytest.raises(RuntimeError, match="terminal went away"):
        _run(tmp_path, "test_reference")
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert data["rows"][0]["status"] == "ok"


def test_gate_uses_the_kit_metric_and_tolerances():
    ref = np.linspace(1.0, 2.0, 100)
    ok = gate.compare({"o": ref * (1 + 1e-5)}, {"o": ref}, "float32", "ref")
    assert ok.ok and ok.errors["o"] == pytest.approx(1e-5)
    bad = gate.compare({"o": ref * 1.01}, {"o": ref}, "float32", "ref")
    assert not bad.ok and bad.failures == ("o: rel err 1.00e-02 > tol 1e-04",)
    nan = gate.compare({"o": np.full(100, np.nan)}, {"o": ref}, "bfloat16", "ref")
    assert not nan.ok and "non-finite" in nan.failures[0]
    assert gate.compare({"dg (bwd)": ref * 1.01}, {"dg (bwd)": ref}, "bfloat16", "ref").ok
    # off the CPU, float32 matmuls at default precision: a wider float32 tolerance
    assert gate.compare({"o": ref * (1 + 5e-4)}, {"o": ref}, "float32", "ref", "tpu").ok


def test_shapes():
    assert ACCEPT_REF in CPU_SHAPES and ACCEPT_SCAN in CPU_SHAPES
    assert parse_shape("2,2048,4,128") == BenchShape(2, 2048, 4, 128, 128)
    assert parse_shape("1,64,2,16,32") == BenchShape(1, 64, 2, 16, 32)
    with pytest.raises(ValueError, match="4 or 5 integers"):
        parse_shape("1,2,3")
    with pytest.raises(ValueError, match="expected integers"):
        parse_shape("1,2,3,x")


def _row(backend, shape, mode_times):
    r = RowResult(backend, shape, "float32", "ok")
    for mode, t in mode_times.items():
        r.modes[mode] = Timing(0.1, [t, t])
    return r


def test_speed_checks_report_pass_and_fail():
    rows = [
        _row("reference_grad", ACCEPT_REF, {"fwd": 0.10, "fwdbwd": 1.0}),
        _row("jax_ref", ACCEPT_REF, {"fwd": 0.20, "fwdbwd": 0.1}),
        _row("scan_baseline", ACCEPT_SCAN, {"fwdbwd": 1.0}),
        _row("jax_ref", ACCEPT_SCAN, {"fwdbwd": 0.1}),
    ]
    checks = {c.name: c for c in speed_checks(rows, "jax_ref")}
    assert checks["jax_ref fwdbwd >= 4x reference_grad"].passed
    assert not checks["jax_ref fwd no slower than reference_grad fwd"].passed
    assert not checks["jax_ref fwdbwd >= 20x scan_baseline"].passed
    assert "10.00x" in checks["jax_ref fwdbwd >= 20x scan_baseline"].detail
    assert speed_checks(rows, None) == []


def test_include_adds_rows_of_another_report(tmp_path, test_backends):
    rc, first, _ = _run(tmp_path, "test_reference")
    assert rc == 0
    peer = tmp_path / "peer.json"
    first["rows"][0]["backend"] = "peer_impl"  # stands in for a peer script's report
    peer.write_text(json.dumps(first))
    out = tmp_path / "second"
    argv = ["--shape", TINY, "--repeats", "2", "--dtypes", "float32", "--no-progress"]
    rc = bench_main(
        [*argv, "--backends", "test_reference", "--out", str(out), "--include", str(peer)]
    )
    assert rc == 0
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [r["backend"] for r in rows] == ["test_reference", "peer_impl"]
    assert rows[1]["source"].startswith("peer.json") and rows[1]["modes"]["fwd"]["repeats"] == 2
    # the included row keeps its pipelined time
    assert (
        rows[1]["modes"]["fwdbwd"]["pipelined_s"]
        == first["rows"][0]["modes"]["fwdbwd"]["pipelined_s"]
    )
    assert "| peer_impl | ok |" in (out / "bench.md").read_text()


def test_rows_and_baselines_are_chosen_by_capability():
    """Baselines: reference_grad and the named-only backends; the trusted backend: the one auto
    picks here; pallas_tpu: a row only with --interpret on this CPU host."""
    from gdn2_tools.bench import runner

    assert runner.baselines() == ("reference_grad", "scan_baseline")
    assert runner.trusted_backend() == "jax_ref"
    plans = {p.name: p for p in runner.plan_rows(None)}
    assert plans["pallas_tpu"].programs is None and "--interpret" in plans["pallas_tpu"].skip
    with_interpret = {p.name: p for p in runner.plan_rows(["pallas_tpu"], interpret=True)}
    assert with_interpret["pallas_tpu"].config.interpret


def test_gate_falls_back_to_a_checked_backend(monkeypatch, test_backends):
    """Where the reference's autodiff does not fit, the trusted result is the trusted backend
    (the one auto picks; here the test reference stands in), itself first checked at a smaller
    shape."""
    from gdn2_tools.bench import runner

    monkeypatch.setattr(runner, "trusted_backend", lambda dtype="float32": "test_reference")
    plans = runner.plan_rows(["test_perturbed", "reference_grad", "test_reference"])
    assert [p.name for p in plans] == ["reference_grad", "test_reference", "test_perturbed"]
    bench = runner.Bench(plans, [parse_shape(TINY)], ["float32"], repeats=2)
    bench.device_bytes = 0  # nothing is affordable: forces the fallback
    ref, trusted, wrong = bench.run()
    assert ref.status == "skipped" and "budget" in ref.reason
    assert trusted.status == "ok", trusted.reason
    assert trusted.gate.against.startswith("test_reference float32 (itself ok vs reference at")
    assert wrong.status == "rejected" and not wrong.modes


def _help(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


def _description(text: str) -> str:
    """The description of an argparse help text (between the usage and the options), joined."""
    body = text.split("\n\n", 1)[1].split("\noptions:")[0]
    return " ".join(body.split())


def _option_helps(text: str) -> dict[str, str]:
    """``{option: its help text, joined}`` of the options section of an argparse help text."""
    helps, current = {}, None
    for line in text.split("\noptions:\n", 1)[1].splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            helps[current] = line
        elif current is not None:
            helps[current] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in helps.items()}


def test_decode_bench_help_is_not_cut(capsys):
    """The description was the first line of a docstring sentence ("..., correctness-gated,
    and"): now the whole first paragraph, ending with its full stop."""
    text = _help(bench_main, ["--decode", "--help"], capsys)
    description = _description(text)
    assert description.endswith("static cycle estimate against the HBM bound."), description
    assert "correctness-gated, and the accuracy cost of a bfloat16 state pool" in description


def test_help_texts_show_every_default(capsys):
    """Every option of gdn2 tpu-report and gdn2 bench that takes a value says its default (the
    plain flags and the repeatable options aside)."""
    from gdn2_tools.tpu_report import main as tpu_main

    tpu = _help(tpu_main, ["--help"], capsys)
    assert _description(tpu).endswith("the compiled HBM of its forward and train step."), tpu
    helps = _option_helps(tpu)
    flags = {"-h", "--no-compile", "--estimate", "--segment-ids", "--value-gates", "--table"}
    for option, text in helps.items():
        assert option in flags or "default" in text, (option, text)
    for option, default in (("--batch", 8), ("--seq-len", 4096), ("--heads", 6), ("--dk", 128)):
        assert f"(default {default})" in helps[option], helps[option]
    assert "(default bfloat16)" in helps["--dtype"] and "(default v5e)" in helps["--tpu"]
    bench = _option_helps(_help(bench_main, ["--help"], capsys))
    flags = {
        "-h",
        "--decode",
        "--serve",
        "--no-progress",
        "--plot",
        "--interpret",
        "--shape",
        "--include",
    }
    for option, text in bench.items():
        assert option in flags or "default" in text, (option, text)
    assert "(default bench-results)" in bench["--out"] and "(default 0)" in bench["--seed"]
    memory = _option_helps(_help(memory_main, ["--help"], capsys))
    flags = {"-h", "--no-progress", "--rss", "--shape"}
    for option, text in memory.items():
        assert option in flags or "default" in text, (option, text)
