"""``gdn2 tpu-report --estimate``'s rows without a compile: the roofline of each mode, the
flagging of kernel fits that test nothing (fewer than three points) or fit badly, and the pricing
by HBM bytes of what the profiler prices at 0."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from gdn2_tools import tpu_estimate
from gdn2_tools.static_profile import Estimate, OpCycles, Program, hbm_bytes

PROGRAM = Program("pallas_tpu", "forward", 8, 4096, 6, 128, 128, "bfloat16")


def test_chunk_states_roofline_adds_the_states_bytes():
    """v5e, bf16, B8 T4096 H6 d128: the forward is HBM-bound, (B T H (4 K + 3 V) 2 + 2 B H K V 4)
    bytes = 358.6 MB at 819 GB/s = 0.4379 ms; chunk states add B H (T / 64) K V 4 bytes = 201 MB,
    0.246 ms."""
    fwd = tpu_estimate.roofline_ms(PROGRAM, "v5e", 64)
    chunks = tpu_estimate.roofline_ms(Program(**{**PROGRAM.__dict__, "mode": "chunk-states"}),
                                      "v5e", 64)  # fmt: skip
    states = 8 * 6 * 64 * 128 * 128 * 4 / 819e9 * 1e3
    assert fwd == pytest.approx(0.4379, abs=1e-4)
    assert chunks - fwd == pytest.approx(states, rel=1e-9)


def test_float32_g_roofline_adds_its_bytes():
    """The forward (HBM-bound) with a float32 g beside bf16 inputs moves 2 more bytes per value
    of g: per channel (B T H K 2 bytes, 25.2 MB at B8 T4096 H6, 0.0307 ms at 819 GB/s), or one
    per head and token for GDN's scalar g."""
    wide = Program(**{**PROGRAM.__dict__, "decay_dtype": "float32"})
    extra = tpu_estimate.roofline_ms(wide, "v5e", 64) - tpu_estimate.roofline_ms(PROGRAM, "v5e", 64)
    assert extra == pytest.approx(8 * 4096 * 6 * 128 * 2 / 819e9 * 1e3, rel=1e-9)
    gdn = Program(**{**PROGRAM.__dict__, "gates": "gdn"})
    gdn_wide = Program(**{**gdn.__dict__, "decay_dtype": "float32"})
    extra = tpu_estimate.roofline_ms(gdn_wide, "v5e", 64) - tpu_estimate.roofline_ms(gdn, "v5e", 64)
    assert extra == pytest.approx(8 * 4096 * 6 * 2 / 819e9 * 1e3, rel=1e-6)


def test_input_specs_take_g_in_its_own_dtype():
    """``--g-dtype float32``: the compiled program's g is float32 beside bf16 q, k, v, w, b; the
    cotangent of o is in the inputs' dtype."""
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from gdn2_tools.train_step import input_specs

    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    specs = input_specs(mesh, 1, 8, 2, 4, 4, dtype=jnp.bfloat16, scalar_gates=("g",),
                        decay_dtype=jnp.float32)  # fmt: skip
    assert [s.dtype for s in specs[:6]] == [jnp.bfloat16] * 5 + [jnp.float32]
    assert specs[5].shape == (1, 8, 2)
    # h0, do, dh: the cotangent of o in o's dtype (as a model's arrives), the states' in float32
    assert [s.dtype for s in specs[6:]] == [jnp.float32, jnp.bfloat16, jnp.float32]


def _row(monkeypatch, points, residual):
    fit = {"points": points, "cycles_per_token": 1.0, "max_rel_residual": residual}
    e = Estimate(PROGRAM, "v5e", [OpCycles("gdn2_fwd", 1_500_000, 1, True, fit=fit)], 0, {}, [],
                 op_bytes={"gdn2_fwd": 81_900_000})  # fmt: skip
    monkeypatch.setattr(tpu_estimate, "run", lambda program, tpu: e)
    return tpu_estimate.row_of(PROGRAM, "v5e", 64)


@pytest.mark.parametrize(
    "points, residual, ok",
    [([(512, 1), (1024, 2), (2048, 4)], 0.001, True),
     ([(512, 1), (1024, 2)], 0.0, False),  # two points: a zero residual tests nothing
     ([(512, 1), (1024, 2), (2048, 4)], 0.05, False)],
    ids=["three-points", "two-points", "poor-fit"],
)  # fmt: skip
def test_fits_are_flagged_unless_three_points_within_two_percent(monkeypatch, capsys, points,
                                                                 residual, ok):  # fmt: skip
    row = _row(monkeypatch, points, residual)
    assert row.trustworthy is ok
    assert row.fits == {"gdn2_fwd": (len(points), residual)}
    tpu_estimate.print_row(row)
    out = capsys.readouterr().out
    assert "kernel gdn2_fwd: 1.000 ms; HBM 81.9 MB (0.100 ms at 819 GB/s); fit of" in out
    assert ("WARNING" in out) is not ok


