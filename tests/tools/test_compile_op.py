"""``gdn2_tools.tpu.compile_op`` with packed sequences and grouped value heads (the programs of
``gdn2 tpu-report --estimate --segment-ids --value-heads``): deviceless v5e compiles that reach
the Mosaic kernels with the grouped shapes."""

from __future__ import annotations

import pytest

from gdn2_tools.tpu import compile_op
from gdn2core import DEFAULT_CONFIG


@pytest.mark.tpu_compile
@pytest.mark.parametrize("mode", ["forward", "train"])
def test_packed_grouped_programs_compile(mode):
    compiled = compile_op(
        "pallas_tpu", "v5e:1x1", mode, 1, 256, 2, 64, 64, "bfloat16", DEFAULT_CONFIG,
        segments=True, value_heads=4,
    )  # fmt: skip
    text = compiled.as_text()
    assert "tpu_custom_call" in text
    assert "bf16[1,256,4,64]" in text  # o on the value heads


def test_grouped_and_packed_flags_need_estimate(capsys):
    from gdn2_tools.tpu_report import _parse

    assert _parse(["--estimate", "--value-heads", "32", "--segment-ids"]).value_heads == 32
    with pytest.raises(SystemExit):
        _parse(["--value-heads", "32"])
    assert "apply to --estimate only" in capsys.readouterr().err
