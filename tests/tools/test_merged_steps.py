"""python -m gdn2_tools.merged_steps: the steps of both plans counted by copy, on the chip's plans
(libtpu's description of the chip: the tpu_compile marker)."""

from __future__ import annotations

import pytest

from gdn2_tools import merged_steps

pytestmark = pytest.mark.tpu_compile


def _counts(out: str) -> dict[str, list[int]]:
    """``{"forward": [steps, 16-row, 8-row, levels], "training": [...]}`` from the printed lines."""
    rows = {}
    for line in out.strip().splitlines():
        name, rest = line.split(": ", 1)
        rows[name] = [int(word) for word in rest.replace(",", " ").split() if word.isdigit()]
    return rows


@pytest.mark.parametrize(
    "tpu, dtype, steps, training",
    [("v5e", "bfloat16", 8, 8), ("v6e", "bfloat16", 4, 8), ("v5e", "float32", 8, 16)],
)
def test_weak_decays_merge_16_rows_in_every_step(tpu, dtype, steps, training, capsys):
    # B=1 T=2048 H=6: 32 chunks of 64, 4 chunks of 6 heads a step on v5e, 8 on v6e (twice the
    # rows on its 256-deep MXU); training plans take at most 4 (bfloat16) or 2 (float32 inputs)
    # on either (the cap on a training step's rows, plan.py "Training steps"); weak decays
    # (|g| < 1e-3) merge everywhere.
    argv = ["--shape", "1,2048,6,32", "--decay", "weak", "--tpu", tpu, "--dtype", dtype]
    assert merged_steps.main(argv) == 0
    rows = _counts(capsys.readouterr().out)
    assert rows == {"forward": [steps, steps, 0, 0], "training": [training, training, 0, 0]}


def test_strong_decays_keep_the_levels(capsys):
    # strong: 10% of the tokens at -30 on every channel; 8 rows hold two of them (60 + ...) or
    # more in most windows: most steps keep the levels, and the counts add up to the steps.
    assert merged_steps.main(["--shape", "1,2048,6,32", "--decay", "strong"]) == 0
    for steps, sixteen, eight, levels in _counts(capsys.readouterr().out).values():
        assert steps == 8 and sixteen + eight + levels == 8 and levels >= 4


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--shape", "1,64,4,16,hv=8"], "grouped value heads and packed rows are not taken here"),
        (["--shape", "1,64"], "expected B,T,H,DK or B,T,H,DK,DV"),
        (["--shape", "1,64,4,16,seqs=2"], "grouped value heads and packed rows are not taken here"),
        (["--tpu", "v4"], "invalid choice: 'v4'"),
    ],
)
def test_a_shape_it_does_not_take_is_refused_by_name(argv, needle, capsys):
    with pytest.raises(SystemExit):
        merged_steps.main(argv)
    assert needle in capsys.readouterr().err