@pytest.mark.parametrize("bundles, ok", [(None, True), (62_881, True), (69_237, False)],
                         ids=["not-dumped", "longest-measured-fast", "measured-slow"])  # fmt: skip
def test_kernels_with_programs_longer_than_any_measured_fast_are_flagged(monkeypatch, capsys,
                                                                          bundles, ok):  # fmt: skip
    """A kernel's program length is printed beside its time, and one longer than any a TPU v5e
    ran at its estimate's speed (static_profile.LONGEST_FAST_PROGRAM) makes the row untrusted,
    with a note saying why: such programs ran 2.2x to 2.4x their estimate."""
    fit = {"points": [(512, 1), (1024, 2), (2048, 4)], "cycles_per_token": 1.0,
           "max_rel_residual": 0.0}  # fmt: skip
    op = OpCycles("gdn2_bwd", 1_500_000, 1, True, fit=fit, bundles=bundles)
    e = Estimate(PROGRAM, "v5e", [op], 0, {}, [], op_bytes={"gdn2_bwd": 81_900_000})
    monkeypatch.setattr(tpu_estimate, "run", lambda program, tpu: e)
    row = tpu_estimate.row_of(PROGRAM, "v5e", 64)
    assert row.trustworthy is ok
    tpu_estimate.print_row(row)
    out = capsys.readouterr().out
    assert (f"program {bundles or 0:,} bundles" in out) is (bundles is not None)
    assert ("longer than any a TPU v5e ran at its estimate's speed" in out) is not ok
    assert ("WARNING" in out) is not ok


def test_the_fit_points_are_three():
    assert len(tpu_estimate.FIT_POINTS) >= 3


#: A compiled program's text, cut down: a kernel with its CostEstimate and an XLA fusion.
HLO = """
ENTRY %main (p0: bf16[4,128]) -> f32[4,128] {
  %p0 = bf16[4,128]{1,0} parameter(0)
  %p1 = f32[2]{0} parameter(1)
  %gdn2_fwd.1 = (bf16[4,128]{1,0}, f32[8]{0}) custom-call(%p0, %p1), custom_call_target="tpu_custom_call", backend_config={"cost_estimate":{"flops":"1","transcendentals":"0","bytes_accessed":"5000","remote_bytes_transferred":"0"}}
  %gte = bf16[4,128]{1,0} get-tuple-element(%gdn2_fwd.1), index=0
  ROOT %fusion.3 = f32[4,128]{1,0} fusion(%gte, %p1), kind=kLoop, calls=%fused
}
"""


#: A loop body's ops: a fusion that slices a row of a big parameter inside a nested fusion, and
#: one that writes a row into the loop's carry in place.
LOOP = """
%inner (p0: f32[1024,128], p1: s32[]) -> f32[1,128] {
  %p0 = f32[1024,128]{1,0} parameter(0)
  %p1 = s32[]{:T(128)} parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[1,128]{1,0} dynamic-slice(%p0, %p1, %zero), dynamic_slice_sizes={1,128}
}

%outer (q0: f32[1024,128], q1: s32[]) -> f32[1,128] {
  %q0 = f32[1024,128]{1,0} parameter(0)
  %q1 = s32[]{:T(128)} parameter(1)
  %nested = f32[1,128]{1,0} fusion(%q0, %q1), kind=kLoop, calls=%inner
  ROOT %e = f32[1,128]{1,0} exponential(%nested)
}

%update (r0: f32[1024,128], r1: f32[1,128], r2: s32[]) -> f32[1024,128] {
  %r0 = f32[1024,128]{1,0} parameter(0)
  %r1 = f32[1,128]{1,0} parameter(1)
  %r2 = s32[]{:T(128)} parameter(2)
  %zero.1 = s32[] constant(0)
  %b = f32[1024,128]{1,0} bitcast(%r0)
  ROOT %dus = f32[1024,128]{1,0} dynamic-update-slice(%b, %r1, %r2, %zero.1)
}

%body (x: f32[1024,128], y: f32[1024,128], i: s32[]) -> f32[1024,128] {
  %x = f32[1024,128]{1,0} parameter(0)
  %y = f32[1024,128]{1,0} parameter(1)
  %i = s32[]{:T(128)} parameter(2)
  %row = f32[1,128]{1,0} fusion(%x, %i), kind=kLoop, calls=%outer
  ROOT %carry = f32[1024,128]{1,0} fusion(%y, %row, %i), kind=kLoop, calls=%update
}
"""


