"""Scalar gates on pallas_tpu: b, w (KDA's beta) and g (GDN's decay) read as ``(B, T, H)`` by the
kernels, broadcast over the channels in VMEM, their gradients summed over the channels there.

Interpret mode against the token-serial reference on the same scalar inputs (the reference
broadcasts them; autodiff sums the channels' gradients), in both token layouts, with a padded last
step, packed sequences, the fused activations, grouped value heads and chunk states; the traced
program holds no ``(B, T, H, d)`` gate (nothing broadcast in XLA). A deviceless v5e compile: the
kernels' operands and results hold fewer bytes than the same call on broadcast gates.
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
from gdn2_tools.tpu import compile_for_tpu, topology_mesh
from gdn2core import KernelConfig

#: The conformance kit's float32 bounds: float32 products run as three bf16 passes (1.7e-5 on
#: outputs, 2.2e-5 on gradients measured, docs/algorithm.md section 10).
TOL_OUT, TOL_GRAD = 1e-4, 3e-4
CONFIG = KernelConfig(bt=16, interpret=True)
K = V = 64

#: name: (H, HV, T, scalar gates, keywords). H = 3: head-major tiles; H = 8: token-major blocks.
CASES = {
    "kda-head-major-padded": (3, 3, 70, ("w", "b"), {}),
    "gdn-token-major": (8, 8, 64, ("w", "b", "g"), {}),
    "gdn-segments": (2, 2, 70, ("w", "b", "g"), {"segment_ids": True}),
    "gdn-fused-activations": (2, 2, 50, ("w", "b", "g"),
                              {"use_bw_sigmoid_in_kernel": True, "use_gate_in_kernel": True,
                               "use_qk_l2norm_in_kernel": True}),
    "kda-grouped-values": (2, 4, 40, ("w", "b"), {}),  # w broadcast by the core (G dv channels)
}  # fmt: skip


def _inputs(H, HV, T, scalar, seed):
    rng = np.random.default_rng(seed)

    def arr(*shape, lo=-1.0, hi=1.0):
        return jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32)

    q, k, v = arr(1, T, H, K), arr(1, T, H, K), arr(1, T, HV, V)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    w = arr(1, T, HV, lo=0.05) if "w" in scalar else arr(1, T, HV, V, lo=0.05)
    b = arr(1, T, H, lo=0.05) if "b" in scalar else arr(1, T, H, K, lo=0.05)
    g = arr(1, T, H, lo=-1.5, hi=-0.01) if "g" in scalar else arr(1, T, H, K, lo=-1.5, hi=-0.01)
    return (q, k, v, w, b, g), arr(1, HV, K, V), arr(1, T, HV, V), arr(1, HV, K, V)


def _keywords(options, H, T):
    kw = dict(options)
    if kw.pop("segment_ids", False):
        kw["segment_ids"] = jnp.asarray([[0] * 9 + [1] * 30 + [2] * (T - 39)], jnp.int32)
    if kw.get("use_gate_in_kernel"):
        kw["A_log"] = jnp.linspace(-1.0, 0.5, H).astype(jnp.float32)
        kw["dt_bias"] = jnp.linspace(-0.5, 0.5, H * K).reshape(H, K).astype(jnp.float32)
    return kw


def _gate_broadcasts(fn, args, shapes) -> list:
    """The ``broadcast_in_dim`` equations of ``fn``'s jaxpr (nested ones included) from a rank-3
    operand (a scalar gate, or it with a unit channel axis; not the loss's constants) to one of ``shapes``."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "broadcast_in_dim" and eqn.invars[0].aval.ndim >= 3:
                found.extend(eqn for v in eqn.outvars if tuple(v.aval.shape) in shapes)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)  # a ClosedJaxpr's, or a Jaxpr
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_scalar_gates_match_the_reference(case):
    H, HV, T, scalar, options = CASES[case]
    args, h0, do, dh = _inputs(H, HV, T, scalar, len(case))
    kw = _keywords(options, H, T)
    params = {n: kw.pop(n) for n in ("A_log", "dt_bias") if n in kw}

    def loss_of(fn, **more):
        def loss(q, k, v, w, b, g, h0, params):
            o, h = fn(q, k, v, w, b, g, h0=h0, **kw, **params, **more)
            return jnp.sum(o * do) + jnp.sum(h * dh), (o, h)

        return jax.value_and_grad(loss, argnums=tuple(range(8)), has_aux=True)

    run = loss_of(gdn2core.gdn2_forward_trainable, backend="pallas_tpu", config=CONFIG)
    (_, (o, h)), grads = jax.jit(run)(*args, h0, params)
    with jax.default_matmul_precision("highest"):
        (_, (o_r, h_r)), grads_r = loss_of(gdn2core.gdn2_token_serial_reference)(*args, h0, params)
    assert rel_err(o, o_r) <= TOL_OUT and rel_err(h, h_r) <= TOL_OUT
    names = ("dq", "dk", "dv", "dw", "db", "dg", "dh0")
    for name, got, want in zip(names, grads[:7], grads_r[:7], strict=True):
        assert got.shape == want.shape, name  # a scalar gate's gradient is (B, T, H)
        assert rel_err(got, want) <= TOL_GRAD, name
    for name in params:
        assert rel_err(grads[7][name], grads_r[7][name]) <= TOL_GRAD, name

    # Nothing broadcast the scalar gates to their channels in XLA (but w under grouped value
    # heads: its kernel heads have G * dv channels, features/gva.py).
    full = {(1, T, H, K), (1, T, HV, V)}
    broadcasts = _gate_broadcasts(lambda *a: run(*a, h0, params), args, full)
    assert len(broadcasts) == (1 if HV != H else 0), broadcasts


