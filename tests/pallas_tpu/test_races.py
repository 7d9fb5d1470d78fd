"""Every pallas_tpu kernel in TPU interpret mode with the interpreter's race detector on, two
simulated cores and a random order of the "parallel" grid axes (``PallasTpuConfig``'s
``interpret_detect_races``, ``interpret_cores``, ``interpret_seed``; config.py).

With two cores the interpreter splits the points of the "parallel" grid axes (batch and head
group; the decode kernel's head blocks) between two threads and checks every read and write of
HBM, VMEM and SMEM, DMAs included, against a happens-before order: two accesses to overlapping
memory, one a write, from cores (or DMAs) not ordered by a semaphore are a race. It raises
(``on_race="raise"``): a ``JaxRuntimeError`` whose message holds ``RACE DETECTED``, which
:func:`no_races` turns into a failure naming the race; it also checks the interpreter's record
(``races.races_found``) after a clean run. Each case needs two points of the parallel axes at
least, so that both cores work (each case asserts it of its plan): B = 2, or two head groups
(H = 10: hb = 5 head-major, H = 16: hb = 8 token-major, and 16 value heads reading 8 key
heads, grouped keys; H = 16 with 32 value heads of 128 channels, grouped values; H = 10 with
scalar gates and cu_seqlens), or two decode head blocks (HV = 64,
d = 64: hb = 32). Two cases have them only because the plans block for the two cores (as for a
v5p, plan.py): B = 1 with H = 6 takes 3 heads a step (6 on one core), and 32 decode heads take
two blocks of 16 (one of 32 on one core).

Every run is also checked against the token-serial reference (the conformance kit's float32
tolerances, gdn2_conformance.metrics: the same bounds as the plain interpret-mode tests, since
neither the cores nor the order of the parallel grid points change any arithmetic): a race
the detector missed, or a grid point not run, would show as a wrong output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2_conformance import (
    DecodeCase,
    FeatureCase,
    GateHeads,
    assert_close,
    decode_reference_outputs,
    make_decode_inputs,
    make_feature_inputs,
    op_function,
    outputs_and_grads,
    reference_outputs_and_grads,
)
from gdn2_conformance.checks import reference_outputs
from gdn2_conformance.feature_suite import ACTIVATION_CASES, segment_rows, varlen_lengths
from gdn2_pallas_tpu import blocks
from gdn2_pallas_tpu.config import InterpretMode, PallasTpuConfig
from gdn2_pallas_tpu.decode_plan import make_decode_plan
from gdn2_pallas_tpu.plan import make_plan
from gdn2core import DecodeSpec, KernelConfig, gdn2_decode, gdn2_forward, gdn2_forward_trainable
from gdn2core.ops.forward.spec import OpSpec

C = 16  # the chunk length of every case


def race_config(seed: int) -> PallasTpuConfig:
    """Interpret mode with race detection, two cores and the parallel grid axes in the order of
    ``seed``."""
    return PallasTpuConfig(
        bt=C, interpret=True, interpret_detect_races=True, interpret_cores=2, interpret_seed=seed
    )


def _interpreter():
    """The module of TPU interpret mode that keeps the race record (``races``)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    assert hasattr(interpret_pallas_call, "races"), (
        "jax._src.pallas.mosaic.interpret.interpret_pallas_call has no `races` record: this JAX "
        "reports races differently; update no_races()"
    )
    return interpret_pallas_call


@contextlib.contextmanager
def no_races(detect: bool = True):
    """Fail when the interpreted kernels inside race (raised or recorded), or when none ran in
    interpret mode, or (``detect``) the detector checked no access. The interpreter's state is
    reset before and after, also after an exception (its docs require it)."""
    interpreter = _interpreter()
    pltpu.reset_tpu_interpret_mode_state()
    try:
        yield
    except Exception as error:
        pltpu.reset_tpu_interpret_mode_state()
        message = str(error)
        if "RACE DETECTED" in message:
            at = message.index("RACE DETECTED")
            pytest.fail(f"interpret mode detected a race:\n{message[at : at + 600]}")
        raise
    record = interpreter.races  # the last kernel's (each kernel starts a new record)
    pltpu.reset_tpu_interpret_mode_state()
    assert record is not None, "no kernel ran in TPU interpret mode"
    assert not record.races_found, "interpret mode recorded a race (races_found) without raising"
    if detect:  # the detector logs every access it checks: it was on
        assert record.reads and record.writes, "the race detector saw no memory access"


