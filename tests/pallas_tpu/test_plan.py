"""The static plan of a call: blocking, VMEM byte model (an upper bound of what the TPU compiler
needs), cost formulas. Compile-time analysis only."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from gdn2_jax_ref.config import JaxRefConfig
from gdn2_pallas_tpu import cost
from gdn2_pallas_tpu.config import PallasTpuConfig
from gdn2_pallas_tpu.kernels_bwd import backward_call
from gdn2_pallas_tpu.kernels_fwd import forward_call
from gdn2_pallas_tpu.plan import (
    MAX_BACKWARD_BUNDLES,
    MAX_STEP_ROWS,
    Layout,
    backward_bundles,
    check_plan,
    forward_bundles,
    looped_backward_bundles,
    make_plan,
    max_step_rows,
    max_train_step_rows,
    precisions_for,
    varlen_plan,
    vmem_bytes,
)
from gdn2core import DEFAULT_CONFIG, LONG_CHUNKS, KernelConfig
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.plugin import SegmentMode

V5E = 128 * 2**20  # per-core VMEM of v5e and v6e


@pytest.mark.parametrize(
    ("H", "T", "hb", "nc"),
    [
        (6, 4096, 6, 4),
        (16, 4096, 8, 2),
        (3, 4096, 3, 8),
        (6, 100, 6, 2),
        (2, 1, 2, 1),
        (7, 448, 7, 1),
    ],
)
def test_blocking(H, T, hb, nc):
    plan = make_plan(OpSpec(1, T, H, 128, 128, "bfloat16", 1.0), DEFAULT_CONFIG, V5E)
    assert (plan.hb, plan.nc) == (hb, nc)
    assert plan.units * plan.C <= MAX_STEP_ROWS or plan.units == plan.hb
    assert plan.t_pad % plan.step_len == 0 and plan.t_pad >= T


@pytest.mark.parametrize(
    ("config", "n_seqs", "nc"),
    [(DEFAULT_CONFIG, 0, 8), (LONG_CHUNKS, 0, 4), (DEFAULT_CONFIG, 3, 4)],
)
def test_a_256_deep_mxu_takes_twice_the_rows_a_step(config, n_seqs, nc):
    """v6e (MXU 256 deep): 6 heads take 8 chunks of 64 or 4 of 128 a step, twice v5e's rows
    (a cu_seqlens call keeps v5e's: each sequence may pad up to a step)."""
    spec = OpSpec(1, 4096, 6, 128, 128, "bfloat16", 1.0)
    deep = make_plan(spec, config, V5E, mxu_depth=256, n_seqs=n_seqs)
    assert (deep.hb, deep.nc) == (6, nc)
    shallow = make_plan(spec, config, V5E, mxu_depth=128, n_seqs=n_seqs)
    assert deep.units * deep.C == (1 if n_seqs else 2) * shallow.units * shallow.C
    assert deep.units * deep.C <= max_step_rows(256, n_seqs)


@pytest.mark.parametrize(
    ("B", "H", "cores", "hb"),
    [
        (1, 6, 1, 6),  # one TensorCore: the largest divisor, as ever
        (1, 6, 2, 3),  # two: 2 head groups, one per core, 8 chunks a step (the same 24 units)
        (2, 6, 2, 6),  # the batch rows already split evenly
        (3, 6, 2, 3),  # 3 rows x 2 head groups
        (1, 7, 2, 7),  # no divisor splits 7 heads evenly: unchanged
        (1, 8, 2, 8),  # token-major blocks hold 8 heads: one group (a copy would cost more)
        (1, 16, 2, 8),
    ],
)
def test_heads_per_step_give_each_tensor_core_as_many_grid_points(B, H, cores, hb):
    """On a chip with two TensorCores per device (v5p) the compiler splits the "parallel" grid
    points (batch row, head group) between them: the plan takes the largest ``hb`` that gives
    both as many, where one exists."""
    spec = OpSpec(B, 4096, H, 128, 128, "bfloat16", 1.0)
    plan = make_plan(spec, DEFAULT_CONFIG, V5E, cores=cores)
    assert plan.hb == hb
    assert plan.units == make_plan(spec, DEFAULT_CONFIG, V5E).units  # nc makes up the rows
    interpreted = PallasTpuConfig(bt=64, interpret=True, interpret_cores=cores)
    assert make_plan(spec, interpreted, V5E).hb == hb  # interpret mode: its simulated cores


@pytest.mark.parametrize(
    ("H", "dv", "T", "planned", "trained"),
    [
        (6, 128, 32768, 4, 4),
        (2, 256, 10 * 64, 5, 8),
        (16, 64, 67 * 64, 1, 2),
        (4, 256, 128, 2, 2),
    ],
    ids=["H6", "dv256-ten-chunks-padded", "dv64-prime-chunks", "dv256-two-chunks"],
)
def test_training_plan_saves_no_more_state_than_a_key_or_the_chunk_matrices(
    H, dv, T, planned, trained
):
    """Where the cap on a training step's rows allows (bfloat16: 24 units of 64 tokens), a
    training plan takes ``nc C >= dv`` and ``nc C^2 >= dk dv`` tokens a step (the smallest such
    divisor of the chunks, else padded; at most the chunks there are, and what fits the VMEM),
    so the state it saves per step (``dk dv`` per head) is at most ``dk`` values per token and
    head, and at most the ``C`` of the chunk matrices saved beside it: 6 heads keep their 4
    chunks; 2 heads at dv = 256 go from 5 chunks to 8 (10 chunks padded to 16); 16 heads at
    dv = 64 from 1 of 67 (prime) to 2; two chunks are all there are."""
    spec = OpSpec(1, T, H, 128, dv, "bfloat16", 1.0)
    plan = make_plan(spec, DEFAULT_CONFIG, V5E)
    train = make_plan(spec, DEFAULT_CONFIG, V5E, training=True)
    assert (plan.nc, train.nc, train.hb) == (planned, trained, plan.hb)
    if train.n_steps > 1 and dv <= 128:  # the step states per token and head: at most C values
        assert train.n_steps * 128 * dv <= train.t_pad * train.C
    if train.n_steps > 1:  # at most dk values
        assert train.n_steps * 128 * dv <= train.t_pad * 128


@pytest.mark.parametrize(
    ("H", "dtype", "dv", "T", "depth", "n_seqs", "planned", "trained"),
    [
        (16, "bfloat16", 128, 32768, 128, 0, (8, 2), (8, 2, 0)),
        (16, "bfloat16", 128, 12288, 128, 0, (8, 3), (8, 2, 0)),
        (16, "bfloat16", 256, 32768, 128, 0, (8, 2), (8, 2, 4)),
        (6, "bfloat16", 128, 32768, 128, 0, (6, 4), (6, 4, 0)),
        (6, "float32", 128, 32768, 128, 0, (6, 4), (6, 2, 0)),
        (16, "float32", 128, 32768, 128, 0, (8, 2), (8, 2, 4)),
        (16, "float32", 256, 32768, 128, 0, (8, 2), (8, 1, 0)),
        (6, "bfloat16", 128, 32768, 256, 0, (6, 8), (6, 4, 0)),
        (6, "float32", 128, 32768, 256, 0, (6, 8), (6, 2, 0)),
        (6, "float32", 128, 32768, 128, 3, (6, 4), (6, 2, 0)),
        (16, "float32", 128, 32768, 128, 3, (8, 2), (8, 1, 0)),
    ],
    ids=["H16", "H16-3-chunks", "H16-dv256", "H6", "H6-float32", "H16-float32",
         "H16-float32-dv256", "v6e", "v6e-float32", "cu_seqlens-float32",
         "cu_seqlens-H16-float32"],
)  # fmt: skip
def test_training_plan_caps_the_backward_program(H, dtype, dv, T, depth, n_seqs, planned, trained):
    """A training plan's step takes at most ``max_train_step_rows`` rows, those whose backward
    program ``backward_bundles`` keeps within ``MAX_BACKWARD_BUNDLES``, on every MXU depth and
    over the saved states' floor (16 heads: 8 heads x 2 chunks, not the 4 the floor asks for): 6
    heads keep 24 units in bfloat16 and take 12 in float32, 16 heads take 2 chunks a step in
    bfloat16 (also where 3 divide the chunks) (plan.py, "Training steps": each blocking the cap
    refuses ran 2.2x to 2.4x slower on a TPU v5e). Where the cap leaves one chunk a step (16 heads
    with float32 inputs or 256-wide value heads), the backward loops over its heads, 4 an
    iteration, and the step takes 2 chunks, but where the training forward's program would then
    be over the bound (float32 with 256-wide value heads: ``forward_bundles``) and in a
    ``cu_seqlens`` row (no floor, no loop). The inference plan keeps its rows."""
    spec = OpSpec(1, T, H, 128, dv, dtype, 1.0)
    if n_seqs:
        spec = dataclasses.replace(spec, segments=SegmentMode.CU_SEQLENS, n_seqs=n_seqs)
        plans = [varlen_plan(spec, DEFAULT_CONFIG, V5E, mxu_depth=depth, training=t)
                 for t in (False, True)]  # fmt: skip
    else:
        plans = [make_plan(spec, DEFAULT_CONFIG, V5E, mxu_depth=depth, training=t)
                 for t in (False, True)]  # fmt: skip
    assert [(p.hb, p.nc) for p in plans] == [planned, trained[:2]]
    assert [p.loop_heads for p in plans] == [0, trained[2]]
    train = plans[1]
    rows = max_train_step_rows(train.layout, 128, dv, train.precisions)
    bwd = looped_backward_bundles(train.hb, train.loop_heads, train.nc, train.C, 128, dv,
                                  train.precisions)  # fmt: skip
    if not train.loop_heads:
        assert train.units * train.C <= max(rows, train.hb * train.C)
        bwd = backward_bundles(train.units * train.C, train.layout, 128, dv, train.precisions)
    assert bwd <= MAX_BACKWARD_BUNDLES or train.units == train.hb
    assert forward_bundles(train.units * train.C, train.layout, 128, dv, train.precisions) <= (
        MAX_BACKWARD_BUNDLES
    )


#: The backward blockings timed on a TPU v5e (docs/results.md, "A fourth run" and "A fifth run"):
#: layout, dtype, dv, rows a step, the program's bundles in the compiler's schedule (``python -m
#: gdn2_tools.llo_utilization --mode train --kernel gdn2_bwd -B 1``), and whether the kernel ran
#: at its static estimate's speed (within 1.04x of it, or of the same work at a shorter blocking)
#: or 2.2x to 2.4x slower.
CHIP_BLOCKINGS = [
    ("head-major", "bfloat16", 128, 6 * 4 * 64, 62_551, True),
    ("token-major", "bfloat16", 128, 8 * 2 * 64, 51_435, True),
    ("token-major", "bfloat16", 128, 8 * 3 * 64, 77_159, False),
    ("token-major", "bfloat16", 128, 8 * 4 * 64, 104_708, False),
    ("token-major", "bfloat16", 256, 8 * 2 * 64, 69_237, False),
    ("head-major", "float32", 128, 6 * 2 * 64, 57_265, True),
    ("head-major", "float32", 128, 6 * 4 * 64, 113_228, False),
    ("token-major", "float32", 128, 8 * 2 * 64, 88_296, False),
    ("token-major", "float32", 128, 8 * 1 * 64, 43_469, True),
    ("token-major", "bfloat16", 256, 8 * 1 * 64, 35_173, True),
]


@pytest.mark.parametrize(("layout", "dtype", "dv", "rows", "bundles", "fast"), CHIP_BLOCKINGS)
def test_program_model_bounds_the_measured_programs_and_sorts_them_as_the_chip_did(
    layout, dtype, dv, rows, bundles, fast
):
    """``backward_bundles`` is at least each measured program's length (the cap is then never
    looser than the measurements) and within 1.2x of it (not so loose that it refuses blockings
    for nothing), and ``MAX_BACKWARD_BUNDLES`` admits exactly the blockings that ran fast."""
    precisions = precisions_for(dtype)
    model = backward_bundles(rows, Layout(layout), 128, dv, precisions)
    assert bundles <= model <= 1.2 * bundles
    assert (model <= MAX_BACKWARD_BUNDLES) == fast
    assert (rows <= max_train_step_rows(Layout(layout), 128, dv, precisions)) == fast


#: The training forward's programs measured (``python -m gdn2_tools.llo_utilization --mode train
#: --kernel gdn2_fwd_train -B 1``, or ``gdn2 tpu-report --estimate``'s program at the long shape;
#: docs/results.md, "A sixth run" and "A seventh run"): layout, dtype, dv, rows a step, bundles
#: (None: not compiled for its length), and whether it ran at its estimate's speed on a TPU v5e
#: (the float32 forward of 16 heads at 8 x 4 took 2.4x its time at 8 x 2; at 8 x 2 with 256-wide
#: value heads it did not finish in the driver's 130 s).
CHIP_FORWARDS = [
    ("token-major", "bfloat16", 128, 8 * 4 * 64, 50_860, True),
    ("token-major", "bfloat16", 256, 8 * 2 * 64, 32_064, True),
    ("head-major", "float32", 128, 6 * 4 * 64, 62_881, True),
    ("token-major", "float32", 128, 8 * 2 * 64, 48_479, True),
    ("token-major", "float32", 256, 8 * 1 * 64, 33_321, True),
    ("token-major", "float32", 128, 8 * 4 * 64, None, False),
    ("token-major", "float32", 256, 8 * 2 * 64, None, False),
]


@pytest.mark.parametrize(("layout", "dtype", "dv", "rows", "bundles", "fast"), CHIP_FORWARDS)
def test_forward_program_model_bounds_the_measured_programs(layout, dtype, dv, rows, bundles,
                                                            fast):  # fmt: skip
    """``forward_bundles`` is at least each measured forward program (within 1.2x of it) and
    ``MAX_BACKWARD_BUNDLES`` admits exactly the forwards that ran fast."""
    model = forward_bundles(rows, Layout(layout), 128, dv, precisions_for(dtype))
    if bundles is not None:
        assert bundles <= model <= 1.2 * bundles
    assert (model <= MAX_BACKWARD_BUNDLES) == fast


#: Looped backward steps measured (``llo_utilization --mode train --kernel gdn2_bwd -B 1 -T
#: 1024``): dtype, dv, heads x chunks a step, heads an iteration, bundles.
LOOPED_PROGRAMS = [
    ("bfloat16", 128, 8, 4, 4, 50_572),
    ("bfloat16", 128, 8, 4, 2, 34_930),
    ("bfloat16", 256, 8, 2, 4, 33_304),
    ("float32", 128, 8, 2, 4, 40_821),
]


@pytest.mark.parametrize(("dtype", "dv", "hb", "nc", "hs", "bundles"), LOOPED_PROGRAMS)
def test_looped_backward_model_bounds_the_measured_programs(dtype, dv, hb, nc, hs, bundles):
    """``looped_backward_bundles`` is at least each measured looped program, within 1.3x (its
    body is counted by the unlooped head-major step's largest per unit; its staging by the largest
    measured per unit: the 256-wide value heads' is a fifth of it)."""
    model = looped_backward_bundles(hb, hs, nc, 64, 128, dv, precisions_for(dtype))
    assert bundles <= model <= 1.3 * bundles


def test_blocking_shrinks_to_fit_a_small_vmem():
    big = make_plan(OpSpec(1, 4096, 6, 256, 256, "float32", 1.0), LONG_CHUNKS, V5E)
    small = make_plan(OpSpec(1, 4096, 6, 256, 256, "float32", 1.0), LONG_CHUNKS, 16 * 2**20)
    assert small.units < big.units
    assert vmem_bytes(small, True)["total"] <= 0.9 * 16 * 2**20 or small.units == 1


def _sds(shape, dtype):
    from jax.sharding import NamedSharding, PartitionSpec

    from gdn2_tools.tpu import topology_mesh

    sharding = NamedSharding(topology_mesh("v5e:1x1"), PartitionSpec())
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)


