"""GDN2Layer: shapes, gradients, the lifted erase gate, causality, and the optional import."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn2core.layers import GDN2Layer

D, H, DK = 16, 2, 8


def _layer(name, **kw):
    return GDN2Layer(D, H, DK, backend=name, rngs=nnx.Rngs(0), **kw)


@nnx.jit
def _apply_state(m, x, h0=None):
    return m(x, h0=h0, return_state=True)


def _x(B=2, T=12, seed=1):
    return jax.random.normal(jax.random.key(seed), (B, T, D))


def test_shapes_and_expand_v(ref_backend):
    layer = _layer(ref_backend.name, expand_v=2, lift_b=True)
    y, h = _apply_state(layer, _x())
    assert y.shape == (2, 12, D)
    assert h.shape == (2, H, DK, 2 * DK) and h.dtype == jnp.float32
    assert ref_backend.calls > 0


def test_state_carries_over(ref_backend):
    # without the short conv (which carries no state across calls) a split run is exact
    layer = _layer(ref_backend.name, conv_size=0)
    x = _x(T=12)
    y_full, _ = _apply_state(layer, x)
    y1, h1 = _apply_state(layer, x[:, :6])
    y2, _ = _apply_state(layer, x[:, 6:], h1)
    np.testing.assert_allclose(y2, y_full[:, 6:], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(y1, y_full[:, :6], rtol=1e-4, atol=1e-5)


def test_gradients_finite(ref_backend):
    layer = _layer(ref_backend.name, expand_v=2, lift_b=True)

    def loss(m, x):
        return jnp.mean(m(x) ** 2)

    grads = nnx.jit(nnx.grad(loss))(layer, _x())
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert len(leaves) >= 12
    for leaf in leaves:
        assert bool(jnp.all(jnp.isfinite(leaf)))
    assert any(float(jnp.abs(leaf).max()) > 0 for leaf in leaves)


def test_erase_gate_range(ref_backend):
    x = 3.0 * _x()
    _, b, g = _layer(ref_backend.name).gates(x)
    assert float(b.min()) > 0 and float(b.max()) < 1
    w, b2, _ = _layer(ref_backend.name, lift_b=True).gates(x)
    assert float(b2.min()) > 0 and float(b2.max()) < 2 and float(b2.max()) > 1
    np.testing.assert_allclose(b2, 2 * b, rtol=1e-6)
    assert float(g.max()) <= 0 and float(w.min()) > 0 and float(w.max()) < 1
    assert b.shape == (2, 12, H, DK) and w.shape == (2, 12, H, DK)


def test_causal(ref_backend):
    layer = _layer(ref_backend.name, expand_v=2, lift_b=True)
    x = _x()  # same shapes and layer config as test_shapes_and_expand_v: one compile
    t0 = 6
    x2 = x.at[:, t0 + 1 :].add(jax.random.normal(jax.random.key(7), (2, 12 - t0 - 1, D)))
    (y, _), (y2, _) = _apply_state(layer, x), _apply_state(layer, x2)
    np.testing.assert_array_equal(np.asarray(y[:, : t0 + 1]), np.asarray(y2[:, : t0 + 1]))
    assert not np.allclose(y[:, t0 + 1 :], y2[:, t0 + 1 :])


def test_bad_expand_v():
    with pytest.raises(ValueError):
        GDN2Layer(D, H, DK, expand_v=0.3, rngs=nnx.Rngs(0))


def test_bad_backend_or_config_fails_at_construction():
    from gdn2core import BackendNotFoundError

    with pytest.raises(BackendNotFoundError, match="'jax_reff' is not installed"):
        GDN2Layer(D, H, DK, backend="jax_reff", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="config: expected a KernelConfig or None, got dict"):
        GDN2Layer(D, H, DK, config={"bt": 32}, rngs=nnx.Rngs(0))


def test_flax_installed_but_broken_is_named(tmp_path):
    """A flax that fails to import is reported as such, not as missing."""
    fake = tmp_path / "flax"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('flax built for another jax')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", "import gdn2core.layers"], capture_output=True, text=True, env=env
    )
    assert proc.returncode != 0
    assert "Flax, which is installed but fails to import (ImportError: flax built" in proc.stderr


def test_import_gdn2core_does_not_import_flax():
    code = "import sys, gdn2core; gdn2core.list_backends(); assert 'flax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_mesh_axes_passed_through(ref_backend, monkeypatch):
    """The constructor's mesh axes reach the operator; on a 1-device mesh the result is unchanged
    (the multi-device run is ``tests/examples``' ``train_mqar.py --devices 2``)."""
    from gdn2core.layers import gdn2_layer

    seen = []
    real = gdn2_layer.gdn2_forward_trainable

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(gdn2_layer, "gdn2_forward_trainable", spy)
    mesh = jax.make_mesh((1,), ("data",))
    sharded = _layer(ref_backend.name, mesh=mesh, batch_axes="data", context_axis=None)
    plain = _layer(ref_backend.name)
    x = _x()
    y_sharded, y_plain = sharded(x), plain(x)
    axes = ("mesh", "batch_axes", "head_axes", "context_axis")
    seen = [{name: kw[name] for name in axes} for kw in seen]  # (the fused options aside)
    assert seen[0] == dict(mesh=mesh, batch_axes="data", head_axes=None, context_axis=None)
    assert seen[1] == dict(mesh=None, batch_axes=None, head_axes=None, context_axis=None)
    np.testing.assert_allclose(y_sharded, y_plain, rtol=1e-6, atol=1e-6)
    # static under nnx.jit (the mesh is hashable graph metadata, not a traced leaf)
    np.testing.assert_allclose(
        nnx.jit(lambda m, x: m(x))(sharded, x), y_plain, rtol=1e-5, atol=1e-6
    )


@functools.partial(nnx.jit, static_argnums=3)
def _serve(m, x, cache, decode=None):
    return m(x, cache=cache, decode=decode)


def _served(layer, x, splits, state_dtype=jnp.float32, decode=None):
    """y of ``layer`` fed ``x`` in pieces (``splits``: the cut points) through its cache."""
    cache = layer.init_cache(x.shape[0], state_dtype=state_dtype)
    ys, start = [], 0
    for stop in (*splits, x.shape[1]):
        y, cache = _serve(layer, x[:, start:stop], cache, decode)
        ys.append(y)
        start = stop
    return jnp.concatenate(ys, axis=1), cache


def test_cache_prefill_and_decode_steps_equal_one_call(ref_backend):
    """A prompt of 5, a second prompt of 3, then 4 one-token decode steps: the outputs of one call
    over the 12 tokens (the short convolutions and the state carried in the cache). Both are the
    float32 token-serial reference on the same values, so they agree to rounding: 1e-5."""
    layer = _layer(ref_backend.name, expand_v=2, lift_b=True)
    x = _x(T=12)
    y_full = _apply_state(layer, x)[0]
    y, cache = _served(layer, x, (5, 8, 9, 10, 11))
    np.testing.assert_allclose(y, y_full, rtol=1e-5, atol=1e-5)
    assert cache.state.shape == (2, H, DK, 2 * DK) and cache.conv_q.shape == (2, 3, H * DK)
    np.testing.assert_allclose(cache.state, _apply_state(layer, x)[1], rtol=1e-5, atol=1e-6)


def test_cache_decode_op_for_several_tokens(ref_backend):
    """decode=True runs the decode op on a 3-token step (speculative verification)."""
    layer = _layer(ref_backend.name)
    x = _x(T=9)
    y, _ = _served(layer, x, (6,), decode=True)
    np.testing.assert_allclose(y, _apply_state(layer, x)[0], rtol=1e-5, atol=1e-5)


def test_cache_bfloat16_state_and_no_convolutions(ref_backend):
    """A bfloat16 state keeps its dtype and costs a rounding per call (2e-2 relative); without
    short convolutions the cache holds only the state."""
    layer = _layer(ref_backend.name, conv_size=0)
    x = _x(T=10)
    y_full = _apply_state(layer, x)[0]
    y, cache = _served(layer, x, (6, 7, 8, 9), state_dtype=jnp.bfloat16)
    assert cache.state.dtype == jnp.bfloat16 and cache.conv_q is None
    err = float(jnp.max(jnp.abs(y - y_full)) / jnp.max(jnp.abs(y_full)))
    assert 0 < err <= 2e-2


@pytest.mark.parametrize(
    "key_head_gates", [False, True], ids=["value-head-gates", "key-head-gates"]
)
def test_cache_with_grouped_value_heads(ref_backend, key_head_gates):
    """num_v_heads = 2 H (b, g on value heads, or on key heads): prefill and one-token decode steps
    (the decode op with the layer's fused options, applied by the core in XLA) equal one call
    (the reference applying them token by token): 1e-5, as above."""
    layer = _layer(ref_backend.name, num_v_heads=2 * H, key_head_gates=key_head_gates)
    x = _x(T=9)
    y_full, h_full = _apply_state(layer, x)
    y, cache = _served(layer, x, (6, 7, 8))
    assert cache.state.shape == (2, 2 * H, DK, DK)
    np.testing.assert_allclose(y, y_full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cache.state, h_full, rtol=1e-5, atol=1e-6)


def test_cache_refuses_h0(ref_backend):
    layer = _layer(ref_backend.name)
    with pytest.raises(ValueError, match="cache: the cache holds the state"):
        layer(_x(T=2), h0=jnp.zeros((2, H, DK, DK)), cache=layer.init_cache(2))
    ids = jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(ValueError, match="pass none of .* got segment_ids"):
        layer(_x(T=2), segment_ids=ids, cache=layer.init_cache(2))