# --- the knobs ------------------------------------------------------------------------------


#: The knobs of interpret mode: (name, a value other than the default, the default).
KNOBS = (
    ("interpret_detect_races", True, False),
    ("interpret_cores", 2, 1),
    ("interpret_seed", 0, None),
)


def test_interpret_knobs_are_refused_without_interpret_mode():
    """A knob of interpret mode without ``interpret=True`` is refused by name, with the expected
    and the actual value, in the constructor and in ``model_copy``."""
    for knob, value, default in KNOBS:
        message = (
            f"{knob}: a knob of TPU interpret mode, expected {default!r} without interpret=True, "
            f"got {value!r}"
        )
        with pytest.raises(pydantic.ValidationError, match=re.escape(message)):
            PallasTpuConfig(**{knob: value})
        on = PallasTpuConfig(interpret=True, **{knob: value})
        with pytest.raises(pydantic.ValidationError, match=re.escape(message)):
            on.model_copy(update={"interpret": False})
        assert getattr(on, knob) == value


def test_interpret_knobs_are_strict_and_reach_both_plans():
    """Strict types and ranges like the core fields; a core config gets the interpreter's
    defaults; the forward and the decode plan carry the same hashable InterpretMode (None for the
    compiled kernels)."""
    for bad in ({"interpret_cores": "2"}, {"interpret_cores": 0}, {"interpret_cores": 9},
                {"interpret_seed": -1}, {"interpret_detect_races": 1}):  # fmt: skip
        with pytest.raises(pydantic.ValidationError, match=next(iter(bad))):
            PallasTpuConfig(interpret=True, **bad)
    core = PallasTpuConfig.from_config(KernelConfig(bt=C, interpret=True))
    assert core.interpret_mode() == InterpretMode(detect_races=False, cores=1, seed=None)
    assert PallasTpuConfig(bt=C).interpret_mode() is None
    config = race_config(3)
    assert hash(config) == hash(race_config(3)) and config != race_config(4)
    spec = OpSpec(1, 32, 2, 64, 64, "float32", 0.125)
    plan = make_plan(spec, config, 128 * 2**20)
    decode = make_decode_plan(
        DecodeSpec(2, 1, 16, 16, 16, 64, 64, "float32", 0.125, 2, "float32", False, False),
        config,
        128 * 2**20,
    )
    assert plan.interpret == decode.interpret == InterpretMode(True, 2, 3)
    assert hash(plan) != hash(make_plan(spec, race_config(4), 128 * 2**20))
    assert make_plan(spec, PallasTpuConfig(bt=C), 128 * 2**20).interpret is None


# --- the detector itself ----------------------------------------------------------------------


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = 2.0 * x_ref[...]