@pytest.mark.tpu_compile
@pytest.mark.parametrize(
    ("heads", "dtype", "training"),
    [(6, "bfloat16", False), (6, "float32", False), (16, "float32", True)],
    ids=["bfloat16", "float32", "float32-looped"],
)
def test_vmem_byte_model_is_enough_for_the_compiler(heads, dtype, training):
    """Both kernels compile with ``vmem_limit_bytes`` set to the byte model's total: the model
    does not under-count what Mosaic allocates (it is planned against 90% of the chip's VMEM).
    The third case is a training plan whose backward loops over its heads (16 heads, float32:
    8 x 2 chunks in 2 iterations of 4), with its head-major stages."""
    spec = OpSpec(1, 512, heads, 128, 128, dtype, 128**-0.5)
    plan = make_plan(spec, DEFAULT_CONFIG, V5E, training=training)
    assert bool(plan.loop_heads) == training, plan
    K, V, hb = plan.dk, plan.dv, plan.hb
    tokens = (1, heads, plan.t_pad) if plan.layout is Layout.HEAD_MAJOR else (1, plan.t_pad, heads)
    key = _sds((*tokens, K), dtype)
    val = _sds((*tokens, V), dtype)
    state = _sds((1, heads, K, V), "float32")
    steps = (1, plan.head_groups, plan.n_steps)
    packed = _sds((*steps, *plan.residual_block), plan.residual_dtype)
    states = _sds((1, plan.head_groups, plan.saved_states, hb, K, V), plan.saved_state_dtype)
    for backward in (False, True):
        limit = dataclasses.replace(plan, vmem_limit_bytes=vmem_bytes(plan, backward)["total"])
        if backward:
            # q k v w b g dO, no starts / gate parameters / chunk table / per-sequence states
            args = (key, key, val, val, key, key, val, None, None, None, None, None)
            args += (packed, states, state, state)  # TA, states, h0, dh_final
        else:
            args = (key, key, val, val, key, key, None, None, None, None, state)
        fn = functools.partial(backward_call if backward else forward_call, plan=limit)
        if not backward:
            fn = functools.partial(fn, save=True)
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).compile().as_text()
        assert "tpu_custom_call" in text


