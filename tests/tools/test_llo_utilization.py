"""``python -m gdn2_tools.llo_utilization``: the parser of libtpu's per-bundle slot counts on a
written file, and (deviceless compile) a real kernel's step."""

from __future__ import annotations

import pytest

from gdn2_tools import llo_utilization as lu
from gdn2_tools import static_profile
from gdn2_tools.static_profile import Program

TEXT = """== CAPACTIY:
MXU, VALU, VSTORE
    4     4     1
== UTILIZATION:
0 0 1
4 2 1
4 4 0
0 2 1

"""


def test_parse_counts_each_units_slots_and_cycles():
    u = lu.parse(TEXT)
    assert u.units == ("MXU", "VALU", "VSTORE") and u.capacity == (4, 4, 1)
    assert u.bundles == 4
    assert [u.slots(j) for j in range(3)] == [8, 8, 3]
    assert [u.min_cycles(j) for j in range(3)] == [2.0, 2.0, 3.0]  # the store slot bounds it
    (s0, busy0), (s1, busy1) = u.segments(2)
    assert (s0, s1) == (0, 2)
    assert busy0 == [0.5, 0.25, 1.0] and busy1 == [0.5, 0.75, 0.5]
    assert "needs >=        3 cycles" in lu.report(u, 2)


def test_parse_refuses_a_line_that_does_not_match_the_units():
    with pytest.raises(ValueError, match="without 3 counts"):
        lu.parse(TEXT.replace("4 4 0", "4 4"))
    with pytest.raises(ValueError, match="3 unit names but 2 capacities"):
        lu.parse(TEXT.replace("    4     4     1", "    4     4"))


def test_program_bundles_reads_the_kernels_utilization_file(tmp_path):
    """The estimate's bundle count of a kernel is its dump's bundle lines, found by the op's
    name; an op without a utilization file has none."""
    (tmp_path / "module_0007-gdn2_bwd.3-0042-static-per-bundle-utilization.txt").write_text(TEXT)
    assert static_profile.program_bundles(str(tmp_path), "gdn2_bwd.3") == 4
    assert static_profile.program_bundles(str(tmp_path), "gdn2_fwd_train.2") is None


@pytest.mark.tpu_compile
@pytest.mark.slow
def test_the_estimates_bundles_are_the_kernels_program_length():
    """v5e, B=1 H=6 bf16 forward: the estimate's fit gives the kernel the bundle count of its
    program at the middle point (T=1024), within 5% of what ``llo_utilization`` measures on its
    own compile of the same program (the fit points compile with XLA's memory-space assignment
    off, ``static_profile.NO_MSA_FLAG``, and ``llo_utilization`` with it on)."""
    program = Program("pallas_tpu", "forward", 1, 1024, 6, 128, 128, "bfloat16")
    e = static_profile.estimate_fit(program, "v5e", [(1, 512), (1, 1024), (1, 2048)])
    (op,) = [op for op in e.ops if op.kernel]
    measured = lu.measure(program, "v5e", "gdn2_fwd").bundles
    assert measured > 1000
    assert abs(op.bundles - measured) <= 0.05 * measured, (op.bundles, measured)


@pytest.mark.tpu_compile
@pytest.mark.slow
def test_a_forward_kernels_step_is_measured():
    """v5e, B=1 T=512 H=6 bf16: the forward's step has MXU, VALU and store work, and no unit
    needs more cycles than the step has bundles."""
    program = Program("pallas_tpu", "forward", 1, 512, 6, 128, 128, "bfloat16")
    u = lu.measure(program, "v5e", "gdn2_fwd")
    assert u.bundles > 1000
    need = {name: u.min_cycles(j) for j, name in enumerate(u.units)}
    assert need["MXU"] > 0 and need["VALU"] > 0 and need["VSTORE"] > 0
    assert max(need.values()) <= u.bundles