def _two_step_call(interpret, *, same_output_block: bool):
    """A ``pallas_call`` over a "parallel" axis of 2 steps; with ``same_output_block`` both
    steps write the same output block (a race between two cores), else each its own."""
    x = jnp.ones((2, 8, 128), jnp.float32)
    out = (8, 128) if same_output_block else (2, 8, 128)
    block = (8, 128) if same_output_block else (None, 8, 128)
    index = (lambda i: (0, 0)) if same_output_block else (lambda i: (i, 0, 0))
    return pl.pallas_call(
        _copy_kernel,
        out_shape=jax.ShapeDtypeStruct(out, jnp.float32),
        grid=(2,),
        in_specs=[pl.BlockSpec((None, 8, 128), lambda i: (i, 0, 0))],
        out_specs=pl.BlockSpec(block, index),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(x)


def test_the_knobs_reach_the_interpreter_and_it_catches_a_race():
    """The config's knobs become the plan's InterpretMode and ``InterpretParams``; with them a
    kernel whose two parallel steps write one block fails :func:`no_races`, the same kernel
    writing a block per step passes it. (A core config, or the defaults, give one core and no
    detector, under which the racing kernel runs silently.)"""
    spec = OpSpec(2, 32, 2, 64, 64, "float32", 0.125)
    plan = make_plan(spec, race_config(5), 128 * 2**20)
    assert plan.interpret == InterpretMode(detect_races=True, cores=2, seed=5)
    params = blocks.interpret_params(plan)
    assert isinstance(params, pltpu.InterpretParams)
    assert (params.detect_races, params.num_cores_or_threads, params.random_seed) == (True, 2, 5)
    assert params.on_race == "raise"
    default = blocks.interpret_params(make_plan(spec, PallasTpuConfig(bt=C, interpret=True)))
    assert (default.detect_races, default.num_cores_or_threads, default.random_seed) == (
        False,
        1,
        None,
    )
    assert blocks.interpret_params(make_plan(spec, PallasTpuConfig(bt=C))) is False

    caught = pytest.raises(pytest.fail.Exception, match="interpret mode detected a race")
    with caught, no_races():
        jax.block_until_ready(_two_step_call(params, same_output_block=True))
    with no_races():
        y = _two_step_call(params, same_output_block=False)
        np.testing.assert_array_equal(np.asarray(y), 2.0)
    with no_races(detect=False):  # no detector, one core: the racing kernel is not caught
        jax.block_until_ready(_two_step_call(default, same_output_block=True))


# --- every kernel ---------------------------------------------------------------------------


def _assert_both_cores_busy(x, config) -> None:
    """The forward and backward grids have two points at least on their "parallel" axes (batch,
    head group), so that each of the two simulated cores runs some of them."""
    B, T, _, dk = x.q.shape
    heads, dv = x.v.shape[2:]
    plan = make_plan(OpSpec(B, T, heads, dk, dv, "float32", 1.0), config, 128 * 2**20)
    points = plan.batch * plan.head_groups
    assert points >= 2, f"parallel grid points: expected 2 or more (one per core), got {points}"


def _check_train(x, config) -> None:
    """The training forward and the backward kernel: o, h_final and every gradient."""
    _assert_both_cores_busy(x, config)
    fn = op_function(gdn2_forward_trainable, x, config=config, backend="pallas_tpu")
    with no_races():
        o, h, grads = jax.block_until_ready(outputs_and_grads(fn, x))
    o_ref, h_ref, grads_ref = reference_outputs_and_grads(x)
    assert_close("o", o, o_ref, "float32")
    assert_close("h_final", h, h_ref, "float32")
    for name, got, want in zip(x.grad_names, grads, grads_ref, strict=True):
        assert_close(name, got, want, "float32")


def _check_inference(x, config) -> None:
    """The inference forward kernel (no residuals): o and h_final."""
    _assert_both_cores_busy(x, config)
    fn = jax.jit(op_function(gdn2_forward, x, config=config, backend="pallas_tpu"))
    with no_races():
        o, h = jax.block_until_ready(fn(*x.diff_args))
    o_ref, h_ref = reference_outputs(x)
    assert_close("o", o, o_ref, "float32")
    assert_close("h_final", h, h_ref, "float32")


def _check_decode(case: DecodeCase, config) -> None:
    """The decode kernel under jit, sequence 1 skipped (``-1``: its block is its neighbour's,
    revisited): the valid sequences' o and token states, and the pool, as the decode
    reference; the skipped sequence's outputs NaN."""
    x = make_decode_inputs(case)
    spec = DecodeSpec.from_inputs(*x.args, x.state, x.state_indices, None, True).resolved()
    blocks_ = make_decode_plan(spec, config, 128 * 2**20).head_blocks
    assert blocks_ >= 2, f"decode head blocks: expected 2 or more (one per core), got {blocks_}"
    x = dataclasses.replace(x, state_indices=x.state_indices.at[1].set(-1))

    def run(q, k, v, w, b, g, state, idx):
        return gdn2_decode(
            q, k, v, w, b, g, state, state_indices=idx, return_token_states=True,
            config=config, backend="pallas_tpu",
        )  # fmt: skip

    with no_races():
        o, pool, states = jax.block_until_ready(jax.jit(run)(*x.args, x.state, x.state_indices))
    o_ref, pool_ref, states_ref = decode_reference_outputs(x)
    valid = np.asarray(x.state_indices) >= 0
    assert np.all(np.isnan(np.asarray(o)[~valid])), "o of the skipped sequence: expected NaN"
    assert_close("o (decode)", np.asarray(o)[valid], np.asarray(o_ref)[valid], "float32")
    assert_close("state (decode)", pool, pool_ref, "float32")
    assert_close(
        "token_states (decode)", np.asarray(states)[valid], np.asarray(states_ref)[valid],
        "float32",
    )  # fmt: skip


def _with_scalar_gates(check):
    """``check`` on the inputs with w, b, g as scalar gates (their first channel)."""

    def run(x, config) -> None:
        check(dataclasses.replace(x, w=x.w[..., 0], b=x.b[..., 0], g=x.g[..., 0]), config)

    return run


def _feature(**kw) -> FeatureCase:
    return FeatureCase(**{"dk": 64, "dv": 64, **kw})


#: name -> (check, inputs, seed). The first (make test's) is the smallest: T = 20, one grid step
#: of 2 chunks per batch row, a row per core. T = 150 at C = 16: 10 chunks, 2 grid steps of 5
#: chunks (the carried state and dS across steps); the packed cases use the kit's rows
#: (T = 2C + 7, one step).
CASES = {
    "train_B2_H1": (_check_train, _feature(B=2, T=20, H=1, seed=1), 11),
    "inference_B2_H3": (_check_inference, _feature(B=2, T=150, H=3, seed=2), 12),
    "train_H10_head_major_two_head_groups": (_check_train, _feature(T=150, H=10, seed=3), 13),
    "train_H16_token_major_two_head_groups": (_check_train, _feature(T=150, H=16, seed=4), 14),
    "train_B1_H6_head_groups_for_two_cores": (  # hb 6 -> 3: the plan splits for the 2 cores
        _check_train, _feature(T=150, H=6, seed=13), 23,
    ),
    "train_segments_B2": (
        _check_train, _feature(B=2, T=2 * C + 7, H=2, rows=segment_rows(C), seed=5), 15,
    ),
    "train_varlen_H10_two_head_groups": (
        _check_train, _feature(T=2 * C + 7, H=10, seqlens=varlen_lengths(C), seed=6), 16,
    ),
    "train_fused_gates_B2": (
        _check_train, _feature(B=2, T=150, H=2, activations=ACTIVATION_CASES[0], seed=7), 17,
    ),
    "train_gva_B2": (_check_train, _feature(B=2, T=150, H=2, groups=2, seed=8), 18),
    "train_grouped_keys_two_head_groups": (  # q, k read from 8 key heads by 16 value heads
        _check_train, _feature(T=150, H=8, groups=2, gate_heads=GateHeads.VALUE, seed=10), 20,
    ),
    "train_grouped_values_two_head_groups": (  # v, w, o as the caller's 32 value heads
        _check_train, _feature(T=150, H=16, dv=128, groups=2, seed=12), 22,
    ),
    "train_scalar_gates_varlen_H10": (  # GDN's gates: the pair decay, the scalar blocks
        _with_scalar_gates(_check_train),
        _feature(T=2 * C + 7, H=10, seqlens=varlen_lengths(C), seed=11), 21,
    ),
    "decode_HV32_head_blocks_for_two_cores": (  # hb 32 -> 16: the plan splits for the 2 cores
        _check_decode, DecodeCase(N=3, S=2, H=32, HV=32, dk=64, dv=64, P=5, seed=14), 24,
    ),
    "decode_HV64_two_head_blocks": (
        _check_decode, DecodeCase(N=3, S=2, H=64, HV=64, dk=64, dv=64, P=5, seed=9), 19,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_is_race_free_on_two_cores_in_random_order(case):
    check, inputs, seed = CASES[case]
    if isinstance(inputs, FeatureCase):
        inputs = make_feature_inputs(inputs)
    check(inputs, race_config(seed))
