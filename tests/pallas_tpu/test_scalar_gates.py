"""Scalar gates on pallas_tpu: b, w (KDA's beta) and g (GDN's decay) read as ``(B, T, H)`` by the
kernels, broadcast over the channels in VMEM, their gradients summed over the channels there; a
scalar decay (not activated in the kernels) gives each pair of a chunk one factor
(``Plan.scalar_decay``, chunk_math.PairDecay) instead of the decay levels.

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
from gdn2_tools.tpu import compile_for_tpu, topology_mesh

from .gate_cases import (
    K,
    V,
    assert_chunk_states_match_reference,
    assert_train_matches_reference,
    gate_inputs,
    gate_keywords,
)

#: name: (H, HV, T, scalar gates, keywords). H = 3: head-major tiles; H = 8: token-major blocks.
CASES = {
    "kda-head-major-padded": (3, 3, 70, ("w", "b"), {}),
    "gdn-token-major": (8, 8, 64, ("w", "b", "g"), {}),
    "gdn-segments": (2, 2, 70, ("w", "b", "g"), {"segment_ids": True}),
    "gdn-strong-decay": (2, 2, 50, ("w", "b", "g"), {"decay_scale": 20.0}),  # to -30 per token
    "gdn-cu-seqlens": (2, 2, 70, ("w", "b", "g"), {"cu_seqlens": (0, 9, 39, 70)}),
    "gdn-fused-activations": (2, 2, 50, ("w", "b", "g"),
                              {"use_bw_sigmoid_in_kernel": True, "use_gate_in_kernel": True,
                               "use_qk_l2norm_in_kernel": True}),
    "gdn-fused-gate-per-head": (2, 2, 50, ("w", "b", "g"),
                                {"use_gate_in_kernel": True, "dt_bias_per_head": True}),
    "kda-grouped-values": (2, 4, 40, ("w", "b"), {}),  # w broadcast by the core (G dv channels)
}  # fmt: skip


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
    options = dict(options)
    args, h0, do, dh = gate_inputs(H, HV, T, scalar, len(case))
    if "decay_scale" in options:  # g is the last input
        args = (*args[:5], args[5] * options.pop("decay_scale"))
    if "cu_seqlens" in options:  # h0, h_final per sequence
        cu = options.pop("cu_seqlens")
        options["cu_seqlens"] = jnp.asarray(cu, jnp.int32)
        h0, dh = (jnp.concatenate([x] * (len(cu) - 1)) * jnp.arange(1.0, len(cu))[:, None, None, None]
                  for x in (h0, dh))  # fmt: skip
    run = assert_train_matches_reference(args, h0, do, dh, gate_keywords(options, H, T))

    # Nothing broadcast the scalar gates to their channels in XLA (but w under grouped value
    # heads: its kernel heads have G * dv channels, features/gva.py).
    full = {(1, T, H, K), (1, T, HV, V)}
    broadcasts = _gate_broadcasts(run, args, full)
    assert len(broadcasts) == (1 if HV != H else 0), broadcasts


def test_a_scalar_decay_takes_one_factor_per_pair():
    """The plan takes the pair factors for a scalar g, but not for a full g nor with the fused
    gate whose dt_bias may differ by channel (``(Hg, dk)``: then so does the activated g); with
    a ``(Hg,)`` dt_bias it does."""
    from gdn2_pallas_tpu.plan import make_plan
    from gdn2core import KernelConfig
    from gdn2core.ops.forward.spec import OpSpec
    from gdn2core.options import Activations, GateMode

    x, s = jnp.zeros((1, 64, 2, K)), jnp.zeros((1, 64, 2))
    config = KernelConfig(interpret=True)
    spec = OpSpec.from_inputs(x, x, x, s, s, s, None, None)
    assert spec.scalar_gates == ("w", "b", "g")
    assert make_plan(spec, config, scalar_gates=spec.scalar_gates).scalar_decay
    assert not make_plan(spec, config, scalar_gates=("w", "b")).scalar_decay
    gate = Activations(gate=GateMode.SOFTPLUS)
    fused = make_plan(spec, config, activations=gate, scalar_gates=spec.scalar_gates)
    assert not fused.scalar_decay
    l2 = make_plan(spec, config, activations=Activations(qk_l2norm=True), scalar_gates=("g",))
    assert l2.scalar_decay
    # dt_bias one per head: the activated g is the same on every channel
    per_head = OpSpec.from_inputs(x, x, x, s, s, s, None, None, activations=gate,
                                  A_log=jnp.zeros(2), dt_bias=jnp.zeros(2), per_head_dt_bias=True)  # fmt: skip
    assert per_head.uniform_gate
    assert make_plan(per_head, config, activations=gate, scalar_gates=("g",)).scalar_decay


def test_chunk_states_with_scalar_gates():
    """The forward with chunk states reads the scalar gates too: every chunk's entry state is the
    reference's state after that prefix."""
    args, h0, _, _ = gate_inputs(3, 3, 70, ("w", "b", "g"), 5)
    assert_chunk_states_match_reference(args, h0, (1, 3, 4))


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


@pytest.mark.tpu_compile
def test_gdn_train_step_on_a_mesh_reads_scalar_gates_per_shard():
    """Deviceless compile for 8 v5e chips, batch-sharded (B8 T256 H2 d128, bf16): the core hands
    each shard's kernels its part of the scalar gates, ``(B / 8, T, H)`` read as the kernels'
    ``(1, 1, n_steps, hb, nc C)`` float32 blocks, not broadcast to the channels."""
    mesh = topology_mesh("v5e:2x4")
    (axis,) = mesh.axis_names
    B, T, H, D = 8, 256, 2, 128
    x = jax.ShapeDtypeStruct(
        (B, T, H, D), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec(axis))
    )
    s = jax.ShapeDtypeStruct(
        (B, T, H), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec(axis))
    )

    def train(q, k, v, beta, g, do):
        def loss(q, k, v, beta, g):
            o, _ = gdn2core.chunk_gated_delta_rule(
                q, k, v, g, beta, backend="pallas_tpu", mesh=mesh, batch_axes=axis
            )
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, beta, g)

    text = jax.jit(train).trace(x, x, x, s, s, x).lower(lowering_platforms=("tpu",)).compile()
    text = text.as_text()
    assert text.count('custom_call_target="tpu_custom_call"') == 2
    assert "f32[1,1,1,2,256]" in text  # one step of 256 tokens, both heads
