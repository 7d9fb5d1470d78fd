"""A float32 ``g`` beside bfloat16 inputs on pallas_tpu (``Plan.float32_decay``): the kernels read
g in float32 (a full g's blocks hold float32; a scalar g is float32 in the kernels anyway) and
write dg in float32, in both token layouts.

Interpret mode: the conformance kit's decay case (gdn2_conformance.decay_suite: rounding g to
bfloat16 moves o by ~10%) with 8 token-major heads, full and scalar g, and the kit's bfloat16
gradients case there (bounds: the kit's bfloat16 ones, 3e-2 on outputs, 6e-2 on gradients: both
sides use the same bf16 values). A deviceless v5e compile of the train step in both layouts: the
kernels take g and return dg as float32 arrays of g's size; the decode kernel takes it as float32
too (its serving tests: the kit's decode and ragged decay cases). The VMEM models count g's bytes.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import gdn2core
from gdn2_conformance.decay_suite import check_decay_case, check_gradients, decay_inputs
from gdn2_conformance.target import Target
from gdn2_pallas_tpu.plan import F32_BYTES, make_plan, vmem_bytes
from gdn2_tools.tpu import compile_decode, compile_for_tpu, topology_mesh
from gdn2core import KernelConfig, OpSpec

TARGET = Target("pallas_tpu", KernelConfig(bt=16, interpret=True), head_sizes=((64, 64),))
H = 8  # token-major blocks (the conformance targets run H = 2, head-major)


@pytest.mark.parametrize("scalar", [False, True], ids=["full-g", "scalar-g"])
def test_decay_case_token_major(scalar):
    """o and h_final within the bfloat16 bound of the reference on the float32 g, where the
    reference on g rounded to bfloat16 is off by more than twice that bound."""
    x = decay_inputs(TARGET, H)
    if scalar:
        x = dataclasses.replace(x, g=x.g[..., 0])  # [B, T, H]: GDN's decay
    check_decay_case(TARGET, x, "scalar g" if scalar else "g")


def test_gradients_token_major():
    """The seven gradients against the reference; dg float32 (the kernel's token-major output
    block of g's dtype), the others bfloat16."""
    check_gradients(TARGET, H, seed=43)


def test_vmem_model_counts_a_float32_g():
    """The byte model of a grid step grows by the float32 g's extra 2 bytes per channel: twice
    (double-buffered) in the forward; in the backward also dg's staging."""
    spec = OpSpec(1, 4096, 8, 128, 128, "bfloat16", 1.0)
    plain = make_plan(spec, KernelConfig(), 128 * 2**20)
    wide = make_plan(dataclasses.replace(spec, float32_decay=True), KernelConfig(), 128 * 2**20)
    assert (wide.hb, wide.nc) == (plain.hb, plain.nc)
    extra = plain.hb * plain.step_len * plain.dk * (F32_BYTES - 2)
    for backward, copies in ((False, 2), (True, 3)):
        grew = vmem_bytes(wide, backward)["blocks"] - vmem_bytes(plain, backward)["blocks"]
        assert grew == copies * extra, (backward, grew, extra)


def _f32_arrays_of(text: str, shape: tuple[int, ...]) -> int:
    """How many float32 array types in ``text`` have the axes of ``shape`` in some order (g's in
    either token layout)."""
    dims = re.findall(r"f32\[([\d,]+)\]", text)
    return sum(1 for d in dims if sorted(int(n) for n in d.split(",")) == sorted(shape))


@pytest.mark.tpu_compile
@pytest.mark.parametrize("heads", [8, 4], ids=["token-major", "head-major"])
def test_train_step_compiles_with_float32_g_on_v5e(heads):
    """Deviceless v5e compile of a bf16 train step with a float32 g ``(1, 256, heads, 128)``: both
    Mosaic kernels run; the forward and backward take a float32 operand of g's size (g) and the
    backward returns one (dg); before, the core cast g to bfloat16."""
    sharding = NamedSharding(topology_mesh("v5e:1x1"), PartitionSpec())
    T, D = 256, 128
    bf = jax.ShapeDtypeStruct((1, T, heads, D), jnp.bfloat16, sharding=sharding)
    f32 = jax.ShapeDtypeStruct((1, T, heads, D), jnp.float32, sharding=sharding)
    hlo = compile_for_tpu(_train_step, bf, bf, bf, bf, bf, f32, bf).as_text()
    fwd, bwd = _kernels(hlo)
    shape = (1, T, heads, D)

    def operands(kernel: str) -> str:  # the operand types the kernel was compiled for
        return kernel.split("operand_layout_constraints={")[1].split("}}")[0]

    # g (head-major tiles: the array once per head of a step, each reading its own head)
    assert _f32_arrays_of(operands(fwd), shape) == (1 if heads == 8 else heads), operands(fwd)
    assert _f32_arrays_of(operands(bwd), shape) == (1 if heads == 8 else heads), operands(bwd)
    assert _f32_arrays_of(bwd.split(" custom-call(")[0], shape) == 1, bwd[:400]  # dg


@pytest.mark.tpu_compile
@pytest.mark.parametrize("heads", [8, 3], ids=["token-major", "head-major"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_scalar_float32_g_compiles_on_v5e(heads, dtype):
    """GDN's scalar gates with a float32 g (bf16 inputs; and float32 inputs, whose scalar gates
    take the same exact three-part broadcast, blocks.load_scalar): Mosaic compiles both kernels
    (the parts' concatenation on the sublanes, 8 or 3 heads a step)."""
    sharding = NamedSharding(topology_mesh("v5e:1x1"), PartitionSpec())
    T, D = 256, 128
    x = jax.ShapeDtypeStruct((1, T, heads, D), dtype, sharding=sharding)
    beta = jax.ShapeDtypeStruct((1, T, heads), dtype, sharding=sharding)
    g = jax.ShapeDtypeStruct((1, T, heads), jnp.float32, sharding=sharding)
    _kernels(compile_for_tpu(_train_step, x, x, x, beta, beta, g, x).as_text())


@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
def test_decode_compiles_with_float32_g(topology):
    """The decode kernel, bfloat16 tokens and a float32 g (N = 8, S = 4, 16 key heads, 32 value
    heads, d = 128, a bfloat16 pool): Mosaic compiles it, and its g operand is float32 (on the 16
    key heads, which the kernel reads grouped: ``(8, 4, 16, 128)``); before, the core rounded g."""
    text = compile_decode(
        "pallas_tpu", topology, 8, 4, 16, 32, 128, 128, "bfloat16", "bfloat16",
        pool_size=24, decay_dtype="float32",
    ).as_text()  # fmt: skip
    (kernel,) = [line for line in text.splitlines() if "tpu_custom_call" in line]
    assert "gdn2_decode" in kernel
    operands = kernel.split("operand_layout_constraints={")[1].split("}}")[0]
    assert _f32_arrays_of(operands, (8, 4, 16, 128)) == 1, operands


def _train_step(q, k, v, w, b, g, do):
    def loss(*a):
        o = gdn2core.gdn2_forward_trainable(*a, backend="pallas_tpu")[0]
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    return jax.grad(loss, argnums=tuple(range(6)))(q, k, v, w, b, g)


def _kernels(hlo: str) -> tuple[str, str]:
    """The forward and the backward Mosaic kernel of a compiled train step."""
    kernels = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert len(kernels) == 2, kernels
    fwd, bwd = sorted(kernels, key=lambda line: "gdn2_bwd" in line)
    return fwd, bwd
