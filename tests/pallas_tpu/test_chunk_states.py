"""``return_chunk_states=True`` on pallas_tpu: the forward kernel writes the state entering every
chunk. In TPU interpret mode against the token-serial reference, and compiled for v5e (the states
come straight out of the Mosaic kernel, no XLA copy of them)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import gdn2core
from gdn2_pallas_tpu.plan import make_plan
from gdn2_tools.tpu import compile_for_tpu, topology_mesh
from gdn2core import KernelConfig, gdn2_forward
from gdn2core.ops.forward.spec import OpSpec

from .helpers import rel_err

C = 16
#: 129 tokens are 9 chunks of 16: the plan runs 8 chunks per grid step (9 has no divisor near 8)
#: and pads to 16 chunks, so the kernel writes 16 entry states and the backend returns 9.
B, T, H, HV, DK, DV = 1, 129, 2, 4, 64, 64
#: float32 inputs run the kernels' products as three bf16 passes (1.7e-5 relative on outputs,
#: docs/algorithm.md section 10); the conformance kit's float32 bound, 1e-4, leaves 6x over that
#: for the states after up to 128 tokens.
TOL = 1e-4


def _inputs(gate_heads: int):
    rng = np.random.default_rng(gate_heads)

    def arr(*shape, lo=-1.0, hi=1.0):
        return jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32)

    args = (arr(B, T, H, DK), arr(B, T, H, DK), arr(B, T, HV, DV), arr(B, T, HV, DV),
            arr(B, T, gate_heads, DK), arr(B, T, gate_heads, DK))  # fmt: skip
    fused = dict(
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=arr(gate_heads, lo=-2.0, hi=0.0),
        dt_bias=arr(gate_heads, DK, lo=-0.5, hi=0.5),
        use_bw_sigmoid_in_kernel=True,
    )
    return args, arr(B, HV, DK, DV), fused


def test_the_plan_pads_the_last_step():
    """The case below must exercise the slice of the padded chunks (else it tests less)."""
    x = jnp.zeros((B, T, H, DK))
    spec = OpSpec.from_inputs(x, x, x, x, x, x, None, None)
    plan = make_plan(spec, KernelConfig(bt=C, interpret=True), chunk_states=True)
    assert plan.t_pad // plan.C > -(-T // C), (plan.nc, plan.t_pad)


@pytest.mark.parametrize("gate_heads", [H, HV], ids=["gates-per-key-head", "gates-per-value-head"])
def test_chunk_states_match_the_token_serial_reference(gate_heads):
    """Grouped value heads (b, g on key heads: the kernel runs value size 2 dv; on value heads:
    q, k repeated) and every fused activation: o, h_final and the chunk-entry states (the
    reference's h_final over the first i * C tokens), entry 0 equal to h0 bit for bit."""
    args, h0, fused = _inputs(gate_heads)
    config = KernelConfig(bt=C, interpret=True)
    o, h, chunks = gdn2_forward(
        *args, h0=h0, config=config, backend="pallas_tpu", return_chunk_states=True, **fused
    )
    n_chunks = -(-T // C)
    assert chunks.shape == (B, n_chunks, HV, DK, DV) and chunks.dtype == jnp.float32
    np.testing.assert_array_equal(chunks[:, 0], h0)
    with jax.default_matmul_precision("highest"):
        o_ref, h_ref = gdn2core.gdn2_token_serial_reference(*args, h0=h0, **fused)
        assert rel_err(o, o_ref) <= TOL and rel_err(h, h_ref) <= TOL
        for i in (1, 5, n_chunks - 1):
            prefix = [a[:, : i * C] for a in args]
            _, h_i = gdn2core.gdn2_token_serial_reference(*prefix, h0=h0, **fused)
            assert rel_err(chunks[:, i], h_i) <= TOL, i


@pytest.mark.tpu_compile
def test_chunk_states_come_out_of_the_kernel_on_v5e():
    """Deviceless v5e compile (bf16, H = 16, T = 2048): the Mosaic forward writes the
    ``(B, T / 64, H, K, V)`` float32 states itself; no XLA op but the kernel produces an array of
    that shape (no transpose, slice or copy of them)."""
    sharding = NamedSharding(topology_mesh("v5e:1x1"), PartitionSpec())
    Bc, Tc, Hc, D = 2, 2048, 16, 128
    x = jax.ShapeDtypeStruct((Bc, Tc, Hc, D), jnp.bfloat16, sharding=sharding)

    def fwd(q, k, v, w, b, g):
        return gdn2_forward(q, k, v, w, b, g, backend="pallas_tpu", return_chunk_states=True)

    text = compile_for_tpu(fwd, x, x, x, x, x, x).as_text()
    shape = f"f32[{Bc},{Tc // 64},{Hc},{D},{D}]"
    ops = [
        re.match(r"\s*(?:ROOT )?%\S+ = (.*?) ([a-z][a-z0-9-]*)\(", ln) for ln in text.splitlines()
    ]
    makers = [m.string for m in ops if m and shape in m.group(1)]
    kinds = {m.group(2) for m in ops if m and shape in m.group(1)}
    assert any('custom_call_target="tpu_custom_call"' in ln and "gdn2_fwd" in ln for ln in makers)
    assert kinds <= {"custom-call", "get-tuple-element", "tuple", "bitcast"}, kinds
