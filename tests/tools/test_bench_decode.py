"""``gdn2 bench --decode``: rows gated against the decode reference, then timed; a wrong decode is
rejected and never timed; the bfloat16-pool drift; the TPU static estimate of the kernel."""

from __future__ import annotations

import json

import pytest

import gdn2core
from gdn2_conformance import ReferenceBackend
from gdn2_tools.bench.cli import bench_main
from gdn2_tools.bench.decode import decode_rows

SMALL = ["--sizes", "1,3", "--heads", "1", "--value-heads", "2", "--dk", "8", "--dv", "8"]


class WrongDecode(ReferenceBackend):
    """The decode reference with 5% of v added to o: the gate must reject it."""

    name = "test_wrong_decode"

    def decode(self, q, k, v, w, b, g, state, slots, *, spec, config):
        o, pool, states = super().decode(q, k, v, w, b, g, state, slots, spec=spec, config=config)
        return o + 0.05 * v.astype(o.dtype), pool, states


@pytest.fixture
def decode_backends():
    backends = [ReferenceBackend("test_reference"), WrongDecode()]
    for be in backends:
        gdn2core.register_backend(be, replace=True)
    yield
    for be in backends:
        gdn2core.unregister_backend(be.name)


def _run(tmp_path, *argv):
    rc = bench_main(["--decode", *SMALL, "--repeats", "2", "--out", str(tmp_path), *argv])
    return (
        rc,
        json.loads((tmp_path / "decode.json").read_text()),
        (tmp_path / "decode.md").read_text(),
    )


def test_decode_bench_gates_times_and_measures_drift(tmp_path, decode_backends):
    rc, data, md = _run(
        tmp_path, "--backends", "reference,jax_ref,test_reference", "--drift-steps", "8"
    )
    assert rc == 0
    rows = data["rows"]
    assert {(r["backend"], r["shape"]["N"], r["pool_dtype"]) for r in rows} == {
        (b, n, p) for b in ("reference", "jax_ref", "test_reference") for n in (1, 3)
        for p in ("float32", "bfloat16")
    }  # fmt: skip
    for r in rows:
        assert r["status"] == "ok" and r["gate"]["ok"] and len(r["times_s"]) == 2, r
    drift = {d["backend"]: d for d in data["drift"]}
    assert set(drift) == {"jax_ref", "test_reference"} and drift["jax_ref"]["steps"] == 8
    assert 0 < drift["jax_ref"]["state"] < 5e-2  # bfloat16 rounding, not a wrong result
    assert "| N=3 S=1 H=1 HV=2 dk=8 dv=8 | float32 | float32 | jax_ref | ok |" in md


def test_decode_bench_rejects_a_wrong_decode(tmp_path, decode_backends):
    rc, data, _ = _run(tmp_path, "--backends", "test_wrong_decode", "--drift-steps", "0")
    assert rc == 1
    for r in data["rows"]:
        assert r["status"] == "rejected" and "times_s" not in r
        assert any(f.startswith("o (decode)") for f in r["gate"]["failures"])


def test_decode_rows_by_capability():
    rows, skipped = decode_rows(None)
    assert rows[0] == "reference" and "jax_ref" in rows
    assert "no decode op" in skipped["scan_baseline"]
    assert "runs on tpu" in skipped["pallas_tpu"]


def test_decode_bench_tpu_static_estimate(tmp_path):
    """The kernels' static cycle estimate at N = 1 (H = 1, HV = 2, d = 128, v5e) next to the HBM
    bound (compile-time analysis)."""
    rc = bench_main([
        "--decode", "--no-timing", "--tpu", "v5e", "--sizes", "1", "--heads", "1",
        "--value-heads", "2", "--pool-dtypes", "float32", "--out", str(tmp_path),
    ])  # fmt: skip
    assert rc == 0
    rows = {r["backend"]: r for r in json.loads((tmp_path / "decode.json").read_text())["static"]}
    assert set(rows) == {"jax_ref", "pallas_tpu"}  # every backend that runs on a TPU
    row = rows["pallas_tpu"]
    assert row["kernel_us"] > 0 and row["kernel_ratio"] > 0 and row["xla_ops_us"] >= 0
    assert rows["jax_ref"]["kernel_us"] is None and rows["jax_ref"]["xla_ops_us"] > 0
    assert row["bound_us"] == pytest.approx(2 * 2 * 128 * 128 * 4 / 819e9 * 1e6)
