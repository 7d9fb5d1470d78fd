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
    rel_err,
)
from gdn2_pallas_tpu.decode_plan import (
    MAX_TOKENS,
    STEP_STATE_BYTES,
    head_block,
    make_decode_plan,
    vmem_bytes,
)
from gdn2_tools.tpu import compile_decode
from gdn2core import (
    DecodeSpec,
    KernelConfig,
    gdn2_decode,
    gdn2_token_serial_reference,
    get_backend,
)

from .helpers import decode_plans

INTERPRET = KernelConfig(bt=16, interpret=True)


def _spec(N=8, S=1, HV=32, dk=128, dv=128, dtype="float32", pool="float32", states=False):
    return DecodeSpec(N, S, HV, HV // 2, HV, dk, dv, dtype, 0.1, N, pool, states, True)


def test_head_block_holds_two_mebibytes_tiles_the_token_blocks_and_keeps_two_steps():
    # d = 128: 64 KiB per head in float32: 32 heads; at N = 1 that would be 1 step: 16 heads (2
    # steps); HV = 16 at N = 1: 8 heads (2 steps)
    assert head_block(_spec()) == 32 and 32 * 128 * 128 * 4 == STEP_STATE_BYTES
    assert head_block(_spec(N=1)) == 16
    assert head_block(_spec(N=1, HV=16)) == 8
    assert head_block(_spec(N=1, dtype="bfloat16")) == 16  # bfloat16 tokens tile by 16 heads
    assert head_block(_spec(HV=64)) == 32  # at most MAX_HEADS_PER_STEP
    assert head_block(_spec(dk=256, dv=256)) == 8  # 256 KiB a head: 8 heads, 2 MiB
    assert head_block(_spec(HV=4)) == 4  # all heads (a full dimension tiles)
    assert head_block(_spec(HV=32, dk=64, dv=64)) == 32  # 16 KiB a head: all 32
    assert head_block(_spec(HV=12)) == 12  # no multiple of 8 divides 12 but itself
    # two TensorCores per device (v5p) split the head blocks: an even number of them
    assert head_block(_spec(HV=32, dk=64, dv=64), cores=2) == 16
    assert head_block(_spec(), cores=2) == 16
    assert head_block(_spec(HV=64), cores=2) == 32  # 2 blocks already
    assert head_block(_spec(HV=12), cores=2) == 12  # no smaller block tiles 12 heads


def test_plan_vmem_and_refusals():
    backend = get_backend("pallas_tpu")
    plan = make_decode_plan(_spec(), KernelConfig())
    assert plan.grid() == (1, 8) and plan.hb == 32
    assert vmem_bytes(plan)["total"] < 10 * 2**20
    # 16 float32 token states of 32 heads would need ~76 MiB: 16 heads a step on a 64 MiB chip
    # (38 MiB), 32 on a 128 MiB one (limit 112 MiB)
    states = _spec(S=16, states=True)
    assert make_decode_plan(states, KernelConfig(), 64 * 2**20).hb == 16
    assert make_decode_plan(states, KernelConfig(), 128 * 2**20).hb == 32
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


#: The fused activations of the chunked op, in two calls (tests/core/test_decode.py's): the
#: softplus gate with the L2 norm and sigmoids; the bounded gate with negative eigenvalues.
ACTIVATIONS = {
    "softplus": dict(
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_bw_sigmoid_in_kernel=True
    ),
    "lower-bound": dict(
        use_gate_in_kernel=True, lower_bound=-3.0, use_bw_sigmoid_in_kernel=True,
        allow_neg_eigval=True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("kw", list(ACTIVATIONS))
@pytest.mark.parametrize(
    "case",
    [
        DecodeCase(N=3, S=4, H=1, HV=4, dk=64, dv=64, P=6, b_max=2.0, seed=2),  # b, g: key heads
        DecodeCase(N=2, S=1, H=2, HV=16, gate_heads=16, dk=64, dv=128, P=3, seed=3),
    ],
    ids=["gates-on-key-heads-S4", "gates-on-value-heads-S1"],
)
def test_interpret_applies_the_fused_activations_in_the_kernel(monkeypatch, case, kw):
    """Raw inputs and the gate's parameters go to the kernel (the core applies nothing in XLA:
    the plan it runs carries the activations), which applies them in VMEM: o and the states
    against the token-serial reference of the chunked op (fla's activations token by token),
    float32, 1e-5 relative (the kit's decode tolerance; a missing or misplaced activation is
    O(1))."""
    plans = decode_plans(monkeypatch)
    kw = ACTIVATIONS[kw]
    x = make_decode_inputs(case)
    rng = np.random.default_rng(case.seed)
    heads = x.b.shape[2]
    params = {"A_log": jnp.asarray(rng.uniform(-1.0, 1.0, heads), jnp.float32)}
    if kw.get("lower_bound") is None:
        params["dt_bias"] = jnp.asarray(rng.normal(size=(heads, case.dk)), jnp.float32)
    o, pool = gdn2_decode(
        *x.args, x.state, state_indices=x.state_indices, config=INTERPRET, backend="pallas_tpu",
        **kw, **params,
    )  # fmt: skip
    assert [p.activations is not None and p.gate for p in plans] == [True]
    slots = np.asarray(x.state_indices)
    with jax.default_matmul_precision("highest"):
        o_ref, h_ref = gdn2_token_serial_reference(*x.args, h0=x.state[slots], **kw, **params)
    assert rel_err(o, o_ref) <= 1e-5
    assert rel_err(pool[slots], h_ref) <= 1e-5


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


def test_decode_compiles_with_the_activations_in_the_kernel():
    """The layers' activations (L2 norm, sigmoids, softplus gate) on the decode kernel: one Mosaic
    kernel, and no XLA op of the step computes an exponential or a square root (the activations
    in XLA are such fusions: ``exponential``, ``rsqrt``/``sqrt`` in their bodies)."""
    compiled = compile_decode(
        "pallas_tpu", "v5e:1x1", 8, 1, 16, 32, 128, 128, "bfloat16", "bfloat16", gate="softplus"
    )
    text = compiled.as_text()
    assert text.count('custom_call_target="tpu_custom_call"') == 1 and "gdn2_decode" in text
    for op in ("exponential(", "rsqrt(", "sqrt(", "log-plus-one("):
        assert op not in text, op


def test_decode_compiles_with_x64(x64):
    """jax_enable_x64 does not leak 64-bit integers into the index maps or the kernel."""
    compiled = compile_decode("pallas_tpu", "v5e:1x1", 2, 2, 2, 4, 128, 128, "float32")
    assert "tpu_custom_call" in compiled.as_text()
