"""The backward step that loops over its heads (plan.loop_heads, kernels_bwd._head_loop), in TPU
interpret mode with the race detector on two simulated cores in a random order (test_races.py's
configuration), against the token-serial reference.

Training plans loop where the cap on the backward's program leaves one chunk a step (plan.py,
"Training steps"): 16 heads with float32 inputs or 256-wide value heads, at d = 128. The cases
here are small (C = 16, d = 64, T = 150: 10 chunks, 5 grid steps of 2), so the cap is set to one
chunk of 8 heads (``max_train_step_rows`` patched) and the plan's own rule takes the loop: 8
heads x 2 chunks a step, 2 iterations of 4 heads. ``4 x 2`` units an iteration is the lane
packing of the saved ``T | A_qk^T`` at C = 16 (8 units a row), so an iteration's residuals are
whole packed rows. Each feature the loop stages differently runs once: plain 16 heads (the quick
tier's case), grouped values (32 value heads read as 16 of 2 x 64), grouped keys, fused gates,
scalar gates, packed segments. Tolerances: the conformance kit's float32 bounds, as every
interpret-mode test (test_races.py): the loop changes which heads a product batches, not its
arithmetic."""

from __future__ import annotations

from unittest import mock

import pytest

from gdn2_conformance import GateHeads, make_feature_inputs
from gdn2_conformance.feature_suite import ACTIVATION_CASES, segment_rows
from gdn2_pallas_tpu import plan as plan_module
from gdn2_pallas_tpu.config import PallasTpuConfig
from gdn2_pallas_tpu.plan import make_plan
from gdn2core.ops.forward.spec import OpSpec
from tests.pallas_tpu.test_races import _check_train, _feature, _with_scalar_gates, race_config

C = 16

#: name -> (check, inputs, seed); the first is the quick tier's.
CASES = {
    "H16": (_check_train, _feature(T=150, H=16, seed=4), 14),
    "grouped_values": (_check_train, _feature(T=150, H=16, dv=128, groups=2, seed=12), 22),
    "grouped_keys": (
        _check_train, _feature(T=150, H=8, groups=2, gate_heads=GateHeads.VALUE, seed=10), 20,
    ),
    "fused_gates_B2": (
        _check_train, _feature(B=2, T=150, H=16, activations=ACTIVATION_CASES[0], seed=7), 17,
    ),
    "scalar_gates": (_with_scalar_gates(_check_train), _feature(T=150, H=16, seed=11), 21),
    "segments_B2": (
        _check_train, _feature(B=2, T=2 * C + 7, H=16, rows=segment_rows(C), seed=5), 15,
    ),
}  # fmt: skip


def _one_chunk_cap(*_args) -> int:
    """``max_train_step_rows`` at one chunk of 8 heads."""
    return 8 * C


@pytest.mark.parametrize("case", list(CASES))
def test_looped_backward_matches_the_reference_race_free(case):
    check, features, seed = CASES[case]
    x = make_feature_inputs(features)
    config = race_config(seed)
    B, T, _, dk = x.q.shape
    heads, dv = x.v.shape[2:]
    spec = OpSpec(B, T, heads, dk, dv, "float32", 1.0)
    with mock.patch.object(plan_module, "max_train_step_rows", _one_chunk_cap):
        plan = make_plan(spec, config, 128 * 2**20, training=True)
        assert (plan.hb, plan.nc, plan.loop_heads) == (8, 2, 4), plan
        check(x, config)


@pytest.mark.parametrize(("chunk", "d", "loop_heads"), [(16, 64, 0), (64, 128, 2)])
def test_no_loop_where_an_iteration_would_split_a_packed_row(chunk, d, loop_heads):
    """An iteration's units must be whole rows of the lane-packed residuals. A step of 4 heads
    capped at one chunk: at C = 16 a row packs 8 units, so 2 heads x 2 chunks (4 units) would split
    one and the step stays unlooped at 1 chunk; at C = 64 (2 units a row) it loops, 2 chunks."""
    spec = OpSpec(1, 32 * chunk, 4, d, d, "float32", 1.0)
    with mock.patch.object(plan_module, "max_train_step_rows", lambda *_: 4 * chunk):
        plan = make_plan(spec, PallasTpuConfig(bt=chunk), 128 * 2**20, training=True, cores=1)
    assert (plan.hb, plan.nc, plan.loop_heads) == (4, 2 if loop_heads else 1, loop_heads), plan
