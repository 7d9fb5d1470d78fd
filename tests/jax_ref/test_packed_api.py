"""jax_ref's packed sequences through the public functions (the core's extras= path), against
the core's token-serial reference with the same keywords; with grouped value heads and fused
activations (both resolved by the core) on top.

Errors are ``rel = max|actual - expected| / max|expected|`` (gdn2_conformance.rel_err).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_conformance import rel_err
from gdn2_jax_ref.backend import JaxRefBackend
from gdn2_jax_ref.config import JaxRefConfig
from gdn2core import gdn2_forward, gdn2_forward_trainable, gdn2_token_serial_reference

CONFIG = JaxRefConfig(bt=8, bc=4, wy_block=2)
# float64 against float64: rounding only (docs/algorithm.md 8 measures <= 2.5e-14).
TOL_F64 = 1e-10


def inputs(T, H, HV, dk, dv, L, seed):
    """float64 q, k, b, g with H heads, v, w with HV heads, h0 with L leading rows; cotangents."""
    rng = np.random.default_rng(seed)

    def n(*s):
        return jnp.asarray(rng.standard_normal(s))

    q, k = (
        x / jnp.linalg.norm(x, axis=-1, keepdims=True) for x in (n(1, T, H, dk), n(1, T, H, dk))
    )
    v, w = n(1, T, HV, dv), jax.nn.sigmoid(n(1, T, HV, dv))
    b, g = 2.0 * jax.nn.sigmoid(n(1, T, H, dk)), -jax.nn.softplus(n(1, T, H, dk) - 1.0)
    return (q, k, v, w, b, g), 0.5 * n(L, HV, dk, dv), (n(1, T, HV, dv), n(L, HV, dk, dv))


@functools.cache
def grad_fn(which: str, keywords: tuple):
    kw = dict(keywords)

    def loss(args, packing, do, dh):
        *xs, h0 = args
        if which == "reference":
            o, h = gdn2_token_serial_reference(*xs, None, h0, **packing, **kw)
        else:
            o, h = gdn2_forward_trainable(*xs, None, h0, CONFIG, "jax_ref", **packing, **kw)
        return jnp.sum(o * do) + jnp.sum(h * dh), (o, h)

    return jax.jit(jax.grad(loss, has_aux=True))


PACKINGS = {
    "segment_ids": lambda: {"segment_ids": jnp.asarray([[3] * 5 + [1] + [3] * 10 + [4] * 15])},
    "cu_seqlens": lambda: {"cu_seqlens": jnp.asarray([0, 5, 6, 6, 16, 31])},
}
FEATURES = {
    "plain": ((), 2),
    "gva": ((), 4),
    "gva+gates": (
        (("use_qk_l2norm_in_kernel", True), ("use_bw_sigmoid_in_kernel", True)),
        4,
    ),
}


@pytest.mark.parametrize("features", FEATURES, ids=str)
@pytest.mark.parametrize("packing", PACKINGS, ids=str)
def test_public_trainable_matches_reference_f64(x64, packing, features):
    keywords, HV = FEATURES[features]
    pack = PACKINGS[packing]()
    L = 5 if packing == "cu_seqlens" else 1
    args, h0, (do, dh) = inputs(31, 2, HV, 8, 6, L, seed=len(features))
    g_ours, (o, h) = grad_fn("jax_ref", keywords)((*args, h0), pack, do, dh)
    g_ref, (o_ref, h_ref) = grad_fn("reference", keywords)((*args, h0), pack, do, dh)
    assert o.shape == o_ref.shape and h.shape == (L, HV, 8, 6)
    assert rel_err(o, o_ref) < TOL_F64 and rel_err(h, h_ref) < TOL_F64
    for name, a, e in zip(["q", "k", "v", "w", "b", "g", "h0"], g_ours, g_ref, strict=True):
        assert rel_err(a, e) < TOL_F64, (name, rel_err(a, e))


@pytest.mark.parametrize("packing", PACKINGS, ids=str)
def test_public_forward_equals_trainable_under_jit(packing):
    pack = PACKINGS[packing]()
    L = 5 if packing == "cu_seqlens" else 1
    args, h0, _ = inputs(31, 2, 2, 8, 6, L, seed=1)
    args = tuple(x.astype(jnp.float32) for x in args)
    h0 = h0.astype(jnp.float32)
    fwd = jax.jit(lambda a, h, p: gdn2_forward(*a, None, h, CONFIG, "jax_ref", **p))
    train = jax.jit(lambda a, h, p: gdn2_forward_trainable(*a, None, h, CONFIG, "jax_ref", **p))
    o, hf = fwd(args, h0, pack)
    o_t, hf_t = train(args, h0, pack)
    # The two entry points run the same forward arithmetic.
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_t))
    np.testing.assert_array_equal(np.asarray(hf), np.asarray(hf_t))


def test_capabilities():
    caps = JaxRefBackend.capabilities
    assert caps.segments and caps.varlen and not caps.fused_activations
