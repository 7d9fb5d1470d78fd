"""``gdn2 tpu-report`` (compile-time analysis; the deviceless compile part is skipped here, the
same compile is covered by test_compile.py)."""

from __future__ import annotations

from gdn2_pallas_tpu.report import main


def test_report_prints_kernels_and_roofline(capsys):
    assert main(["--tpu", "v6e", "--dtype", "float32", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "compile-time analysis (no TPU run)" in out
    for needle in ("gdn2_fwd_fused", "gdn2_bwd_fused", "VMEM/step", "roofline", "minimum"):
        assert needle in out
