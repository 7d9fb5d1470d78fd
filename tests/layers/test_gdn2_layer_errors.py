"""GDN2Layer's errors a new user meets: each names the argument, the expected and the actual value,
up front (before any raw JAX error), and nothing wrong is silently accepted."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn2core.layers import GDN2Cache, GDN2Layer

D, H, DK = 16, 2, 8


def _layer(name, **kw):
    return GDN2Layer(D, H, DK, backend=name, rngs=nnx.Rngs(0), **kw)


def _x(B=2, T=3, d=D):
    return jax.random.normal(jax.random.key(1), (B, T, d))


@pytest.mark.parametrize(
    "dtype, name",
    [(jnp.int32, "int32"), ("float16", "float16"), (jnp.float64, "float64"), (bool, "bool")],
)
def test_init_cache_refuses_state_dtypes_by_name(ref_backend, dtype, name):
    """An int32 state would truncate every update to zero, a float16 one fails at the first
    decode step, float64 belongs to a float64 layer only: refused when the cache is made."""
    layer = _layer(ref_backend.name)
    with pytest.raises(TypeError, match=f"state_dtype: expected float32 or bfloat16, got {name}$"):
        layer.init_cache(2, state_dtype=dtype)
    with pytest.raises(TypeError, match="state_dtype: expected float32 or bfloat16, got 'nope'"):
        layer.init_cache(2, state_dtype="nope")
    for ok in (jnp.float32, "bfloat16", np.dtype("float32")):
        assert layer.init_cache(2, state_dtype=ok).state.dtype == jnp.dtype(ok)


@pytest.mark.parametrize("batch", [0, -1, 2.0, True, "2"])
def test_init_cache_refuses_a_batch_that_is_not_a_positive_integer(ref_backend, batch):
    with pytest.raises(ValueError, match=r"batch: expected a positive integer, got"):
        _layer(ref_backend.name).init_cache(batch)


def test_float64_layer_keeps_a_float64_state_through_prefill(ref_backend, x64):
    """A float64 layer may cache a float64 state, and a prefill from it runs in float64 (no
    round trip through float32): a prompt of 4 then one of 5 equal one call of 9 to 1e-12 (a
    float32 round trip of the state costs ~1e-8)."""
    layer = _layer(ref_backend.name, dtype=jnp.float64)
    assert layer.state_dtypes() == ("float32", "bfloat16", "float64")
    x = jax.random.normal(jax.random.key(1), (2, 9, D), jnp.float64)
    cache = layer.init_cache(2, state_dtype=jnp.float64)
    assert cache.state.dtype == jnp.float64
    y1, cache = layer(x[:, :4], cache=cache)
    y2, cache = layer(x[:, 4:], cache=cache)
    y_full, h_full = layer(x, return_state=True)
    assert cache.state.dtype == jnp.float64
    np.testing.assert_allclose(jnp.concatenate([y1, y2], 1), y_full, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cache.state, h_full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "shape, got",
    [((2, D), r"\(2, 16\)"), ((2, 3, D + 1), r"\(2, 3, 17\)"), ((2, 0, D), r"\(2, 0, 16\)")],
)
def test_x_of_the_wrong_shape_is_named(ref_backend, shape, got):
    layer = _layer(ref_backend.name)
    expected = r"x: expected shape \(B, T, d_model\) = \(B, T, 16\) with B, T >= 1, got "
    with pytest.raises(ValueError, match=expected + got):
        layer(jnp.zeros(shape))
    with pytest.raises(ValueError, match=expected + got):
        layer(jnp.zeros(shape), cache=layer.init_cache(2))


def test_a_cache_of_another_batch_or_layer_is_named(ref_backend):
    layer = _layer(ref_backend.name)
    x = _x(B=2)
    with pytest.raises(
        ValueError, match=r"cache.state: expected shape \(2, 2, 8, 8\) for x of batch B = 2, got "
        r"shape \(3, 2, 8, 8\) \(layer.init_cache\(B\)"
    ):  # fmt: skip
        layer(x, cache=layer.init_cache(3))
    wide = _layer(ref_backend.name, expand_v=2).init_cache(2)  # another layer's cache
    with pytest.raises(ValueError, match=r"cache.state: expected shape \(2, 2, 8, 8\)"):
        layer(x, cache=wide)
    no_conv = _layer(ref_backend.name, conv_size=0).init_cache(2)
    with pytest.raises(ValueError, match=r"cache.conv_q: expected shape \(2, 3, 16\) .* got None"):
        layer(x, cache=no_conv)
    with pytest.raises(ValueError, match=r"cache.conv_q: expected None \(no short convolutions\)"):
        _layer(ref_backend.name, conv_size=0)(x, cache=layer.init_cache(2))
    bad = dataclasses.replace(layer.init_cache(2), conv_v=jnp.zeros((2, 2, H * DK)))
    with pytest.raises(ValueError, match=r"cache.conv_v: expected shape \(2, 3, 16\)"):
        layer(x, cache=bad)
    int_state = dataclasses.replace(layer.init_cache(2), state=jnp.zeros((2, H, DK, DK), int))
    with pytest.raises(TypeError, match="cache.state: expected dtype float32 or bfloat16, got int"):
        layer(x, cache=int_state)
    with pytest.raises(TypeError, match=r"cache: expected a GDN2Cache \(layer.init_cache\(B\)\)"):
        layer(x, cache=jnp.zeros((2, H, DK, DK)))
    assert isinstance(layer(x, cache=layer.init_cache(2))[1], GDN2Cache)  # the right one runs


def test_decode_needs_a_cache(ref_backend):
    """decode=True without a cache was silently ignored (the chunked forward ran): refused."""
    layer = _layer(ref_backend.name)
    with pytest.raises(ValueError, match=r"decode: decode=True needs cache=\.\.\."):
        layer(_x(T=1), decode=True)
    with pytest.raises(TypeError, match="decode: expected True, False or None, got str"):
        layer(_x(T=1), cache=layer.init_cache(2), decode="yes")
    np.testing.assert_array_equal(layer(_x(), decode=False), layer(_x()))  # what it says