def test_cost_counts_scale_with_tokens():
    spec = OpSpec(2, 1024, 6, 128, 128, "bfloat16", 1.0)
    plan = make_plan(spec, DEFAULT_CONFIG, V5E)
    double = make_plan(dataclasses.replace(spec, seq_len=2048), DEFAULT_CONFIG, V5E)
    for fn in (lambda p: cost.cost_forward(p, True), cost.cost_backward):
        one, two = fn(plan), fn(double)
        assert two["flops"] == 2 * one["flops"]
        assert two["transcendentals"] == 2 * one["transcendentals"]
    # the level scheme's forward FLOPs per token at C = 64, K = V = 128 (cost.py's formula)
    levels = 4 * 6 * 64 * 128 + 4 * 6 * 64 * 64  # scores, WY inverse
    assert (
        cost.flops_forward_per_token(plan) == levels + 2 * 64 * 256 + 6 * 128 * 128 + 2 * 64 * 128
    )


def test_plan_reads_a_core_or_own_config_and_refuses_another_backends():
    """A core KernelConfig and a PallasTpuConfig with the same fields plan alike; jax_ref's
    JaxRefConfig (whose bc, wy_block and clip the kernels would ignore) is refused by name."""
    spec = OpSpec(1, 256, 2, 64, 64, "float32", 0.125)
    core = KernelConfig(bt=32, wy_eps=0.01)
    own = PallasTpuConfig.from_config(core)
    assert type(own) is PallasTpuConfig and own == PallasTpuConfig(bt=32, wy_eps=0.01)
    assert PallasTpuConfig.from_config(own) is own
    assert make_plan(spec, core, V5E) == make_plan(spec, own, V5E)
    assert make_plan(spec, own, V5E).wy_eps == 0.01
    message = "config: expected a KernelConfig or PallasTpuConfig, got JaxRefConfig"
    with pytest.raises(TypeError, match=message):
        make_plan(spec, JaxRefConfig(bt=32), V5E)
    assert check_plan(spec, JaxRefConfig(bt=32)) == message
