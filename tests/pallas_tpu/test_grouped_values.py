"""Grouped values on pallas_tpu: grouped value heads with b, g on the key heads, v, w, o (and dO,
dv, dw) read and written by the kernels in the caller's ``(B, T, HV, dv)`` layout, each kernel
head's ``G`` value heads joined in its lanes in VMEM (no relayout to ``(B, T, H, G dv)`` in XLA).

Interpret mode against the token-serial reference (which runs each value head on its own, fla's
convention): forward and all gradients, full and scalar gates, a padded last step, packed
sequences and fused activations, the forward with chunk states, and the calls the kernels cannot
read grouped (``dv`` = 64, head-major blocking), which keep the core's view. A spy on the forward
kernel checks which of the two ran. A deviceless v5e compile at H = 16, HV = 32: the kernels'
operands and results are the caller's value arrays and the program has no ``(B, T, H, G dv)``
array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import gdn2core
from gdn2_pallas_tpu import vjp
from gdn2_tools.tpu import compile_for_tpu, topology_mesh

from .gate_cases import (
    assert_chunk_states_match_reference,
    assert_train_matches_reference,
    gate_inputs,
    gate_keywords,
)

#: name: (H, HV, dv, T, scalar gates, keywords, value_groups of the plan, v's kernel shape).
CASES = {
    "gdn2-G2": (8, 16, 128, 32, (), {}, 2, (1, 32, 16, 128)),
    "G2-padded-segments-activations": (8, 16, 128, 40, (),
                                       {"segment_ids": True, "use_qk_l2norm_in_kernel": True,
                                        "use_gate_in_kernel": True}, 2, (1, 48, 16, 128)),
    "G2-scalar-gates": (8, 16, 128, 32, ("w", "b", "g"), {}, 2, (1, 32, 16, 128)),
    # 12 chunks of 16: the inference plan takes 6 a step; training, 3 (the floor of 8, nc C >= the
    # kernels' dv of 256, gives way to the bound on the backward's program: float32 inputs with
    # 256-wide units, plan.py "Training steps"), 4 steps of its own blocking
    "G2-training-steps-of-their-own": (8, 16, 128, 192, (), {}, 2, (1, 192, 16, 128)),
    "dv64-view": (8, 16, 64, 32, (), {}, 1, (1, 32, 8, 128)),
    "head-major-view": (2, 4, 128, 24, (), {}, 1, (1, 2, 32, 256)),
}  # fmt: skip


@pytest.fixture
def kernel_calls(monkeypatch):
    """``(plan.value_groups, v's kernel shape)`` of every forward kernel traced."""
    seen, original = [], vjp.forward_call

    def spy(q, k, v, *args, plan, **kw):
        seen.append((plan.value_groups, v.shape))
        return original(q, k, v, *args, plan=plan, **kw)

    monkeypatch.setattr(vjp, "forward_call", spy)
    return seen


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_values_match_the_reference(case, kernel_calls):
    H, HV, dv, T, scalar, options, groups, v_shape = CASES[case]
    args, h0, do, dh = gate_inputs(H, HV, T, scalar, len(case), dv=dv)
    assert_train_matches_reference(args, h0, do, dh, gate_keywords(options, H, T))
    assert kernel_calls == [(groups, v_shape)]  # grouped: the kernel got the caller's v


def test_chunk_states_with_grouped_values(kernel_calls):
    """The forward with chunk states reads the values grouped too: every chunk's entry state is
    the reference's state after that prefix."""
    args, h0, _, _ = gate_inputs(8, 16, 48, (), 9, dv=128)
    assert_chunk_states_match_reference(args, h0, (1, 2))
    assert kernel_calls == [(2, (1, 48, 16, 128))]


@pytest.mark.tpu_compile
def test_grouped_values_train_step_compiles_without_relayout_on_v5e():
    """Deviceless v5e compile of a bf16 GDN-2 train step with 16 key heads and 32 value heads (b,
    g on the key heads, T = 256): both Mosaic kernels take v and w as the caller's
    ``(1, 256, 32, 128)`` arrays, the forward returns o and the backward dv, dw in that shape,
    and no array of the core's ``(1, 256, 16, 256)`` view is left in the program (before: a
    relayout copy of v, w, o, dO, dv and dw each)."""
    sharding = NamedSharding(topology_mesh("v5e:1x1"), PartitionSpec())
    T, H, HV, D = 256, 16, 32, 128
    key = jax.ShapeDtypeStruct((1, T, H, D), jnp.bfloat16, sharding=sharding)
    val = jax.ShapeDtypeStruct((1, T, HV, D), jnp.bfloat16, sharding=sharding)

    def train(q, k, v, w, b, g, do):
        def loss(*a):
            o = gdn2core.gdn2_forward_trainable(*a, backend="pallas_tpu")[0]
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

        return jax.grad(loss, argnums=tuple(range(6)))(q, k, v, w, b, g)

    hlo = compile_for_tpu(train, key, key, val, val, key, key, val).as_text()
    caller, view = f"bf16[1,{T},{HV},{D}]", f"bf16[1,{T},{H},{2 * D}]"
    kernels = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert len(kernels) == 2, kernels
    fwd, bwd = sorted(kernels, key=lambda line: "gdn2_bwd" in line)
    assert fwd.split(" custom-call(")[0].count(caller) == 1, fwd[:300]  # o
    assert bwd.split(" custom-call(")[0].count(caller) == 2, bwd[:300]  # dv, dw
    assert view not in hlo


@pytest.mark.tpu_compile
def test_grouped_values_chunk_states_compile_without_relayout_on_v5e():
    """Deviceless v5e compile of the bf16 forward with ``return_chunk_states=True`` at the same
    heads: the kernel writes the chunk states in the caller's ``(1, 4, 32, 128, 128)`` layout and
    the program holds no ``(1, 4, 16, 128, 256)`` array of the core's view (before: the view, and
    a transpose of all of them to the caller's layout)."""
    sharding = NamedSharding(topology_mesh("v5e:1x1"), PartitionSpec())
    T, H, HV, D = 256, 16, 32, 128
    key = jax.ShapeDtypeStruct((1, T, H, D), jnp.bfloat16, sharding=sharding)
    val = jax.ShapeDtypeStruct((1, T, HV, D), jnp.bfloat16, sharding=sharding)

    def forward(*a):
        return gdn2core.gdn2_forward(*a, backend="pallas_tpu", return_chunk_states=True)

    hlo = compile_for_tpu(forward, key, key, val, val, key, key).as_text()
    (kernel,) = [
        line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line
    ]
    n = T // 64  # chunks of the default bt = 64
    assert f"f32[1,{n},{HV},{D},{D}]" in kernel.split(" custom-call(")[0], kernel[:300]
    assert f"[1,{n},{H},{D},{2 * D}]" not in hlo
