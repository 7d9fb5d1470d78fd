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
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import gdn2core
from gdn2_conformance import rel_err
from gdn2_pallas_tpu import vjp
from gdn2_tools.tpu import compile_for_tpu, topology_mesh
from gdn2core import KernelConfig

#: The conformance kit's float32 bounds: float32 products run as three bf16 passes (1.7e-5 on
#: outputs, 2.2e-5 on gradients measured, docs/algorithm.md section 10).
TOL_OUT, TOL_GRAD = 1e-4, 3e-4
CONFIG = KernelConfig(bt=16, interpret=True)
K = V = 64

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


def _inputs(H, HV, T, scalar, seed):
    rng = np.random.default_rng(seed)

    def arr(*shape, lo=-1.0, hi=1.0):
        return jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32)

    q, k, v = arr(1, T, H, K), arr(1, T, H, K), arr(1, T, HV, V)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    w = arr(1, T, HV, lo=0.05) if "w" in scalar else arr(1, T, HV, V, lo=0.05)
    b = arr(1, T, HV, lo=0.05) if "b" in scalar else arr(1, T, HV, K, lo=0.05)
    g = arr(1, T, HV, lo=-1.5, hi=-0.01) if "g" in scalar else arr(1, T, HV, K, lo=-1.5, hi=-0.01)
    return (q, k, v, w, b, g), arr(1, HV, K, V), arr(1, T, HV, V), arr(1, HV, K, V)


def _keywords(options, HV, T):
    kw = dict(options)
    if kw.pop("segment_ids", False):
        kw["segment_ids"] = jnp.asarray([[0] * 9 + [1] * (T - 9)], jnp.int32)
    if kw.get("use_gate_in_kernel"):  # the gate parameters live on the gates' (value) heads
        kw["A_log"] = jnp.linspace(-1.0, 0.5, HV).astype(jnp.float32)
        kw["dt_bias"] = jnp.linspace(-0.5, 0.5, HV * K).reshape(HV, K).astype(jnp.float32)
    return kw


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
    args, h0, do, dh = _inputs(H, HV, T, scalar, len(case))
    kw = _keywords(options, HV, T)
    params = {n: kw.pop(n) for n in ("A_log", "dt_bias") if n in kw}

    def loss_of(fn, **more):
        def loss(q, k, v, w, b, g, h0, params):
            o, h = fn(q, k, v, w, b, g, h0=h0, **kw, **params, **more)
            return jnp.sum(o * do) + jnp.sum(h * dh), (o, h)

        return jax.value_and_grad(loss, argnums=tuple(range(8)), has_aux=True)

    run = loss_of(gdn2core.gdn2_forward_trainable, backend="pallas_tpu", config=CONFIG)
    (_, (o, h)), grads = jax.jit(run)(*args, h0, params)
    assert kernel_calls == [(groups, key_heads)]  # grouped: the kernel got q of H heads
    with jax.default_matmul_precision("highest"):
        (_, (o_r, h_r)), grads_r = loss_of(gdn2core.gdn2_token_serial_reference)(*args, h0, params)
    assert rel_err(o, o_r) <= TOL_OUT and rel_err(h, h_r) <= TOL_OUT
    names = ("dq", "dk", "dv", "dw", "db", "dg", "dh0")
    for name, got, want in zip(names, grads[:7], grads_r[:7], strict=True):
        assert got.shape == want.shape, name
        assert rel_err(got, want) <= TOL_GRAD, name
    for name in params:
        assert rel_err(grads[7][name], grads_r[7][name]) <= TOL_GRAD, name


def test_chunk_states_with_grouped_keys(kernel_calls):
    """The forward with chunk states reads the keys grouped too: every chunk's entry state is the
    reference's state after that prefix."""
    args, h0, _, _ = _inputs(8, 16, 48, ("w", "b", "g"), 7)
    o, h, chunks = gdn2core.gdn2_forward(*args, h0=h0, backend="pallas_tpu", config=CONFIG,
                                         return_chunk_states=True)  # fmt: skip
    assert kernel_calls == [(2, 8)]
    o_r, h_r = gdn2core.gdn2_token_serial_reference(*args, h0=h0)
    assert rel_err(o, o_r) <= TOL_OUT and rel_err(h, h_r) <= TOL_OUT
    for i in (1, 2):
        _, h_i = gdn2core.gdn2_token_serial_reference(*(a[:, : 16 * i] for a in args), h0=h0)
        assert rel_err(chunks[:, i], h_i) <= TOL_OUT, i


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
