"""Deviceless TPU compiles of the model-feature train step: packed sequences (segment_ids), grouped
value heads (H = 16 key heads, HV = 32 value heads, d = 128) and the gates and q/k L2 norm fused
in the op, for v5e and v6e. Compile-time analysis only (no TPU run): the step must lower to the
Mosaic kernels, not to an XLA or interpret-mode fallback."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from gdn2_tools.tpu import compile_for_tpu, topology_mesh
from gdn2core import gdn2_forward_trainable

#: The shape of the issue's check: 16 key heads, 32 value heads, d = 128. B * T is small (the
#: kernels' grid only repeats with T), which keeps the compile to a few seconds.
B, T, H, HV, D = 2, 1024, 16, 32, 128


def _train_step_text(topology: str, gate_heads: int) -> str:
    """The compiled text of value_and_grad of the op in the raw q, k, v, w, b, g, A_log and
    dt_bias, with segment_ids, GVA and every fused activation."""
    sharding = NamedSharding(topology_mesh(topology), PartitionSpec())

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    key, val = spec((B, T, H, D)), spec((B, T, HV, D))
    gate = spec((B, T, gate_heads, D))
    a_log, dt_bias = spec((gate_heads,), jnp.float32), spec((gate_heads, D), jnp.float32)
    ids = spec((B, T), jnp.int32)

    def loss(q, k, v, w, b, g, A_log, dt_bias, segment_ids):
        o, h = gdn2_forward_trainable(
            q,
            k,
            v,
            w,
            b,
            g,
            segment_ids=segment_ids,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            A_log=A_log,
            dt_bias=dt_bias,
            use_bw_sigmoid_in_kernel=True,
            backend="pallas_tpu",
        )
        assert o.shape == (B, T, HV, D) and h.shape == (B, HV, D, D)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(h)

    step = jax.value_and_grad(loss, argnums=tuple(range(8)))
    return compile_for_tpu(step, key, key, val, val, gate, gate, a_log, dt_bias, ids).as_text()


@pytest.mark.tpu_compile
@pytest.mark.parametrize("gate_heads", [H, HV], ids=["gates-per-key-head", "gates-per-value-head"])
@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
def test_packed_gva_fused_train_step_lowers_to_mosaic(topology, gate_heads):
    text = _train_step_text(topology, gate_heads)
    assert "tpu_custom_call" in text
    assert "gdn2_fwd_train" in text and "gdn2_bwd" in text