def test_chunk_states_with_scalar_gates():
    """The forward with chunk states reads the scalar gates too: every chunk's entry state is the
    reference's state after that prefix."""
    args, h0, _, _ = _inputs(3, 3, 70, ("w", "b", "g"), 5)
    o, h, chunks = gdn2core.gdn2_forward(*args, h0=h0, backend="pallas_tpu", config=CONFIG,
                                         return_chunk_states=True)  # fmt: skip
    o_r, h_r = gdn2core.gdn2_token_serial_reference(*args, h0=h0)
    assert rel_err(o, o_r) <= TOL_OUT and rel_err(h, h_r) <= TOL_OUT
    for i in (1, 3, chunks.shape[1] - 1):
        _, h_i = gdn2core.gdn2_token_serial_reference(*(a[:, : 16 * i] for a in args), h0=h0)
        assert rel_err(chunks[:, i], h_i) <= TOL_OUT, i


def _kernel_bytes(hlo: str) -> int:
    """Bytes of the operands and results of the program's Mosaic kernels, from the shapes the
    compiled HLO gives them (no tiling padding)."""
    shapes = dict(re.findall(r"%(\S+) = (\S+(?:\{[^}]*\})?|\([^=]*?\)) ", hlo))
    sizes = {"bf16": 2, "f32": 4, "s32": 4}

    def nbytes(text: str) -> int:
        return sum(
            sizes[dt] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
            for dt, dims in re.findall(r"(bf16|f32|s32)\[([\d,]*)\]", text)
        )

    total = 0
    for line in hlo.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        result, operands = re.match(
            r"\s*(?:ROOT )?%\S+ = (.*?) custom-call\((.*?)\)", line
        ).groups()
        total += nbytes(result)
        total += sum(nbytes(shapes.get(name.lstrip("%"), "")) for name in operands.split(", "))
    return total


@pytest.mark.tpu_compile
def test_gdn_train_step_moves_fewer_bytes_on_v5e():
    """Deviceless v5e compile of a bf16 GDN train step (B2 T1024 H6 d128) through
    ``chunk_gated_delta_rule``: the kernels' operands and results hold at most 70% of the bytes
    of the same step on gates broadcast to ``(B, T, H, 128)`` (per head and token the broadcast
    gates and their gradients are 9 x 256 bytes of about 5 kB; the scalar ones 9 x 4 bytes)."""
    sharding = NamedSharding(topology_mesh("v5e:1x1"), PartitionSpec())
    B, T, H, D = 2, 1024, 6, 128
    x = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16, sharding=sharding)
    s = jax.ShapeDtypeStruct((B, T, H), jnp.bfloat16, sharding=sharding)

    def step(broadcast):
        def train(q, k, v, beta, g, do):
            def loss(q, k, v, beta, g):
                if broadcast:  # the GDN-2 call on broadcast gates
                    full = jnp.broadcast_to(beta[..., None], q.shape)
                    o, _ = gdn2core.gdn2_forward_trainable(
                        q, k, v, full, full, jnp.broadcast_to(g[..., None], q.shape),
                        backend="pallas_tpu",
                    )  # fmt: skip
                else:
                    o, _ = gdn2core.chunk_gated_delta_rule(q, k, v, g, beta, backend="pallas_tpu")
                return jnp.sum(o * do)

            return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, beta, g)

        return compile_for_tpu(train, x, x, x, s, s, x).as_text()

    scalar, full = step(False), step(True)
    assert scalar.count('custom_call_target="tpu_custom_call"') == 2
    ratio = _kernel_bytes(scalar) / _kernel_bytes(full)
    assert ratio <= 0.7, ratio