def test_hbm_bytes_of_kernels_and_xla_ops():
    """A kernel: its own bytes_accessed; an XLA op: its result (4 * 128 f32) and its operands
    (4 * 128 bf16, 2 f32)."""
    found = hbm_bytes(HLO)
    assert found["gdn2_fwd.1"] == 5000
    assert found["fusion.3"] == 4 * 128 * 4 + 4 * 128 * 2 + 2 * 4


def test_hbm_bytes_count_slices_and_in_place_updates():
    """In a loop body: a row sliced from a (1024, 128) f32 buffer inside a nested fusion reads
    512 bytes (and writes 512), not the 512 KiB buffer; a row written into the carry in place
    writes 512 bytes and reads the row (512), not the buffer."""
    found = hbm_bytes(LOOP)
    row = 128 * 4
    assert found["row"] == row + row + 4  # the slice read, the result, the index
    assert found["carry"] == row + row + 4  # the update read and written, the index


def test_what_the_profiler_prices_at_zero_is_priced_by_bytes(monkeypatch, capsys):
    """An XLA op with 0 cycles (remote DMA) adds its bytes' time; a kernel whose bytes take longer
    than its profile counts at its bytes; both say so in a note."""
    ops = [
        OpCycles("gdn2_fwd", 150_000, 1, True),  # 0.1 ms profiled; 163.8 MB = 0.2 ms
        OpCycles("fusion.3", 0, 2, False, unmodelled=True, cost_model_cycles=10),  # 2 x 40.95 MB
    ]
    e = Estimate(PROGRAM, "v5e", ops, 0, {}, [],
                 op_bytes={"gdn2_fwd": 163_800_000, "fusion.3": 40_950_000})  # fmt: skip
    monkeypatch.setattr(tpu_estimate, "run", lambda program, tpu: e)
    row = tpu_estimate.row_of(PROGRAM, "v5e", 64)
    assert row.ms == pytest.approx(0.2 + 0.1, rel=1e-9)
    assert row.kernels == {"gdn2_fwd": pytest.approx(0.2, rel=1e-9)}
    assert row.kernel_bytes == {"gdn2_fwd": 163_800_000}
    assert any("priced here by their HBM bytes: 81.9 MB, 0.100 ms" in n for n in row.notes)
    assert any("kernel gdn2_fwd: its HBM bytes take 0.200 ms" in n for n in row.notes)


def test_scalar_gates_roofline_counts_one_value_per_head_and_token():
    """GDN's scalar gates (w, b, g) move 1 value per head and token instead of V, K, K: the
    forward's HBM bound drops by B T H (V - 1 + 2 (K - 1)) 2 bytes; the same op on the gates
    broadcast in XLA has the same bound (the op's minimum)."""
    gdn = Program(**{**PROGRAM.__dict__, "gates": "gdn"})
    wide = Program(**{**PROGRAM.__dict__, "gates": "gdn-broadcast"})
    saved = 8 * 4096 * 6 * (127 + 2 * 127) * 2 / 819e9 * 1e3
    full = tpu_estimate.roofline_ms(PROGRAM, "v5e", 64)
    assert full - tpu_estimate.roofline_ms(gdn, "v5e", 64) == pytest.approx(saved, rel=1e-9)
    assert tpu_estimate.roofline_ms(wide, "v5e", 64) == tpu_estimate.roofline_ms(gdn, "v5e", 64)


def test_rows_say_how_the_gates_came_and_the_program_bytes(monkeypatch, capsys):
    row = _row(monkeypatch, [(512, 1), (1024, 2), (2048, 4)], 0.0)
    row.program = Program(**{**PROGRAM.__dict__, "gates": "kda-broadcast"})
    tpu_estimate.print_row(row)
    out = capsys.readouterr().out
    assert "pallas_tpu forward [KDA's scalar gates broadcast in XLA before the op]: 1.000 ms" in out
    assert "; HBM 81.9 MB in all" in out


def test_libtpu_logs_are_truncated_while_a_compile_runs(tmp_path):
    """The profiler's logs (tens of GB for a large program) are cut to nothing as they grow."""
    from gdn2_tools.static_profile import _trim_logs

    for name in ("tpu_driver.log", "other.INFO"):
        (tmp_path / name).write_bytes(b"x" * 4096)
    _trim_logs(str(tmp_path))
    assert [p.stat().st_size for p in sorted(tmp_path.iterdir())] == [0, 0]


