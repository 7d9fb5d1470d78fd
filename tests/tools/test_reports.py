"""``gdn2 tpu-report`` and ``gdn2 mesh-report`` (compile-time analysis; the deviceless compiles are
marked tpu_compile)."""

from __future__ import annotations

import pytest

from gdn2_tools import mesh_report, tpu_report


def test_tpu_report_rows_come_from_the_backends_hook(capsys):
    """The default backend for a TPU is chosen by capability (pallas_tpu, auto-pickable there);
    its kernels are rows it contributed through gdn2_kernel_costs."""
    assert tpu_report.main(["--tpu", "v6e", "--dtype", "float32", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "compile-time analysis (no TPU run)" in out and "backend pallas_tpu" in out
    for needle in ("gdn2_fwd (inference)", "gdn2_bwd", "VMEM/step", "roofline", "minimum"):
        assert needle in out


def test_tpu_report_without_kernel_rows(capsys):
    assert (
        tpu_report.main(["--backend", "jax_ref", "--no-compile", "--dk", "64", "--dv", "64"]) == 0
    )
    assert "jax_ref reports no per-kernel rows" in capsys.readouterr().out


def test_mesh_report_default_backend_by_capability():
    shape = mesh_report.Shape("batch", B=8, T=256, H=2, d=64)
    assert mesh_report.default_backend(shape, "bfloat16", None) == "pallas_tpu"
    odd = mesh_report.Shape("batch", B=8, T=256, H=2, d=96)  # no Pallas head size: the fallback
    assert mesh_report.default_backend(odd, "bfloat16", None) == "jax_ref"


def test_mesh_report_shape_option():
    assert mesh_report._shape("batch:8,4096,6,128") == mesh_report.Shape("batch", 8, 4096, 6, 128)
    with pytest.raises(Exception, match="mode:B,T,H,d"):
        mesh_report._shape("batch:8,4096")


@pytest.mark.tpu_compile
@pytest.mark.parametrize("backend", ["jax_ref", "pallas_tpu"])
def test_mesh_report_compiles_small_v5e_2x4(backend):
    """The sharded train step compiles for 8 v5e chips (the pure-JAX fallback, and the Pallas
    kernels, which only shard_map can distribute)."""
    rows = mesh_report.run(
        mesh_report.ReportArgs(
            backend=backend,
            topology="v5e:2x4",
            shapes=(
                mesh_report.Shape("batch", B=8, T=256, H=2, d=64),
                mesh_report.Shape("context", B=1, T=1024, H=2, d=64),
            ),
        )
    )
    by_mode = {r.shape.mode: r for r in rows}
    for row in rows:
        assert row.error is None, row.error
        assert row.per_chip_bytes > 0
    # Batch sharding: the compiled TPU program has no all-gather (no collective but the loss's).
    assert all(c.bytes <= 8 for c in by_mode["batch"].collectives), by_mode["batch"].collectives
    # Context parallelism: only the state summaries, 8 x dk x (dk + dv) floats per head at most.
    bound = 4 * 8 * 1 * 2 * 64 * 128
    ctx = by_mode["context"].collectives
    assert any(c.op == "all-gather" for c in ctx)
    assert all(c.bytes <= bound for c in ctx), ctx


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--g-dtype", "float32"], "--g-dtype apply to --estimate only"),
     (["--estimate", "--dtype", "float32", "--g-dtype", "float32"],
      "--g-dtype float32: expected --dtype bfloat16, got float32")],
)  # fmt: skip
def test_tpu_report_refuses_g_dtype_where_it_means_nothing(argv, message, capsys):
    with pytest.raises(SystemExit):
        tpu_report.main(argv)
    assert message in capsys.readouterr().err
