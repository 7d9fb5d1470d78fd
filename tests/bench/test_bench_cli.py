"""``gdn2 bench``: the CLI writes its reports; the gate rejects a wrong backend; the checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gdn2core.bench import gate
from gdn2core.bench.checks import speed_checks
from gdn2core.bench.cli import bench_main
from gdn2core.bench.runner import RowResult
from gdn2core.bench.shapes import ACCEPT_REF, ACCEPT_SCAN, CPU_SHAPES, BenchShape, parse_shape
from gdn2core.bench.timing import Timing

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
    assert rows["test_reference"]["speedup"]["fwdbwd"]["reference_grad"] > 0
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
    assert row["gate"]["errors"]["dq"] <= gate.tolerance("float32", "dq")  # only o is wrong
    assert "rejected" in md
    assert "REJECTED: test_perturbed" in capsys.readouterr().out


def test_unknown_backend_is_skipped_with_reason(tmp_path):
    rc, data, _ = _run(tmp_path, "no_such_backend")
    assert rc == 0
    (row,) = data["rows"]
    assert row["status"] == "skipped" and "not installed" in row["reason"]


def test_compare_tolerances():
    ref = np.linspace(1.0, 2.0, 100)
    ok = gate.compare({"o": ref * (1 + 1e-5)}, {"o": ref}, "float32", "ref")
    assert ok.ok and ok.errors["o"] < 1e-4
    bad = gate.compare({"o": ref * 1.01}, {"o": ref}, "float32", "ref")
    assert not bad.ok
    nan = gate.compare({"o": np.full(100, np.nan)}, {"o": ref}, "bfloat16", "ref")
    assert not nan.ok and "non-finite" in nan.failures[0]
    assert gate.compare({"dg": ref * 1.01}, {"dg": ref}, "bfloat16", "ref").ok
    assert gate.tolerance("float32", "o (fwd)") == gate.tolerance("float32", "o")
    assert gate.tolerance("float32", "dg (bwd)") == gate.tolerance("float32", "dg")


def test_shapes():
    assert ACCEPT_REF in CPU_SHAPES and ACCEPT_SCAN in CPU_SHAPES
    assert parse_shape("2,2048,4,128") == BenchShape(2, 2048, 4, 128, 128)
    assert parse_shape("1,64,2,16,32") == BenchShape(1, 64, 2, 16, 32)
    with pytest.raises(ValueError):
        parse_shape("1,2,3")


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
    checks = {c.name: c for c in speed_checks(rows)}
    assert checks["jax_ref fwd+bwd >= 4x reference_grad"].passed
    assert not checks["jax_ref fwd no slower than reference fwd"].passed
    assert not checks["jax_ref fwd+bwd >= 20x scan_baseline"].passed
    assert "10.00x" in checks["jax_ref fwd+bwd >= 20x scan_baseline"].detail


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
    assert "| peer_impl | ok |" in (out / "bench.md").read_text()


def test_gate_falls_back_to_a_checked_backend(monkeypatch, test_backends):
    """Where the reference's autodiff does not fit, the trusted result is the trusted backend
    (jax_ref; here the test reference stands in), itself first checked at a smaller shape."""
    from gdn2core.bench import runner

    monkeypatch.setattr(runner, "TRUSTED_BACKEND", "test_reference")
    plans = runner.plan_rows(["test_perturbed", "reference_grad", "test_reference"])
    assert [p.name for p in plans] == ["reference_grad", "test_reference", "test_perturbed"]
    bench = runner.Bench(plans, [parse_shape(TINY)], ["float32"], repeats=2)
    bench.device_bytes = 0  # nothing is affordable: forces the fallback
    ref, trusted, wrong = bench.run()
    assert ref.status == "skipped" and "budget" in ref.reason
    assert trusted.status == "ok", trusted.reason
    assert trusted.gate.against.startswith("test_reference float32 (itself ok vs reference at")
    assert wrong.status == "rejected" and not wrong.modes
