"""``gdn2_tools.tpu.compile_op`` with packed sequences and grouped value heads (the programs of
``gdn2 tpu-report --estimate --segment-ids --value-heads``): deviceless v5e compiles that reach
the Mosaic kernels with the grouped shapes."""

from __future__ import annotations

import re

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


@pytest.mark.tpu_compile
def test_chunk_states_program_compiles():
    """``mode="chunk-states"``: the forward with ``return_chunk_states=True`` (the third program of
    ``--estimate``), its states (B, T / 64, H, K, V) from the Mosaic kernel."""
    text = compile_op(
        "pallas_tpu", "v5e:1x1", "chunk-states", 1, 256, 2, 64, 64, "bfloat16", DEFAULT_CONFIG
    ).as_text()
    assert "tpu_custom_call" in text and "f32[1,4,2,64,64]" in text


@pytest.mark.tpu_compile
def test_bounded_gate_program_compiles():
    """``gate="-5"``: the train step with the lower-bound gate fused (``--gate -5``)."""
    text = compile_op(
        "pallas_tpu", "v5e:1x1", "train", 1, 256, 2, 64, 64, "bfloat16", DEFAULT_CONFIG,
        gate="-5",
    ).as_text()  # fmt: skip
    assert "tpu_custom_call" in text and "gdn2_bwd" in text


def test_gate_flag_is_checked(capsys):
    from gdn2_tools.tpu_report import _parse

    assert _parse(["--estimate", "--gate", "-5"]).gate == "-5"
    assert _parse(["--estimate", "--gate", "softplus"]).gate == "softplus"
    for bad in (
        ["--estimate", "--gate", "-6"],
        ["--estimate", "--gate", "sigmoid"],
        ["--gate", "-1"],
    ):
        with pytest.raises(SystemExit):
            _parse(bad)
    err = capsys.readouterr().err
    assert "--gate: expected 'softplus' or a lower bound in [-5, 0), got '-6'" in err


def test_grouped_and_packed_flags_need_estimate(capsys):
    from gdn2_tools.tpu_report import _parse

    assert _parse(["--estimate", "--value-heads", "32", "--segment-ids"]).value_heads == 32
    with pytest.raises(SystemExit):
        _parse(["--value-heads", "32"])
    assert "apply to --estimate only" in capsys.readouterr().err


@pytest.mark.tpu_compile
def test_value_head_gates_program_compiles():
    """``value_gates=True`` (``--value-gates``): GDN's scalar beta and decay on the 4 value heads
    (Qwen3-Next's layout), q and k on 2 key heads; the program's gate parameters are
    ``(B, T, HV)`` (the softplus gate's A_log, dt_bias on the HV heads: a mismatch would not
    trace)."""
    text = compile_op(
        "pallas_tpu", "v5e:1x1", "train", 1, 256, 2, 64, 64, "bfloat16", DEFAULT_CONFIG,
        value_heads=4, value_gates=True, gates="gdn", gate="softplus",
    ).as_text()  # fmt: skip
    assert "tpu_custom_call" in text and "gdn2_bwd" in text
    params = text.split("ENTRY", 1)[1].split("->", 1)[0]  # the program's arguments
    assert len(re.findall(r"bf16\[1,256,4\][,)]", params)) == 3, params  # w, b, g
    assert not re.findall(r"bf16\[1,256,2\][,)]", params), params


def test_value_gates_flag_needs_grouped_heads(capsys):
    from gdn2_tools.tpu_report import _parse

    args = _parse(["--estimate", "-H", "16", "--value-heads", "32", "--value-gates"])
    assert args.value_gates and args.value_heads == 32
    with pytest.raises(SystemExit):
        _parse(["--estimate", "-H", "16", "--value-gates"])
    assert (
        "--value-gates: expected --value-heads other than -H 16, got 0" in capsys.readouterr().err
    )
