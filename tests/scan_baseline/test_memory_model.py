"""scan_baseline's memory model, which its supports() uses to refuse shapes, bounds reality."""

import jax
import jax.numpy as jnp
import pytest

from gdn2_scan_baseline.backend import estimated_bytes
from gdn2_scan_baseline.scan import gdn2_associative_scan
from gdn2core import OpSpec


@pytest.mark.parametrize(("T", "dk", "dv"), [(256, 32, 32), (128, 64, 8), (128, 8, 64)])
def test_estimate_bounds_compiled_temp_bytes(T, dk, dv):
    B, H = 1, 2
    key = jax.ShapeDtypeStruct((B, T, H, dk), jnp.float32)
    val = jax.ShapeDtypeStruct((B, T, H, dv), jnp.float32)
    h0 = jax.ShapeDtypeStruct((B, H, dk, dv), jnp.float32)

    def loss(q, k, v, w, b, g, h0):
        o, h = gdn2_associative_scan(q, k, v, w, b, g, h0, 0.1)
        return o.sum() + h.sum()

    step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7))))
    temp = step.lower(key, key, val, val, key, key, h0).compile().memory_analysis()
    estimate = estimated_bytes(OpSpec(B, T, H, dk, dv, "float32", 0.1))
    one_map = B * H * T * dk * (dk + dv) * 4
    # The estimate is an upper bound, and not a loose one (within 3 buffers of the measurement).
    assert temp.temp_size_in_bytes <= estimate
    assert estimate - temp.temp_size_in_bytes <= 3 * one_map