def test_a_profile_of_identical_ops_counts_each_of_them(tmp_path):
    """The profiler simulates identical ops once and says how many it stands for
    (``num_equivalent_hlos``; the four broadcasts of a decode step's q, k, b, g to the value
    heads get one profile): each is counted, at the named op's loop runs. Textprotos in the
    profiler's format, the op in a while loop of 3 trips."""
    (tmp_path / "a.static_llo_profile.textproto").write_text(
        'hlo_op_name: "broadcast.9"\n  estimated_cycles: 131\n  num_equivalent_hlos: 4\n'
        "  dma_instruction_type: DMA_INSTRUCTION_TYPE_NONE\n"
    )
    (tmp_path / "b.static_llo_profile.textproto").write_text(
        'hlo_op_name: "gdn2_decode.1"\n  estimated_cycles: 29179\n'
        "  dma_instruction_type: DMA_INSTRUCTION_TYPE_LOCAL\n"
    )
    from gdn2_tools.static_profile import profiled_ops, read_profiles

    assert read_profiles(str(tmp_path)) == {
        "broadcast.9": (131, "NONE", 4), "gdn2_decode.1": (29179, "LOCAL", 1),
    }  # fmt: skip
    hlo = "\n".join([
        "%body (p: (s32[])) -> (s32[]) {",
        "  %broadcast.9 = f32[8] broadcast(f32[] %c)",
        "}",
        "ENTRY %main () -> f32[8] {",
        '  %while.1 = (s32[]) while(%t), condition=%cond, body=%body, '
        'backend_config={"known_trip_count":{"n":"3"}}',
        '  ROOT %gdn2_decode.1 = f32[8] custom-call(), custom_call_target="tpu_custom_call"',
        "}",
    ])  # fmt: skip
    ops = {op.name: op for op in profiled_ops(str(tmp_path), hlo, ["gdn2_decode.1"])}
    assert ops["gdn2_decode.1"].total == 29179 and ops["gdn2_decode.1"].kernel
    assert ops["broadcast.9"].equivalents == 4 and not ops["broadcast.9"].kernel
    assert ops["broadcast.9"].runs == 3 and ops["broadcast.9"].total == 131 * 4 * 3


def test_fit_points_are_planned_like_the_target_on_two_tensor_cores():
    """On v5p the plans split the heads for an odd batch (B=1 H=6: 3 heads a step) and not for an
    even one, so the small shapes of a fit take the target batch's parity; one-core chips fit at
    B=1."""
    from gdn2_tools.tpu_estimate import FIT_POINTS, fit_points

    assert fit_points(8, "v5e") == fit_points(8, "v6e") == FIT_POINTS
    assert [b for b, _ in fit_points(8, "v5p")] == [2, 2, 2]
    assert fit_points(1, "v5p") == fit_points(3, "v5p") == FIT_POINTS
    assert [t for _, t in fit_points(8, "v5p")] == [t for _, t in FIT_POINTS]


def test_every_tool_prices_the_same_chips():
    """One table (chips.py) gives the topologies, clocks, peaks and HBM bounds of every tool."""
    from gdn2_tools import tpu_report
    from gdn2_tools.bench.decode import HBM_BYTES_PER_S
    from gdn2_tools.chips import CHIPS
    from gdn2_tools.static_profile import CLOCK_HZ
    from gdn2_tools.tpu import TOPOLOGIES

    assert set(TOPOLOGIES) == set(CLOCK_HZ) == set(tpu_estimate.PEAKS) == set(tpu_report.PEAKS)
    assert set(HBM_BYTES_PER_S) == set(CHIPS) == {"v5e", "v6e", "v5p"}
    assert tpu_estimate.PEAKS["v5e"] == (197e12, 819e9) and CLOCK_HZ["v6e"] == 1.75e9
    assert TOPOLOGIES["v5p"] == "v5p:1x1x1" and CHIPS["v5p"].tensor_cores == 2


