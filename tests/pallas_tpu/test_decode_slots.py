"""The pallas_tpu decode kernel and the slots it is given: skipped sequences (``-1``, out of range,
or a slot named twice) read and write nothing of the pool, wherever they sit among the valid ones;
the backend's ``decode`` sanitises the slots itself (called directly, not through
``gdn2_decode``); the pool is written only by the kernel's own DMAs; and all of it with TPU
interpret mode's race detector on two simulated cores, in both of its DMA execution modes.

Ground truth: ``gdn2_decode_reference`` on the same raw indices (it sanitises them by the core's
rule, and its skipped sequences are NaN), and an independent NumPy statement of which sequences
are skipped. Tolerance: the kit's decode tolerance (``gdn2_conformance.metrics``): 1e-5 for
float32 (both sides are token-serial in float32; the kernel folds the decay into its read vectors,
a few roundings per token apart, about 1e-7 measured), 2e-2 for a bfloat16 pool (the state is
rounded to bfloat16 once per call on both sides, but from float32 values a few ulps apart).
Slots no valid sequence names must come back bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2_conformance import DecodeCase, assert_close, decode_reference_outputs, make_decode_inputs
from gdn2_pallas_tpu import decode_plan, kernels_decode
from gdn2_pallas_tpu.decode_op import step_sources
from gdn2_pallas_tpu.decode_plan import make_decode_plan
from gdn2core import DecodeSpec, KernelConfig, get_backend
from gdn2core.plugin import PAIRWISE_MAX, sanitize_slots
from tests.support.slots import random_slot_indices

INTERPRET = KernelConfig(bt=16, interpret=True)
BACKEND = get_backend("pallas_tpu")


def _races_on_two_cores(mode: str = "on_wait"):
    """The interpret mode of these tests: the race detector (a race raises ``RACE DETECTED``),
    two simulated cores (the "parallel" head-block axis split between them), DMAs executed when
    waited on (``on_wait``, the interpreter's default) or when started (``eager``)."""

    def params(plan):
        assert plan.interpret, "these tests run the kernel in interpret mode"
        return pltpu.InterpretParams(
            detect_races=True, num_cores_or_threads=2, dma_execution_mode=mode
        )

    return params


@pytest.fixture
def races(monkeypatch):
    """Run the decode kernel under :func:`_races_on_two_cores` (``races(mode)`` to choose)."""

    def use(mode: str = "on_wait") -> None:
        monkeypatch.setattr(kernels_decode, "interpret_params", _races_on_two_cores(mode))

    use()
    yield use
    pltpu.reset_tpu_interpret_mode_state()


def _skipped(slots, pool_size: int) -> np.ndarray:
    """NumPy, independently of the code under test: a sequence is skipped when its slot is out of
    ``[0, P)`` or named by another sequence too (docs/operator.md, decode)."""
    slots = np.asarray(slots)
    inside = (slots >= 0) & (slots < pool_size)
    counts = {s: int(np.sum(slots == s)) for s in slots}
    return ~inside | np.array([counts[s] > 1 for s in slots])


def _inputs(N, S, HV, d, P, pool="float32", seed=0):
    case = DecodeCase(N=N, S=S, H=HV, HV=HV, dk=d, dv=d, P=P, seed=seed)
    return make_decode_inputs(case, jnp.float32, jnp.dtype(pool))


def _spec(x) -> DecodeSpec:
    """The resolved spec a backend receives (q, k, b, g already on the HV heads)."""
    N, S, HV, dk = x.q.shape
    P, dv = x.state.shape[0], x.v.shape[-1]
    return DecodeSpec(
        N, S, HV, HV, HV, dk, dv, "float32", dk**-0.5, P, str(x.state.dtype), True, True
    )


def _backend_decode(x, slots):
    """The backend's ``decode`` called directly, under ``jax.jit`` (the slots are traced)."""
    spec = _spec(x)

    def run(q, k, v, w, b, g, pool, slots):
        return BACKEND.decode(q, k, v, w, b, g, pool, slots, spec=spec, config=INTERPRET)

    return jax.jit(run)(*x.args, x.state, jnp.asarray(slots, jnp.int32))


def _check(x, slots, o, pool, states) -> None:
    """Against the reference on the same raw indices; skipped sequences NaN, every slot no valid
    sequence names bit for bit."""
    P = x.state.shape[0]
    skipped = _skipped(slots, P)
    valid = ~skipped
    o_ref, pool_ref, states_ref = decode_reference_outputs(
        dataclasses.replace(x, state_indices=jnp.asarray(slots, jnp.int32))
    )
    o, pool, states = (np.asarray(a) for a in (o, pool, states))
    assert np.isnan(o[skipped]).all() and np.isnan(states[skipped]).all()
    assert np.isnan(np.asarray(o_ref)[skipped]).all()  # the reference agrees on what is skipped
    pool_dtype = "bfloat16" if x.state.dtype == jnp.bfloat16 else "float32"
    if valid.any():
        named = np.asarray(slots)[valid]
        assert_close("o (decode)", o[valid], np.asarray(o_ref)[valid], "float32")
        assert_close("state (decode)", pool[named], np.asarray(pool_ref)[named], pool_dtype)
        states_ref = np.asarray(states_ref)[valid]
        assert_close("token_states (decode)", states[valid], states_ref, pool_dtype)
        # the slot written back is the last token state, bit for bit
        assert pool[named].tobytes() == states[valid][:, -1].tobytes()
    kept = np.setdiff1d(np.arange(P), np.asarray(slots)[valid])
    assert pool[kept].tobytes() == np.asarray(x.state)[kept].tobytes(), "a slot not named changed"


# (N, S, HV, d, P, pool dtype, slots). HV = 16 runs two head blocks of 8 (``hb`` set: the plan
# would take all 16 heads at d = 64), one per simulated core, each a chain of N steps (the write
# buffers alternate by sequence parity); S = 3 with a bfloat16 pool runs the float32 working copy.
CASES = {
    "skips_first_between_last": (6, 2, 16, 64, 7, "float32", [-1, 3, -1, 5, 0, -1]),
    "one_valid": (3, 1, 16, 64, 5, "float32", [-1, 4, -1]),
    "all_skipped": (4, 1, 2, 64, 4, "float32", [-1, -1, -1, -1]),
    "repeated": (5, 1, 2, 64, 6, "float32", [2, 5, 2, 1, 5]),
    "out_of_range": (4, 2, 2, 64, 5, "float32", [5, 3, -7, 100]),
    "bf16_pool_repeated_and_skipped": (5, 3, 2, 64, 6, "bfloat16", [1, 1, 4, -1, 0]),
}


@pytest.fixture
def eight_heads_a_step(monkeypatch):
    """Plans take 8 heads a step where they can (two head blocks at HV = 16)."""
    plain = decode_plan.head_block

    def head_block(spec, *fits):
        return 8 if spec.heads % 8 == 0 else plain(spec, *fits)

    monkeypatch.setattr(decode_plan, "head_block", head_block)


@pytest.mark.parametrize("case", list(CASES))
def test_backend_decode_skips_and_sanitises_under_the_race_detector(
    case, races, eight_heads_a_step
):
    """Straight to the backend's ``decode`` under jit, with the race detector on two cores."""
    N, S, HV, d, P, pool, slots = CASES[case]
    x = _inputs(N, S, HV, d, P, pool, seed=len(case))
    if HV == 16:
        assert make_decode_plan(_spec(x), INTERPRET).head_blocks == 2
    _check(x, slots, *_backend_decode(x, slots))


def test_dmas_executed_when_started_give_the_same(races, eight_heads_a_step):
    """``eager`` DMAs (executed when started, not when waited on): a buffer read or written
    before its DMA is waited for would show here."""
    races("eager")
    N, S, HV, d, P, pool, slots = CASES["skips_first_between_last"]
    x = _inputs(N, S, HV, d, P, pool, seed=3)
    _check(x, slots, *_backend_decode(x, slots))


def test_the_race_detector_sees_a_repeated_slot_past_the_guard(races):
    """The detector can fail: the kernel given a repeated slot directly (past the backend's
    sanitising) races, sequence 2's read of slot 2 against sequence 0's write; the backend's
    ``decode`` with the same slots skips both and does not race."""
    x = _inputs(3, 1, 2, 64, 4, seed=5)
    plan = make_decode_plan(_spec(x), INTERPRET)
    slots = jnp.asarray([2, 1, 2], jnp.int32)
    with pytest.raises(Exception, match="RACE DETECTED"):
        sources = step_sources(slots)
        out = kernels_decode.decode_call(*x.args, None, x.state, slots, sources, plan=plan)
        jax.block_until_ready(out)
    pltpu.reset_tpu_interpret_mode_state()
    _check(x, [2, 1, 2], *_backend_decode(x, [2, 1, 2]))


def test_the_pool_is_written_only_by_the_kernels_dmas():
    """The pool's output is left in HBM (``pl.ANY``), aliased to the pool: no pipelined block is
    ever written back, so a skipped step (which starts no DMA) writes nothing whatever its VMEM
    buffers hold. The pool's input is the one pipelined block (the read)."""
    x = _inputs(3, 1, 2, 64, 4)
    spec = _spec(x)

    def run(*a):
        return BACKEND.decode(*a, spec=spec, config=INTERPRET)

    jaxpr = jax.make_jaxpr(run)(*x.args, x.state, jnp.asarray([0, -1, 2], jnp.int32))
    calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert [e.params["name"] for e in calls] == ["gdn2_decode"]
    params = calls[0].params
    mapping = params["grid_mapping"]
    [(_, pool_out)] = params["input_output_aliases"]  # the pool: (input, output) index
    out = mapping.block_mappings[mapping.num_inputs + pool_out]
    assert out.block_aval.memory_space == pl.ANY, out.block_aval
    assert tuple(out.block_aval.shape) == x.state.shape
    assert params["cost_estimate"] is not None


def test_step_sources_map_skipped_sequences_onto_a_neighbour():
    def sources(slots):
        return step_sources(jnp.asarray(slots, jnp.int32)).tolist()

    assert sources([4, 0, 2]) == [0, 1, 2]
    assert sources([-1, 3, -1, 5, -1]) == [1, 1, 1, 3, 3]  # before the first valid: the first
    assert sources([-1, -1]) == [0, 0]


def _sources_rule(slots: list[int]) -> list[int]:
    """Each step's source in plain Python: its own when valid, else the nearest valid before,
    else the first valid, else 0."""
    valid = [i for i, s in enumerate(slots) if s >= 0]
    first = valid[0] if valid else 0
    return [max((m for m in valid if m <= n), default=first) for n in range(len(slots))]


@pytest.mark.parametrize("n", [1, 2, 9, 64, PAIRWISE_MAX, PAIRWISE_MAX + 1])
def test_step_sources_follow_the_rule_on_both_paths(n):
    """The step sources (pairwise up to PAIRWISE_MAX, the cumulative max above) against the rule
    in plain Python, on the slots the core's rule leaves of indices with repeats, negatives and
    values past the pool (tests/core/test_decode.py checks that rule), and with no valid slot."""
    idx, pool_size = random_slot_indices(n)
    slots = sanitize_slots(jnp.asarray(idx, jnp.int32), n, pool_size)  # the rule: core tests
    assert step_sources(slots).tolist() == _sources_rule(slots.tolist())
    assert step_sources(jnp.full((n,), -1, jnp.int32)).tolist() == [0] * n


def test_backend_decode_refuses_slots_of_the_wrong_shape_or_type():
    x = _inputs(3, 1, 2, 64, 4)
    spec = _spec(x)
    with pytest.raises(ValueError, match=r"slots: expected shape \(N,\) = \(3,\), got \(4,\)"):
        BACKEND.decode(*x.args, x.state, jnp.zeros(4, jnp.int32), spec=spec, config=INTERPRET)
    with pytest.raises(TypeError, match="slots: expected an integer array of shape"):
        BACKEND.decode(*x.args, x.state, jnp.zeros(3), spec=spec, config=INTERPRET)
