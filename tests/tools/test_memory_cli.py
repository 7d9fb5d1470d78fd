"""``gdn2 memory``: compiled memory of fwd+bwd locally, and the deviceless TPU compile."""

from __future__ import annotations

import json

import pytest

from gdn2_tools.bench.checks import memory_check
from gdn2_tools.bench.cli import memory_main
from gdn2_tools.bench.shapes import ACCEPT_REF


def test_memory_local(tmp_path):
    out = tmp_path / "m"
    argv = ["--shape", "1,16,1,8,8", "--dtypes", "float32", "--no-progress", "--out", str(out)]
    rc = memory_main([*argv, "--backends", "reference_grad"])
    assert rc == 0
    (row,) = json.loads((out / "memory.json").read_text())["rows"]
    assert row["status"] == "ok", row
    assert row["argument_bytes"] > 0 and row["output_bytes"] > 0 and row["temp_bytes"] >= 0
    assert row["input_bytes"] == 16 * (4 * 8 + 2 * 8) * 4 + 4 * 8 * 8


def test_memory_check_pass_fail():
    row = {"backend": "jax_ref", "status": "ok", "shape": ACCEPT_REF.as_dict(), "dtype": "float32"}
    (ok,) = memory_check([{**row, "temp_bytes": 10, "input_bytes": 100}], "jax_ref")
    (bad,) = memory_check([{**row, "temp_bytes": 200, "input_bytes": 100}], "jax_ref")
    assert ok.passed and not bad.passed
    # the target is stated for float32; a bf16 row is reported, not judged
    bf16 = {**row, "dtype": "bfloat16", "temp_bytes": 200, "input_bytes": 100}
    assert memory_check([bf16], "jax_ref") == []
    assert memory_check([{**row, "temp_bytes": 10, "input_bytes": 100}], "other") == []


def test_memory_local_skips_backends_for_other_platforms(tmp_path):
    out = tmp_path / "m"
    argv = ["--shape", "1,16,1,64,64", "--dtypes", "float32", "--no-progress", "--out", str(out)]
    assert memory_main([*argv, "--backends", "pallas_tpu"]) == 0
    (row,) = json.loads((out / "memory.json").read_text())["rows"]
    assert row["status"] == "skipped" and "runs on tpu, this call on cpu" in row["reason"], row
    assert "--target v5e" in row["reason"]


def test_memory_default_rows_for_a_tpu_target_by_capability():
    from gdn2_tools.bench.memory import default_rows

    assert default_rows("v5e") == ["pallas_tpu", "jax_ref"]  # auto-pickable on a TPU
    assert default_rows(None)[:2] == ["reference_grad", "jax_ref"]


@pytest.mark.tpu_compile
def test_memory_tpu_target(tmp_path):
    out = tmp_path / "m"
    argv = ["--shape", "1,16,1,8,8", "--dtypes", "float32", "--no-progress", "--out", str(out)]
    rc = memory_main([*argv, "--backends", "reference_grad", "--target", "v5e"])
    assert rc == 0
    (row,) = json.loads((out / "memory-v5e.json").read_text())["rows"]
    assert row["status"] == "ok" and row["target"] == "v5e", row
    assert row["argument_bytes"] > 0