def test_the_table_takes_its_shapes_and_chips_and_gives_the_temp_hbm(monkeypatch, tmp_path):
    """``gdn2 tpu-report --table --shapes long --tpus v5p --dtypes bfloat16``: the rows of that
    shape, chip and dtype only, each pallas_tpu row with its compiled temp HBM (n/a where the
    compile gave none), and the "(see notes)" flag on the backend whose estimate left an op out."""
    fit = {"points": [(512, 1), (1024, 2), (2048, 4)], "cycles_per_token": 1.0,
           "max_rel_residual": 0.0}  # fmt: skip
    asked = []

    def run(program, tpu):
        asked.append((program.backend, program.B, program.T, program.H, program.dtype, tpu))
        temp = 192 * 2**20 if program.backend == "pallas_tpu" and program.mode == "train" else None
        ops = [OpCycles("gdn2_fwd", 1_750_000, 1, True, fit=fit)]
        unprofiled = {"gather_fusion": "aborted"} if program.backend == "jax_ref" else {}
        return Estimate(program, tpu, ops, temp, unprofiled, [], op_bytes={"gdn2_fwd": 1})

    monkeypatch.setattr(tpu_estimate, "run", run)
    out = tmp_path / "table.md"
    from gdn2_tools.tpu_report import main  # the command line passes its table options on

    code = main(["--table", str(out), "--shapes", "long", "--tpus", "v5p", "--dtypes", "bfloat16"])
    assert code == 1  # a row left something out
    assert sorted(set(asked)) == [
        (backend, 1, 32768, 16, "bfloat16", "v5p") for backend in ("jax_ref", "pallas_tpu")
    ]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| B=")]
    assert len(rows) == 2
    # the flag on the cell whose estimate left something out (here jax_ref's), not its neighbour
    assert rows[0].startswith("| B=1 T=32768 H=16 d=128 | v5p | bfloat16 | train | 1.00 | ")
    assert "| 1.00 | 1.00 (see notes) | 0.97 |" in rows[0], rows[0]
    assert rows[0].endswith("| 192.0 |") and rows[1].endswith("| n/a |"), rows


def test_the_table_runs_both_backends_at_the_named_preset(monkeypatch, tmp_path):
    """``--config LONG_CHUNKS``: both backends' programs at that preset, the roofline at its
    chunk length, and the preset named in the rows' shape column."""
    fit = {"points": [(512, 1), (1024, 2), (2048, 4)], "cycles_per_token": 1.0,
           "max_rel_residual": 0.0}  # fmt: skip
    asked, chunks = [], []

    def run(program, tpu):
        asked.append((program.backend, program.config))
        ops = [OpCycles("gdn2_fwd", 1_750_000, 1, True, fit=fit)]
        return Estimate(program, tpu, ops, None, {}, [], op_bytes={"gdn2_fwd": 1})

    def roofline(program, tpu, C):
        chunks.append(C)
        return 1.0

    monkeypatch.setattr(tpu_estimate, "run", run)
    monkeypatch.setattr(tpu_estimate, "roofline_ms", roofline)
    out = tmp_path / "table.md"
    from gdn2_tools.tpu_report import main

    argv = ["--table", str(out), "--shapes", "train", "--tpus", "v6e", "--dtypes", "bfloat16"]
    assert main([*argv, "--config", "LONG_CHUNKS"]) == 0
    assert sorted(set(asked)) == [("jax_ref", "LONG_CHUNKS"), ("pallas_tpu", "LONG_CHUNKS")]
    assert set(chunks) == {128}
    rows = [line for line in out.read_text().splitlines() if line.startswith("| B=")]
    assert [r.split(" | ")[0] for r in rows] == ["| B=8 T=4096 H=6 d=128 LONG_CHUNKS (C=128)"] * 2
    asked.clear()
    assert main(argv) == 0  # the default: DEFAULT_CONFIG, unnamed
    assert sorted(set(asked)) == [("jax_ref", "default"), ("pallas_tpu", "default")]
    assert "LONG_CHUNKS" not in out.read_text()


@pytest.mark.parametrize(
    "argv, error",
    [(["--shapes", "long"], "--shapes, --tpus and --dtypes apply to --table only"),
     (["--dtypes", "float32"], "--shapes, --tpus and --dtypes apply to --table only"),
     (["--table", "t.md", "--shapes", "train,lung"],
      "--shapes: expected names of train, long, got ['lung']"),
     (["--table", "t.md", "--tpus", "v5e,v7"], "--tpus: expected names of v5e, v6e, v5p, got ['v7']"),
     (["--table", "t.md", "--dtypes", "float16"],
      "--dtypes: expected names of bfloat16, float32, got ['float16']")],
    ids=["without-table", "dtypes-without-table", "unknown-shape", "unknown-tpu", "unknown-dtype"],
)  # fmt: skip
def test_the_table_options_name_what_they_expect(argv, error, capsys):
    from gdn2_tools.tpu_report import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert error in capsys.readouterr().err
