"""``gdn2 bench`` rows with model features: packed sequences (``seqs=N``) and grouped value heads
(``hv=N``), gated against the token-serial reference with the same segment_ids / heads, and the
packed/unpacked and grouped/repeated checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

import gdn2core
from gdn2_conformance import ReferenceBackend
from gdn2_tools.bench.checks import feature_checks
from gdn2_tools.bench.cli import bench_main
from gdn2_tools.bench.inputs import make_inputs, make_options
from gdn2_tools.bench.runner import RowResult
from gdn2_tools.bench.shapes import GVA_SHAPES, PACKED_SHAPES, BenchShape, parse_shape
from gdn2_tools.bench.timing import Timing


class LeakyBackend(ReferenceBackend):
    """Wrong on packed rows only: ignores segment_ids (the state leaks across sequences)."""

    name = "test_leaky"

    def forward(self, q, k, v, w, b, g, h0, *, spec, config, extras=None):
        import dataclasses

        from gdn2core.options import SegmentMode

        if extras is not None and extras.segment_ids is not None:
            spec = dataclasses.replace(spec, segments=SegmentMode.NONE)
            extras = dataclasses.replace(extras, segment_ids=None)
        return super().forward(q, k, v, w, b, g, h0, spec=spec, config=config, extras=extras)


@pytest.fixture
def feature_backends():
    backends = [ReferenceBackend("test_reference"), LeakyBackend()]
    for be in backends:
        gdn2core.register_backend(be, replace=True)
    yield
    for be in backends:
        gdn2core.unregister_backend(be.name)


def test_shape_fields_and_parse():
    packed = parse_shape("2,32,1,8,8,seqs=3")
    assert packed == BenchShape(2, 32, 1, 8, 8, seqs=3) and packed.label.endswith("seqs=3")
    gva = parse_shape("1,16,2,8,hv=4")
    assert gva == BenchShape(1, 16, 2, 8, 8, HV=4) and gva.value_heads == 4
    assert BenchShape.from_dict(gva.as_dict()) == gva
    assert "HV" not in BenchShape(1, 2, 3, 4, 5).as_dict()  # plain rows read as before
    with pytest.raises(ValueError, match="expected hv=N or seqs=N"):
        parse_shape("1,16,2,8,groups=2")
    with pytest.raises(ValueError, match="HV must be 0 or a multiple of H = 2, got 3"):
        BenchShape(1, 16, 2, 8, 8, HV=3)
    # the named lists: same B*T packed and unpacked; H=16, HV=32 next to H=32
    (plain, packed_row), (grouped, repeated) = PACKED_SHAPES, GVA_SHAPES
    assert packed_row.B * packed_row.T == plain.B * plain.T and packed_row.seqs > 1
    assert (grouped.H, grouped.HV, repeated.H, repeated.HV) == (16, 32, 32, 0)


def test_inputs_of_feature_shapes():
    xs, h0, (do, dh) = make_inputs(BenchShape(1, 12, 2, 8, 4, HV=4), "float32")
    assert do.shape == (1, 12, 4, 4) and dh.shape == (1, 4, 8, 4)
    assert [x.shape[2] for x in xs] == [2, 2, 4, 4, 2, 2] and h0.shape == (1, 4, 8, 4)
    ids = np.asarray(make_options(BenchShape(2, 12, 1, 8, 8, seqs=4))["segment_ids"])
    assert ids.shape == (2, 12) and (ids[:, 0] == 0).all() and (ids[:, -1] == 3).all()
    assert (np.diff(ids, axis=1) >= 0).all()
    assert make_options(BenchShape(2, 12, 1, 8, 8)) == {}


def test_bench_feature_rows_are_gated(tmp_path, feature_backends, capsys):
    """Packed and grouped rows run, pass the gate against the reference with the same segments
    and heads, and get their checks; a backend that ignores segment_ids is rejected on the
    packed row only."""
    out = tmp_path / "out"
    shapes = ["1,24,1,8,8,seqs=4", "1,8,1,8,8,hv=2"]
    argv = [a for s in shapes for a in ("--shape", s)]
    argv += ["--repeats", "1", "--dtypes", "float32", "--no-progress", "--out", str(out)]
    rc = bench_main([*argv, "--backends", "test_reference,test_leaky"])
    assert rc == 1  # the leaky row
    rows = {(r["backend"], BenchShape.from_dict(r["shape"])): r for r in
            json.loads((out / "bench.json").read_text())["rows"]}  # fmt: skip
    packed, grouped = map(parse_shape, shapes)
    for shape in (packed, grouped):
        row = rows[("test_reference", shape)]
        assert row["status"] == "ok" and row["gate"]["ok"] and row["gate"]["against"] == "reference"
    leaky = rows[("test_leaky", packed)]
    assert leaky["status"] == "rejected" and not leaky["gate"]["ok"]
    assert any(f.startswith("o:") for f in leaky["gate"]["failures"])
    assert rows[("test_leaky", grouped)]["status"] == "ok"
    assert "REJECTED: test_leaky float32 B=1 T=24 H=1 dk=8 dv=8 seqs=4" in capsys.readouterr().out


def _row(shape, t):
    r = RowResult("jax_ref", shape, "float32", "ok")
    r.modes["fwdbwd"] = Timing(0.1, [t])
    return r


def test_feature_checks_ratios():
    plain, packed = BenchShape(2, 64, 1, 8, 8), BenchShape(2, 64, 1, 8, 8, seqs=4)
    grouped, repeated = BenchShape(1, 8, 2, 8, 8, HV=4), BenchShape(1, 8, 4, 8, 8)
    rows = [_row(plain, 1.0), _row(packed, 1.2), _row(grouped, 0.6), _row(repeated, 1.0)]
    checks = {c.name: c for c in feature_checks(rows, "jax_ref")}
    ratio = checks["jax_ref packed / unpacked fwd+bwd time"]
    assert not ratio.passed and "1.20x (need <= 1.15x)" in ratio.detail
    saving = checks["jax_ref grouped / repeated-heads fwd+bwd time"]
    assert saving.passed and "0.60x" in saving.detail
    assert feature_checks(rows, None) == []
    assert feature_checks(rows[1:], "jax_ref")[0].name.startswith("jax_ref grouped")
