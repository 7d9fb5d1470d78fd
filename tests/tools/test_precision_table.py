"""``python -m gdn2_tools.precision_table`` (docs/algorithm.md section 10) at a small shape: the
chosen precisions are within the kit's tolerances and a stage forced to one bf16 pass is not."""

from __future__ import annotations

import pytest

from gdn2_conformance import tolerance
from gdn2_tools.precision_table import worst_errors


@pytest.mark.slow
def test_float32_needs_three_passes_in_the_state_pass(x64):
    fwd, grad = worst_errors("float32", (), T=64, H=1, d=64)
    assert fwd <= tolerance("float32", "o") and grad <= tolerance("float32", "dq")
    fwd_state, _ = worst_errors("float32", ("state",), T=64, H=1, d=64)
    assert fwd_state > tolerance("float32", "o")
