"""python -m gdn2_tools.wallclock: rows in order, the cross-check against the first row of the same
dtype and program, and refused specs naming what was expected."""

from __future__ import annotations

import json

import pytest

from gdn2_conformance import Decay
from gdn2_tools import wallclock
from gdn2_tools.bench.inputs import make_inputs
from gdn2_tools.bench.shapes import parse_shape


def test_rows_time_each_program_and_cross_check_the_first_of_their_kind(tmp_path, capsys):
    out = tmp_path / "times.jsonl"
    options = ["--shape", "1,24,2,16", "--repeats", "2", "--decay", "mixed", "--out", str(out)]
    specs = ["jax_ref:float32:forward", "scan_baseline:float32:forward", "jax_ref:float32:train"]
    assert wallclock.main([*specs, *options]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["spec"] for r in rows] == specs
    assert capsys.readouterr().out.count("median_ms") == 3
    for r in rows:
        assert r["median_ms"] > 0 and r["repeats"] == 2 and r["finite"] and r["decay"] == "mixed"
        assert r["pipelined_ms"] > 0
        assert r["kernels"] == 0  # XLA programs on a CPU: no Mosaic kernel
    # The scan against the chunked jax_ref, both float32 on the same inputs: a chunked sum's
    # rounding (the kit's float32 tolerance is 1e-4); a wrong pairing of rows would be O(1).
    assert rows[1]["diff_vs"] == specs[0] and rows[1]["diff"] < 1e-5
    assert "diff" not in rows[0] and "diff" not in rows[2]  # the first of their program


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["jax_ref:float16:forward"], "DTYPE float32 or bfloat16"),
        (["jax_ref:float32:backward"], "PROGRAM one of ('forward', 'train')"),
        (["jax_ref:float32:forward", "--shape", "1,2,3"], "expected B,T,H,DK or B,T,H,DK,DV"),
        (["jax_ref:float32:forward", "--decay", "bounded"], "invalid choice: 'bounded'"),
    ],
)
def test_a_bad_spec_or_shape_is_refused_by_name(argv, needle, capsys):
    with pytest.raises(SystemExit):
        wallclock.main(argv)
    assert needle in capsys.readouterr().err


def test_the_decay_named_is_the_one_the_inputs_draw():
    # weak: -1e-3 * sigmoid(N), so every log decay lies in (-1e-3, 0); model: -A softplus(...)
    # with A >= 1, far below that somewhere among 1536 draws.
    shape = parse_shape("2,24,2,16")
    weak = make_inputs(shape, "float32", decay=Decay.WEAK)[0][5]
    model = make_inputs(shape, "float32")[0][5]
    assert float(weak.min()) > -1e-3 and float(weak.max()) < 0
    assert float(model.min()) < -0.1


def test_trace_gives_each_op_its_time_per_call(tmp_path):
    # On a CPU the trace's ops are the host's XLA threads: the jitted forward's fusions, each with
    # a positive time per call, summing to less than the call's wall clock (the gaps between ops).
    out = tmp_path / "times.jsonl"
    options = ["--shape", "1,64,2,16", "--repeats", "2", "--trace", "3", "--out", str(out)]
    assert wallclock.main(["jax_ref:float32:forward", *options]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["op_ms"], row.get("trace_lines")
    assert all(ms > 0 for ms in row["op_ms"].values())
    # 3x, not 1x: a CPU trace's ops may run on several XLA threads at once, so their summed
    # per-call times could exceed the call's wall clock (seen here: 0.01x to 0.17x of it).
    assert sum(row["op_ms"].values()) < 3 * row["median_ms"]
    assert list(row["op_ms"].values()) == sorted(row["op_ms"].values(), reverse=True)


def test_a_negative_trace_count_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        wallclock.main(["jax_ref:float32:forward", "--trace", "-1"])
    assert "--trace: expected a count >= 0, got -1" in capsys.readouterr().err
