"""On-chip memory headroom: the kernels' scoped VMEM limit is a share of the chip's VMEM, not all
of it, with the byte model below it (plan.py, decode_plan.py); the cu_seqlens chunk table's SMEM
is counted as Mosaic pads it, and a row whose table would not fit is refused by ``supports()``
by name (varlen.py). The limits are checked against the TPU compiler (deviceless, libtpu):
the limit it is given, the largest accepted packed row, and the table it refuses."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from gdn2_pallas_tpu import varlen
from gdn2_pallas_tpu.backend import PallasTpuBackend
from gdn2_pallas_tpu.decode_plan import check_decode_plan, make_decode_plan
from gdn2_pallas_tpu.decode_plan import vmem_bytes as decode_vmem_bytes
from gdn2_pallas_tpu.plan import (
    VMEM_LIMIT_SHARE,
    make_plan,
    varlen_plan,
    vmem_bytes,
    vmem_limit,
)
from gdn2_tools.tpu import compile_op, topology_mesh
from gdn2core import DEFAULT_CONFIG, LONG_CHUNKS, KernelConfig, gdn2_forward_trainable, get_backend
from gdn2core.ops.decode.spec import DecodeSpec
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.options import Activations, GateMode, OpExtras, SegmentMode
from gdn2core.verdict import judge

MIB = 2**20
#: Per-core VMEM of v5e / v6e and of v5p / v7x (pltpu.get_tpu_info()).
CAPACITIES = (128 * MIB, 64 * MIB)
GATE = Activations(qk_l2norm=True, gate=GateMode.SOFTPLUS, bw_sigmoid=True)


def _spec(B=8, T=4096, H=6, dk=128, dv=128, dtype="bfloat16", **kw) -> OpSpec:
    return OpSpec(B, T, H, dk, dv, dtype, dk**-0.5, **kw)


#: (spec, config, make_plan keywords): the train shape, the largest heads and chunks in float32,
#: packed sequences, the fused gate, cu_seqlens (varlen_plan).
PLANS = {
    "train_shape": (_spec(), DEFAULT_CONFIG, {}),
    "d256_C128_f32": (_spec(dk=256, dv=256, dtype="float32"), LONG_CHUNKS, {}),
    "segments": (_spec(), DEFAULT_CONFIG, {"segments": True}),
    "fused_gate": (_spec(activations=GATE), DEFAULT_CONFIG, {"activations": GATE}),
    "varlen": (
        _spec(B=1, T=65536, segments=SegmentMode.CU_SEQLENS, n_seqs=512), DEFAULT_CONFIG, None,
    ),
}  # fmt: skip


def _plan(name: str, capacity: int):
    spec, config, kw = PLANS[name]
    if kw is None:
        return varlen_plan(spec, config, capacity)
    return make_plan(spec, config, capacity, **kw)


def test_vmem_limit_leaves_headroom_and_the_byte_model_fits_below_it():
    """On both capacities, every plan's kernels ask for VMEM_LIMIT_SHARE (7/8) of the VMEM, not
    all of it, and their byte model fits under that limit (the plan shrinks its blocking until it
    does)."""
    for capacity in CAPACITIES:
        for name in PLANS:
            plan = _plan(name, capacity)
            limit = plan.vmem_limit_bytes
            assert limit == vmem_limit(capacity) == int(VMEM_LIMIT_SHARE * capacity), name
            assert limit <= capacity - capacity // 8, (
                f"{name}: vmem_limit_bytes: expected at most 7/8 of {capacity}, got {limit}"
            )
            for backward in (False, True):
                need = vmem_bytes(plan, backward)["total"]
                assert need <= limit, (
                    f"{name} {'backward' if backward else 'forward'}: byte model {need} > limit "
                    f"{limit} ({plan.hb} heads x {plan.nc} chunks per step)"
                )


#: Decode calls (S, pool dtype, token states) the kernel takes, small to large.
DECODE_CALLS = ((1, "float32", False), (16, "float32", True), (32, "bfloat16", True),
                (128, "bfloat16", False))  # fmt: skip


def test_decode_vmem_limit_leaves_headroom():
    """The decode kernel's limit (twice its byte model, at least 16 MiB) is capped at the same
    share of the capacity, and stays above its byte model (S = 16 float32 and S = 32 bfloat16
    with token states: 38 and 39 MiB, limits 56 MiB on a 64 MiB chip, twice the model on 128)."""
    for capacity in CAPACITIES:
        for S, pool, token_states in DECODE_CALLS:
            spec = DecodeSpec(
                n_seqs=8, tokens=S, heads=32, key_heads=32, gate_heads=32, dk=128, dv=128,
                dtype="float32", scale=128**-0.5, pool_size=8, state_dtype=pool,
                token_states=token_states, indexed=True,
            )  # fmt: skip
            assert check_decode_plan(spec, DEFAULT_CONFIG) is None  # a call the kernel takes
            plan = make_decode_plan(spec, DEFAULT_CONFIG, capacity)
            need, limit = decode_vmem_bytes(plan)["total"], plan.vmem_limit_bytes
            assert need <= limit <= capacity - capacity // 8, (
                f"S={S} {pool} token states {token_states}: byte model {need}, limit {limit}, "
                f"expected between them and at most 7/8 of {capacity}"
            )


def test_byte_model_counts_the_feature_buffers():
    """The byte model counts what the features add to a grid step: the sequence-start flags of
    packed sequences (``(nc C, 1)`` float32 padded to 128 lanes, double-buffered), the gate
    parameters (``(hb, 2, K)`` padded to 8 rows; the backward also their gradient), and the
    per-sequence state staging of cu_seqlens (the reads' buffer, the backward's spare state, and
    the writes' two buffers, state_writes.py)."""
    plain = make_plan(_spec(), DEFAULT_CONFIG, CAPACITIES[0])
    seg = make_plan(_spec(), DEFAULT_CONFIG, CAPACITIES[0], segments=True)
    gate = make_plan(_spec(activations=GATE), DEFAULT_CONFIG, CAPACITIES[0], activations=GATE)
    assert (seg.hb, seg.nc) == (gate.hb, gate.nc) == (plain.hb, plain.nc) == (6, 4)
    state = plain.hb * 128 * 128 * 4
    for backward in (False, True):
        base = vmem_bytes(plain, backward)["total"]
        assert vmem_bytes(seg, backward)["total"] - base == 2 * plain.step_len * 128 * 4
        assert (
            vmem_bytes(gate, backward)["total"] - base == (4 if backward else 2) * 6 * 8 * 128 * 4
        )
    spec = _spec(B=1, T=4096, segments=SegmentMode.CU_SEQLENS, n_seqs=16)
    var = varlen_plan(spec, DEFAULT_CONFIG, CAPACITIES[0])
    unpacked = dataclasses.replace(var, n_seqs=0)
    for backward, spare in ((False, 1 + 2), (True, 2 + 2)):
        extra = vmem_bytes(var, backward)["scratch"] - vmem_bytes(unpacked, backward)["scratch"]
        assert extra == spare * state


def _custom_call_limits(text: str) -> dict[str, int]:
    """The scoped VMEM size of each Mosaic kernel in compiled HLO text: kernel name -> bytes."""
    limits = {}
    for line in text.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        name = re.search(r'op_name="[^"]*?(gdn2_\w+)/pallas_call', line)
        size = re.search(
            r'"scoped_memory_configs":\[\{"memory_space":"1","offset":"0","size":"(\d+)"', line
        )
        assert name and size, (
            f"a tpu_custom_call without a kernel name or a VMEM size: {line[:300]}"
        )
        limits[name.group(1)] = int(size.group(1))
    return limits


@pytest.mark.tpu_compile
@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
def test_compiled_kernels_get_the_limit_not_the_whole_vmem(topology):
    """The compiled train step's two kernels carry 112 MiB of scoped VMEM (7/8 of the 128 MiB of
    v5e and v6e), not 128 MiB: the limit reaches the compiler, which compiles the kernels
    under it."""
    compiled = compile_op("pallas_tpu", topology, "train", 1, 256, 2, 64, 64, "float32",
                          DEFAULT_CONFIG)  # fmt: skip
    limits = _custom_call_limits(compiled.as_text())
    assert set(limits) == {"gdn2_fwd_train", "gdn2_bwd"}, limits
    want = vmem_limit(128 * MIB)
    assert want == 112 * MIB
    assert limits == {"gdn2_fwd_train": want, "gdn2_bwd": want}, limits


# --- the cu_seqlens chunk table in SMEM -----------------------------------------------------

#: The largest cu_seqlens row accepted at bt = 16: 4096 sequences in T tokens make a chunk-aligned
#: row of T + 4096 C = 917504 tokens, 57344 chunks: a [3, 57344] int32 table, padded to
#: [4, 57344], 917504 bytes: 7/8 of the 1 MiB of SMEM. One grid step more (128 tokens) is refused.
N_SEQS, LARGEST_T, BT = 4096, 851968, 16
STEP = 128  # tokens of a grid step at H = 2, C = 16 (8 chunks)


def _varlen_spec(T: int, n_seqs: int = N_SEQS) -> OpSpec:
    return _spec(B=1, T=T, H=2, dk=64, dv=64, segments=SegmentMode.CU_SEQLENS, n_seqs=n_seqs)


def test_chunk_table_smem_bytes_as_mosaic_pads_it():
    """3 rows padded to 4, chunks to multiples of 128 int32 words; the budget is 7/8 of 1 MiB."""
    assert varlen.table_smem_bytes(1) == varlen.table_smem_bytes(128) == 4 * 128 * 4
    assert varlen.table_smem_bytes(129) == 4 * 256 * 4
    # the pooled forward's 7 rows (pooled.ROWS) are 8 as laid out (3 -> 4 is the measured case)
    assert varlen.table_smem_bytes(128, rows=7) == 8 * 128 * 4
    assert varlen.table_smem_bytes(65536) == 2**20  # the compiler refuses it (full tier)
    assert varlen.table_smem_budget() == 917504 == varlen.table_smem_bytes(57344)
    assert varlen.table_smem_bytes(57345) > varlen.table_smem_budget()


def test_varlen_row_past_the_smem_budget_is_refused_by_name():
    """supports(): the largest row is accepted, one grid step longer refused with the sizes; the
    refusal reaches a public call (traced: the arrays are never built). 4096 sequences in
    T = 262144 tokens are accepted at every chunk length."""
    backend = get_backend("pallas_tpu")
    config = KernelConfig(bt=BT)
    plan = varlen_plan(_varlen_spec(LARGEST_T), config, CAPACITIES[0])
    assert (plan.step_len, plan.t_pad) == (STEP, LARGEST_T + N_SEQS * BT)
    assert backend.supports(_varlen_spec(LARGEST_T), config)
    refused = backend.supports(_varlen_spec(LARGEST_T + STEP), config)
    assert not refused
    assert refused.reason == (
        f"cu_seqlens: 4096 sequences in T={LARGEST_T + STEP} tokens make a row of 57352 chunks "
        "of bt=16 (each sequence padded to whole chunks), whose chunk table needs 919552 bytes "
        "of SMEM, more than the 917504 available (87.5% of the 1048576 bytes of SMEM per core: "
        "at most 57344 chunks); use a larger bt or fewer tokens per call"
    )
    assert not judge(backend, _varlen_spec(LARGEST_T + STEP), config, trainable=True,
                     auto=True, platform="tpu")  # fmt: skip
    for bt in (16, 32, 64, 128):
        assert backend.supports(_varlen_spec(262144), KernelConfig(bt=bt)), bt

    T = LARGEST_T + STEP
    x = jax.ShapeDtypeStruct((1, T, 2, 64), jnp.bfloat16)
    h0 = jax.ShapeDtypeStruct((N_SEQS, 2, 64, 64), jnp.float32)
    cu = jax.ShapeDtypeStruct((N_SEQS + 1,), jnp.int32)

    def call(q, k, v, w, b, g, h0, cu):
        return gdn2_forward_trainable(q, k, v, w, b, g, h0=h0, cu_seqlens=cu,
                                      config=KernelConfig(bt=BT, interpret=True),
                                      backend="pallas_tpu")  # fmt: skip

    with pytest.raises(Exception, match=r"cu_seqlens: 4096 sequences .* 919552 bytes of SMEM"):
        jax.jit(call).trace(x, x, x, x, x, x, h0, cu)


def _tpu_specs(topology: str, T: int):
    sharding = NamedSharding(topology_mesh(topology), PartitionSpec())
    x = jax.ShapeDtypeStruct((1, T, 2, 64), jnp.bfloat16, sharding=sharding)
    h0 = jax.ShapeDtypeStruct((N_SEQS, 2, 64, 64), jnp.float32, sharding=sharding)
    cu = jax.ShapeDtypeStruct((N_SEQS + 1,), jnp.int32, sharding=sharding)
    return x, h0, cu


@pytest.mark.tpu_compile
@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
def test_largest_accepted_varlen_row_compiles(topology):
    """The train step (training forward and backward kernels) of the largest accepted row, 4096
    sequences, compiles deviceless to Mosaic: the table and the compiler's own SMEM fit."""
    x, h0, cu = _tpu_specs(topology, LARGEST_T)

    def step(q, k, v, w, b, g, h0, cu):
        def loss(*args):
            o, h = gdn2_forward_trainable(*args[:6], h0=args[6], cu_seqlens=cu,
                                          config=KernelConfig(bt=BT), backend="pallas_tpu")  # fmt: skip
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(h)

        return jax.grad(loss, argnums=tuple(range(7)))(q, k, v, w, b, g, h0)

    lowered = jax.jit(step).trace(x, x, x, x, x, x, h0, cu).lower(lowering_platforms=("tpu",))
    text = lowered.compile().as_text()
    assert "tpu_custom_call" in text and "gdn2_fwd_train" in text and "gdn2_bwd" in text


@pytest.mark.tpu_compile
def test_the_compiler_refuses_the_table_the_model_puts_at_the_whole_smem():
    """The byte count is the compiler's: a [3, 65536] table (768 KiB unpadded, 1 MiB as
    table_smem_bytes counts it) does not fit in v5e's SMEM. Called on the backend directly, past
    supports(), which refuses it."""
    T = 2**20 - N_SEQS * BT  # a row of 2^20 tokens, 65536 chunks
    spec = _varlen_spec(T)
    assert (
        varlen.table_smem_bytes(varlen_plan(spec, KernelConfig(bt=BT), CAPACITIES[0]).t_pad // BT)
        == 2**20
    )
    assert not PallasTpuBackend().supports(spec, KernelConfig(bt=BT))
    x, h0, cu = _tpu_specs("v5e:1x1", T)

    def forward(q, k, v, w, b, g, h0, cu):
        return PallasTpuBackend().forward(q, k, v, w, b, g, h0, spec=spec,
                                          config=KernelConfig(bt=BT),
                                          extras=OpExtras(cu_seqlens=cu))  # fmt: skip

    lowered = jax.jit(forward).trace(x, x, x, x, x, x, h0, cu).lower(lowering_platforms=("tpu",))
    with pytest.raises(Exception, match="(?i)smem"):
        lowered.compile()
