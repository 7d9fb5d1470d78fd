"""Grouped keys on pallas_tpu: grouped value heads with b, g on the value heads (Qwen3-Next's GDN
layout), q and k read by the kernels from their own ``H`` heads (no ``(B, T, HV, dk)`` repeat in
HBM), their gradients summed over each group.

Interpret mode against the token-serial reference (which repeats the keys itself, fla's
convention): forward and all gradients, scalar (GDN) and full (GDN-2) gates, a padded last step,
packed sequences and fused activations, and the calls the kernels cannot read grouped (head-major
blocking, a group size that does not divide the 8 heads of a step), which this backend repeats. A
spy on the forward kernel checks which of the two ran. A deviceless v5e compile at Qwen3-Next's
heads: the kernels' operands are the caller's q and k.
"""

from __future__ import annotations

import re

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

#: name: (H, HV, T, scalar gates, keywords, key heads the kernel reads, key_groups of its plan).
CASES = {
    "gdn-G2-padded": (8, 16, 40, ("w", "b", "g"), {}, 8, 2),
    "gdn2-full-gates-G2": (8, 16, 32, (), {}, 8, 2),
    "gdn-G4-segments-activations": (8, 32, 32, ("w", "b", "g"),
                                    {"segment_ids": True, "use_qk_l2norm_in_kernel": True,
                                     "use_gate_in_kernel": True}, 8, 4),
    "head-major-repeated": (2, 4, 24, ("w", "b", "g"), {}, 4, 1),
    "G3-repeated": (8, 24, 16, ("w", "b", "g"), {}, 24, 1),
}  # fmt: skip


@pytest.fixture
def kernel_calls(monkeypatch):
    """``(plan.key_groups, q's heads)`` of every forward kernel traced."""
    seen, original = [], vjp.forward_call

    def spy(q, *args, plan, **kw):
        seen.append((plan.key_groups, q.size // (plan.batch * plan.t_pad * plan.dk)))
        return original(q, *args, plan=plan, **kw)

    monkeypatch.setattr(vjp, "forward_call", spy)
    return seen


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_keys_match_the_reference(case, kernel_calls):
    H, HV, T, scalar, options, key_heads, groups = CASES[case]
    args, h0, do, dh = gate_inputs(H, HV, T, scalar, len(case), gate_heads=HV)
    assert_train_matches_reference(args, h0, do, dh, gate_keywords(options, HV, T))
    assert kernel_calls == [(groups, key_heads)]  # grouped: the kernel got q of H heads


def test_chunk_states_with_grouped_keys(kernel_calls):
    """The forward with chunk states reads the keys grouped too: every chunk's entry state is the
    reference's state after that prefix."""
    args, h0, _, _ = gate_inputs(8, 16, 48, ("w", "b", "g"), 7, gate_heads=16)
    assert_chunk_states_match_reference(args, h0, (1, 2))
    assert kernel_calls == [(2, 8)]


def _kernels(hlo: str) -> dict[str, tuple[list[str], str]]:
    """The program's Mosaic kernels by HLO name: the shapes of their operands (in order) and the
    text of their result shape, from the compiled HLO (layouts dropped)."""
    shapes = dict(re.findall(r"%(\S+) = (\S+?)(?:\{[^}]*\})? ", hlo))
    found = {}
    for line in hlo.splitlines():
        if 'custom_call_target="tpu_custom_call"' in line:
            name, result, operands = re.match(
                r"\s*(?:ROOT )?%(\S+) = (.*?) custom-call\((.*?)\)", line
            ).groups()
            args = [shapes.get(x.lstrip("%"), "") for x in operands.split(", ")]
            found[name] = (args, re.sub(r"\{[^}]*\}", "", result))
    return found


@pytest.mark.tpu_compile
def test_qwen_layout_train_step_compiles_without_repeated_keys_on_v5e():
    """Deviceless v5e compile of a bf16 GDN train step at Qwen3-Next's heads (16 key heads, 32
    value heads, b and g on the value heads, T = 256): both Mosaic kernels take q and k as the
    caller's ``(1, 256, 16, 128)`` arrays (keys repeated in XLA would be ``(1, 256, 32, 128)``),
    and the backward returns dq and dk summed per key head, ``(1, 256, 16 * 128)``."""
    sharding = NamedSharding(topology_mesh("v5e:1x1"), PartitionSpec())
    T, H, HV, D = 256, 16, 32, 128
    key = jax.ShapeDtypeStruct((1, T, H, D), jnp.bfloat16, sharding=sharding)
    val = jax.ShapeDtypeStruct((1, T, HV, D), jnp.bfloat16, sharding=sharding)
    gate = jax.ShapeDtypeStruct((1, T, HV), jnp.bfloat16, sharding=sharding)

    def train(q, k, v, g, beta):
        def loss(q, k, v, g, beta):
            o = gdn2core.chunk_gated_delta_rule(q, k, v, g, beta, backend="pallas_tpu")[0]
            return jnp.sum(o.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)

    hlo = compile_for_tpu(train, key, key, val, gate, gate).as_text()
    kernels = _kernels(hlo)
    assert len(kernels) == 2, kernels
    for name, (operands, _) in kernels.items():
        assert operands.count(f"bf16[1,{T},{H},{D}]") == 2, (name, operands)  # q, k as given
        assert f"bf16[1,{T},{HV},{D}]" not in operands[:2], (name, operands)
    (bwd,) = [results for name, (_, results) in kernels.items() if "bwd" in name]
    assert bwd.count(f"bf16[1,{T},{H * D}]") == 2, bwd  # dq, dk per key head
