"""Deviceless TPU compilation: the kernels lower through Mosaic for v5e/v6e and the train step's
compiled scratch HBM stays within budget. Compile-time analysis only (no TPU run)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from gdn2_pallas_tpu import cost
from gdn2_tools.tpu import compile_op
from gdn2core import DEFAULT_CONFIG, PRESETS

#: The train shape of the memory target (B, T, H) and its budget of compiled scratch HBM.
B, T, H = 8, 4096, 6
TEMP_LIMIT_BYTES = 256 * 2**20
#: The kernels through the public ops, compiled deviceless (gdn2-tools).
compile_for_tpu = functools.partial(compile_op, "pallas_tpu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_train_step_compiles_for_v5e_within_memory_budget(dtype):
    compiled = compile_for_tpu("v5e:1x1", "train", B, T, H, 128, 128, dtype, DEFAULT_CONFIG)
    text = compiled.as_text()
    assert "tpu_custom_call" in text
    assert "gdn2_fwd_train" in text and "gdn2_bwd" in text
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= TEMP_LIMIT_BYTES, f"temp {temp / 2**20:.1f} MiB > 256 MiB"


@pytest.mark.parametrize(
    ("value_heads", "dtype", "nc", "residual_mib", "within_target"),
    [
        (0, "bfloat16", 2, 191.5, True),
        (32, "bfloat16", 2, 319, False),
        pytest.param(0, "float32", 2, 383, False,
                     marks=[pytest.mark.slow, pytest.mark.tpu_compile]),
    ],
    ids=["H16", "H16-HV32", "H16-float32"],
)  # fmt: skip
def test_long_context_train_step_memory_is_its_residuals(
    value_heads, dtype, nc, residual_mib, within_target
):
    """B=1 T=32768 H=16 d=128 on v5e: the temp HBM is the residuals and little else. With 16
    heads in bfloat16, 2 chunks a step in training (the cap on the backward's program, plan.py
    "Training steps", over the floor of 4 that kept the states as small as the chunk matrices):
    the state entering each of the 256 grid steps of 2 head groups but the first (h0, not saved;
    127.5 MiB in bfloat16) and the packed ``T`` | ``A_qk`` (64 MiB), within the 256 MiB target.
    float32 inputs and 32 value heads (b, g on the key heads: 16 heads of ``2 x 128`` value
    channels) take 2 chunks a step too, their backward looping over 2 iterations of 4 heads (the
    cap leaves one chunk to an unlooped step): float32 saves 255 states and ``T`` | ``A_qk`` in
    float32 (255 + 128 MiB), 32 value heads 255 states twice as wide (255 + 64 MiB): both over the
    target (at 1 chunk a step, 639 and 575 MiB; docs/results.md, "A sixth run"). The cotangent
    arrives in o's dtype, as a model's does, so no converted copy of it sits beside them. What
    the compiled step adds to the residuals is XLA's scratch for the loss's reductions, within the
    4 MiB allowed."""
    from gdn2_pallas_tpu.plan import make_plan
    from gdn2core.ops.forward.spec import OpSpec

    dv = 128 * max(1, value_heads // 16)  # the kernels' value width
    spec = OpSpec(1, 32768, 16, 128, dv, dtype, 1.0)
    plan = make_plan(spec, DEFAULT_CONFIG, 128 * 2**20, training=True)
    assert (plan.hb, plan.nc) == (8, nc)
    residuals = cost.residual_bytes(plan)
    assert residuals == residual_mib * 2**20
    compiled = compile_for_tpu("v5e:1x1", "train", 1, 32768, 16, 128, 128, dtype,
                               DEFAULT_CONFIG, value_heads=value_heads)  # fmt: skip
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= residuals + 4 * 2**20, f"temp {temp / 2**20:.1f} MiB"
    assert (temp <= TEMP_LIMIT_BYTES) == within_target, f"temp {temp / 2**20:.1f} MiB"


@pytest.mark.parametrize(("topology", "hb"), [("v5e:1x1", 6), ("v5p:1x1x1", 3)])
def test_plans_give_both_tensor_cores_of_a_device_work(monkeypatch, topology, hb):
    """B=1 H=6: on v5e (one TensorCore) all 6 heads a step; on v5p (two TensorCores per device,
    which split the "parallel" grid points) 3, so that the grid has two head groups, one per core.
    The backend reads the cores from the sharding of the traced inputs (the deviceless compile's
    topology), as it reads the VMEM; the forward and the train step's plans both follow."""
    from gdn2_pallas_tpu import backend

    plans = []

    def spy(*args, **kwargs):
        plans.append(make_plan(*args, **kwargs))
        return plans[-1]

    make_plan = backend.make_plan
    monkeypatch.setattr(backend, "make_plan", spy)
    for mode in ("forward", "train"):
        compiled = compile_for_tpu(topology, mode, 1, 2048, 6, 128, 128, "bfloat16", DEFAULT_CONFIG)
        assert "tpu_custom_call" in compiled.as_text()
    assert [(p.hb, p.grid()[:2]) for p in plans] == [(hb, (1, 6 // hb))] * 2


@pytest.mark.parametrize(("topology", "depth", "nc"), [("v5e:1x1", 128, 4), ("v6e:1x1", 256, 8)])
def test_plans_take_the_mxu_depth_of_the_target(topology, depth, nc):
    """A plan's ``mxu_depth`` is the target chip's (``TpuInfo.mxu_column_size``, read like the
    VMEM and the TensorCores): float32 products at most half as deep take two MXU passes
    (matmul.py), 64-deep ones on v5e, 128-deep ones too on v6e; and a grid step takes twice the
    rows on v6e (plan.max_step_rows): 8 chunks of 6 heads, 4 on v5e."""
    import jax
    from jax.experimental import topologies

    from gdn2_pallas_tpu.plan import make_plan
    from gdn2core.ops.forward.spec import OpSpec

    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    with jax.sharding.use_abstract_mesh(jax.sharding.Mesh(devices, ("x",)).abstract_mesh):
        plan = make_plan(OpSpec(1, 1024, 6, 128, 128, "float32", 1.0), DEFAULT_CONFIG)
    assert (plan.mxu_depth, plan.hb, plan.nc) == (depth, 6, nc)
    off_tpu = make_plan(OpSpec(1, 1024, 6, 128, 128, "float32", 1.0), DEFAULT_CONFIG)
    assert (off_tpu.mxu_depth, off_tpu.nc) == (128, 4)  # matmul.DEFAULT_MXU_DEPTH: chip unknown


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_eight_heads_token_major_compile_in_place(dtype):
    """H = 8: the kernels read the public (B, T, H, d) arrays in (nc C, 8, d) blocks, 8 heads x 4
    chunks per step at C = 32 (a divisor of the 128 chunks, so no padding), four units side by side
    in the lanes of a saved residual. Neither step copies an input: the inference forward needs
    no scratch HBM, the train step only its residuals and o (the 256 MiB budget is for H = 6).
    The float32 case (the same blocks, 3 minutes of compiling) is a long sweep."""
    from gdn2_pallas_tpu.plan import Layout, make_plan
    from gdn2core import SHORT_CHUNKS
    from gdn2core.ops.forward.spec import OpSpec

    plan = make_plan(OpSpec(B, T, 8, 128, 128, dtype, 1.0), SHORT_CHUNKS)
    assert (plan.layout, plan.hb, plan.nc, plan.lane_pack) == (Layout.TOKEN_MAJOR, 8, 4, 4)
    fwd = compile_for_tpu("v5e:1x1", "forward", B, T, 8, 128, 128, dtype, SHORT_CHUNKS)
    assert "tpu_custom_call" in fwd.as_text()
    assert fwd.memory_analysis().temp_size_in_bytes == 0
    train = compile_for_tpu("v5e:1x1", "train", B, T, 8, 128, 128, dtype, SHORT_CHUNKS)
    assert "gdn2_bwd" in train.as_text()
    itemsize = 4 if dtype == "float32" else 2
    o_bytes = B * T * 8 * 128 * itemsize
    residuals = cost.residual_bytes(plan)
    assert train.memory_analysis().temp_size_in_bytes <= o_bytes + residuals + 2**20


@pytest.mark.parametrize(("dtype", "steps"), [("float32", 32), ("bfloat16", 32)])
def test_train_step_saves_the_step_states_in_the_inputs_dtype(dtype, steps):
    """The training forward saves the state entering every grid step but the first (h0) for the
    backward: in bfloat16 for bfloat16 inputs (half the bytes of the longest-lived residual at
    long context), in float32 for float32 inputs (B1 T4096 H16 d128 on v5e: the training plan's
    8 heads x 2 chunks of 64 tokens a step, 32 steps, 31 states saved; in float32 the backward
    loops over the step's heads, 2 iterations of 4, since the bound on its program allows an
    unlooped step 1 chunk). The same array is the backward kernel's operand."""
    from gdn2_pallas_tpu.plan import make_plan
    from gdn2core.ops.forward.spec import OpSpec

    spec = OpSpec(1, 4096, 16, 128, 128, dtype, 1.0)
    plan = make_plan(spec, DEFAULT_CONFIG, 128 * 2**20, training=True)
    assert jnp.dtype(plan.saved_state_dtype).name == dtype
    compiled = compile_for_tpu("v5e:1x1", "train", 1, 4096, 16, 128, 128, dtype, DEFAULT_CONFIG)
    text = compiled.as_text()
    states = f"[1,{plan.head_groups},{plan.saved_states},{plan.hb},128,128]"
    kept, other = ("bf16", "f32") if dtype == "bfloat16" else ("f32", "bf16")
    assert (plan.head_groups, plan.n_steps, plan.saved_states, plan.hb) == (2, steps, steps - 1, 8)
    assert kept + states in text and other + states not in text


def test_x64_enabled_compiles_for_v5e(x64):
    """jax_enable_x64 does not leak 64-bit integers into the index maps or the kernels."""
    compiled = compile_for_tpu("v5e:1x1", "train", 1, 256, 2, 64, 64, "float32", DEFAULT_CONFIG)
    assert "tpu_custom_call" in compiled.as_text()


def test_forward_compiles_for_v6e_dk_ne_dv():
    compiled = compile_for_tpu("v6e:1x1", "forward", B, T, H, 128, 256, "bfloat16", DEFAULT_CONFIG)
    assert "tpu_custom_call" in compiled.as_text()


def test_vmapped_train_step_compiles_for_v5e():
    """vmap over an extra leading axis folds it into the batch axis and lowers to the Mosaic
    kernels (vjp.py); the conformance kit runs the same in interpret mode."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from gdn2_tools.tpu import topology_mesh
    from gdn2core import gdn2_forward_trainable

    sharding = NamedSharding(topology_mesh("v5e:1x1"), PartitionSpec())
    spec = jax.ShapeDtypeStruct((3, 1, 128, 2, 128), jnp.float32, sharding=sharding)
    h0 = jax.ShapeDtypeStruct((3, 1, 2, 128, 128), jnp.float32, sharding=sharding)

    def loss(q, k, v, w, b, g, h0):
        def run(*a):
            return gdn2_forward_trainable(*a[:6], h0=a[6], backend="pallas_tpu")

        o, h = jax.vmap(run)(q, k, v, w, b, g, h0)
        return jnp.sum(o) + jnp.sum(h)

    step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7))))
    text = step.trace(*[spec] * 6, h0).lower(lowering_platforms=("tpu",)).compile().as_text()
    assert "tpu_custom_call" in text and "gdn2_bwd" in text


#: Every chip x mode x head size x dtype x preset (72 compiles, `make test-slow`). CI's subset
#: (marker ``tpu_compile``, `make test-tpu-compile`): on v5e every mode, head size and dtype at the
#: default preset and the other presets (they change the chunk size and the chunks a step) at
#: d = 128; on v6e every mode and dtype at d = 128 and the default preset: 24 compiles.
MATRIX = [
    pytest.param(
        topo,
        mode,
        dk,
        dv,
        dtype,
        preset,
        marks=[pytest.mark.tpu_compile]
        if (topo == "v5e:1x1" and (preset == "DEFAULT_CONFIG" or dk == dv == 128))
        or (preset == "DEFAULT_CONFIG" and dk == dv == 128)
        else [],
    )
    for topo in ("v5e:1x1", "v6e:1x1")
    for mode in ("forward", "train")
    for dk, dv in ((128, 128), (64, 64), (128, 256))
    for dtype in ("float32", "bfloat16")
    for preset in PRESETS
]


@pytest.mark.slow
@pytest.mark.parametrize(("topo", "mode", "dk", "dv", "dtype", "preset"), MATRIX)
def test_compile_matrix(topo, mode, dk, dv, dtype, preset):
    compiled = compile_for_tpu(topo, mode, B, T, H, dk, dv, dtype, PRESETS[preset])
    assert "tpu_custom_call" in compiled.as_text()
    if mode == "train" and dk == dv == 128 and topo.startswith("v5e"):
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp <= TEMP_LIMIT_BYTES, f"temp {temp / 2**20:.1f} MiB > 256 MiB"
