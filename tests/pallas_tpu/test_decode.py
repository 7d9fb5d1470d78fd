"""The pallas_tpu decode kernel: its plan, the block each grid step maps, interpret-mode runs
against the decode reference (beyond the conformance kit's cases: several head blocks, a larger
pool, speculative lengths), and deviceless compiles for v5e and v6e (compile-time analysis)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_conformance import (
    DecodeCase,
    assert_close,
    decode_reference_outputs,
    make_decode_inputs,
)
from gdn2_pallas_tpu.decode_plan import (
    MAX_TOKENS,
    STEP_STATE_BYTES,
    head_block,
    make_decode_plan,
    vmem_bytes,
)
from gdn2_tools.tpu import compile_decode
from gdn2core import DecodeSpec, KernelConfig, gdn2_decode, get_backend

INTERPRET = KernelConfig(bt=16, interpret=True)


def _spec(N=8, S=1, HV=32, dk=128, dv=128, dtype="float32", pool="float32", states=False):
    return DecodeSpec(N, S, HV, HV // 2, HV, dk, dv, dtype, 0.1, N, pool, states, True)


def test_head_block_holds_a_mebibyte_tiles_the_token_blocks_and_keeps_two_steps():
    # d = 128: 64 KiB per head in float32: 16 heads (2 steps at N = 1); HV = 16 at N = 1 would be
    # 1 step: 8 heads (2 steps)
    assert head_block(_spec()) == 16 and 16 * 128 * 128 * 4 == STEP_STATE_BYTES
    assert head_block(_spec(N=1)) == 16
    assert head_block(_spec(N=1, HV=16)) == 8
    assert head_block(_spec(N=1, dtype="bfloat16")) == 16  # bfloat16 tokens tile by 16 heads
    assert head_block(_spec(HV=4)) == 4  # all heads (a full dimension tiles)
    assert head_block(_spec(HV=32, dk=64, dv=64)) == 32  # 16 KiB a head: all 32
    assert head_block(_spec(HV=12)) == 12  # no multiple of 8 divides 12 but itself


def test_plan_vmem_and_refusals():
    backend = get_backend("pallas_tpu")
    plan = make_decode_plan(_spec(), KernelConfig())
    assert plan.grid() == (2, 8) and plan.hb == 16
    assert vmem_bytes(plan)["total"] < 6 * 2**20
    assert backend.supports_decode(_spec(), KernelConfig())
    too_long = backend.supports_decode(_spec(S=MAX_TOKENS + 1), KernelConfig())
    assert not too_long and "at most 128" in too_long.reason
    odd = backend.supports_decode(_spec(dk=96), KernelConfig())
    assert not odd and "dk=96" in odd.reason


def _check(x, dtype="float32"):
    o, pool, states = gdn2_decode(
        *x.args, x.state, state_indices=x.state_indices, return_token_states=True,
        config=INTERPRET, backend="pallas_tpu",
    )  # fmt: skip
    o_ref, pool_ref, states_ref = decode_reference_outputs(x)
    state_dtype = "bfloat16" if x.state.dtype == jnp.bfloat16 else dtype
    assert_close("o (decode)", o, o_ref, dtype)
    assert_close("state (decode)", pool, pool_ref, state_dtype)
    assert_close("token_states (decode)", states, states_ref, state_dtype)
    return o, pool


# (N, S, H, HV, dk, dv, P, input dtype, pool dtype). HV = 16 at d = 64 runs one 16-head step per
# sequence; HV = 16 at d = 128 and N = 1 two 8-head steps; S = 17 runs the token loop across a
# chunk.
CASES = {
    "N4_S1_HV16_d64_P9": (4, 1, 4, 16, 64, 64, 9, "float32", "float32"),
    "N1_S3_HV16_d128_two_head_blocks": (1, 3, 8, 16, 128, 128, 5, "float32", "float32"),
    "N1_S17_speculative": (1, 17, 1, 2, 64, 128, 3, "float32", "float32"),
    "N3_S2_bf16_pool": (3, 2, 2, 4, 128, 64, 6, "float32", "bfloat16"),
    "N2_S1_bf16_inputs_bf16_pool": (2, 1, 8, 16, 64, 64, 2, "bfloat16", "bfloat16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_interpret_matches_reference(case):
    N, S, H, HV, dk, dv, P, dtype, pool = CASES[case]
    x = make_decode_inputs(
        DecodeCase(N=N, S=S, H=H, HV=HV, dk=dk, dv=dv, P=P, seed=7), jnp.dtype(dtype), pool
    )
    _, new_pool = _check(x, dtype)
    slots = np.asarray(x.state_indices)
    others = np.setdiff1d(np.arange(P), slots)
    assert np.asarray(new_pool)[others].tobytes() == np.asarray(x.state)[others].tobytes()


def test_interpret_skipped_sequences_before_the_first_valid_one():
    """Skipped sequences before, between and after valid ones (the leading ones revisit the first
    valid slot's block before it is updated, the others after)."""
    case = DecodeCase(N=6, S=2, H=1, HV=2, dk=64, dv=64, P=7, seed=8)
    x = make_decode_inputs(case)
    x = dataclasses.replace(x, state_indices=jnp.asarray([-1, 3, 9, 4, 4, 1], jnp.int32))

    def run(*a):
        return gdn2_decode(
            *a[:7], state_indices=a[7], config=INTERPRET, backend="pallas_tpu"
        )  # fmt: skip

    o, pool = jax.jit(run)(*x.args, x.state, x.state_indices)
    assert np.isnan(np.asarray(o)[[0, 2, 3, 4]]).all()
    for seq, slot in ((1, 3), (5, 1)):
        one = DecodeCase(N=1, S=2, H=1, HV=2, dk=64, dv=64, P=7, seed=8)
        y = dataclasses.replace(
            make_decode_inputs(one), state=x.state,
            **{n: getattr(x, n)[seq : seq + 1] for n in ("q", "k", "v", "w", "b", "g")},
            state_indices=jnp.asarray([slot], jnp.int32),
        )  # fmt: skip
        o_ref, pool_ref, _ = decode_reference_outputs(y)
        assert_close("o (decode)", o[seq : seq + 1], o_ref, "float32")
        assert_close("state (decode)", pool[slot], pool_ref[slot], "float32")
    kept = [0, 2, 4, 5, 6]
    assert np.asarray(pool)[kept].tobytes() == np.asarray(x.state)[kept].tobytes()


# --------------------------------------------------------------------------- deviceless compile


@pytest.mark.parametrize(
    ("topology", "dtype", "pool", "states"),
    [
        ("v5e:1x1", "float32", "float32", False),
        ("v5e:1x1", "bfloat16", "bfloat16", True),
        ("v6e:1x1", "float32", "float32", False),
        ("v6e:1x1", "bfloat16", "float32", False),
        ("v6e:1x1", "bfloat16", "bfloat16", True),  # the one-pass read of a bf16 block (S > 1)
    ],
)
def test_decode_compiles_in_place(topology, dtype, pool, states):
    """N = 8 sequences, H = 16, HV = 32, d = 128, the pool donated: Mosaic kernel, and no copy of
    the 16 MiB pool (the compiled scratch is far below it)."""
    compiled = compile_decode(
        "pallas_tpu", topology, 8, 4 if states else 1, 16, 32, 128, 128, dtype, pool,
        pool_size=24, token_states=states,
    )  # fmt: skip
    text = compiled.as_text()
    assert "tpu_custom_call" in text and "gdn2_decode" in text
    pool_bytes = 24 * 32 * 128 * 128 * jnp.dtype(pool).itemsize
    assert compiled.memory_analysis().temp_size_in_bytes < pool_bytes // 8


def test_decode_compiles_with_x64(x64):
    """jax_enable_x64 does not leak 64-bit integers into the index maps or the kernel."""
    compiled = compile_decode("pallas_tpu", "v5e:1x1", 2, 2, 2, 4, 128, 128, "float32")
    assert "tpu_custom_call" in compiled.as_text()
