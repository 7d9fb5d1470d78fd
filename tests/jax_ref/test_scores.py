"""Decay-safe scores and their backward contractions, against a direct pairwise einsum."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_jax_ref import scores
from gdn2_jax_ref.scores import PAIRWISE_LEAF


@functools.partial(jax.jit, static_argnums=(4, 5))
def all_four(X, Y, P, G, c, leaf):
    """Strict and inclusive Score, rho and kappa in one compiled call (compile time dominates)."""
    return (
        scores.score(X, Y, G, c, 60.0, True, leaf),
        scores.score(X, Y, G, c, 60.0, False, leaf),
        scores.score_rho(P, Y, G, c, 60.0, leaf),
        scores.score_kappa(P, X, G, c, 60.0, leaf),
    )


def direct_decay(G, strict):
    """exp(G_r - G_s) over the whole chunk, masked to -inf before the exp: [..., C, C, K]."""
    C = G.shape[-2]
    keep = jnp.tril(jnp.ones((C, C), bool), -1 if strict else 0)[:, :, None]
    return jnp.exp(jnp.where(keep, G[..., :, None, :] - G[..., None, :, :], -jnp.inf))


def make(rng, C, K, g_scale, dtype):
    X = jnp.asarray(rng.standard_normal((2, C, K)), dtype)
    Y = jnp.asarray(rng.standard_normal((2, C, K)), dtype)
    P = jnp.asarray(np.tril(rng.standard_normal((2, C, C))), dtype)
    g = -g_scale * rng.random((2, C, K))
    return X, Y, P, jnp.cumsum(jnp.asarray(g, dtype), axis=-2)


# (C, c, leaf): leaf = c is the plain pairwise diagonal; smaller leaves recurse (exactly).
BLOCKINGS = [(16, 8, 8), (16, 8, 2), (64, 32, PAIRWISE_LEAF), (24, 12, 3), (8, 4, 1)]


@pytest.mark.parametrize(("C", "c", "leaf"), BLOCKINGS)
def test_scores_match_direct_einsum(x64, C, c, leaf):
    rng = np.random.default_rng(C + c + leaf)
    X, Y, P, G = make(rng, C, 8, 0.5, jnp.float64)  # mild decay: the direct form is accurate
    D_strict, D_incl = direct_decay(G, True), direct_decay(G, False)
    want = (
        jnp.einsum("...rk,...sk,...rsk->...rs", X, Y, D_strict),
        jnp.einsum("...rk,...sk,...rsk->...rs", X, Y, D_incl),
        jnp.einsum("...rs,...sk,...rsk->...rk", P, Y, D_incl),
        jnp.einsum("...rs,...rk,...rsk->...sk", P, X, D_incl),
    )
    got = all_four(X, Y, P, G, c, leaf)
    for name, a, e in zip(("strict", "inclusive", "rho", "kappa"), got, want, strict=True):
        # float64 with O(1) terms: only rounding separates the two evaluation orders (1e-12
        # leaves headroom over ~1e-15); a wrong reference row or mask is an O(1) error.
        assert float(jnp.max(jnp.abs(a - e))) < 1e-12, name


@pytest.mark.parametrize("leaf", [PAIRWISE_LEAF, 32])
def test_scores_finite_and_exact_at_g_minus_50(x64, leaf):
    """float32 with g = -50 per token: |gamma_cum| reaches 3200 in a chunk of 64, so any exp of a
    positive, chunk-growing exponent would overflow. The result must stay finite and match the
    float64 direct form (which masks before the exp, so it is safe too)."""
    rng = np.random.default_rng(3)
    C, c, K = 64, 32, 16
    X, Y, P, _ = make(rng, C, K, 0.0, jnp.float64)
    g = np.full((2, C, K), -50.0)
    g[:, ::3, :] = -0.01  # some weak steps too, so off-diagonal terms are not all zero
    G64 = jnp.cumsum(jnp.asarray(g), axis=-2)
    D = direct_decay(G64, False)
    want = {
        "score": jnp.einsum("...rk,...sk,...rsk->...rs", X, Y, D),
        "rho": jnp.einsum("...rs,...sk,...rsk->...rk", P, Y, D),
        "kappa": jnp.einsum("...rs,...rk,...rsk->...sk", P, X, D),
    }
    f32 = [x.astype(jnp.float32) for x in (X, Y, P)]
    G32 = jnp.cumsum(jnp.asarray(g, jnp.float32), axis=-2)
    got = dict(zip(("score", "rho", "kappa"), all_four(*f32, G32, c, leaf)[1:], strict=True))
    for name, value in got.items():
        assert bool(jnp.all(jnp.isfinite(value))), name
        ref = want[name]
        # float32 rounding of gamma_cum (|G| ~ 3e3, ulp ~2.4e-4) perturbs each surviving decay
        # factor by up to ~1e-3 relative; 1e-2 of the largest entry still fails on any O(1) error.
        err = float(jnp.max(jnp.abs(value - ref)) / jnp.max(jnp.abs(ref)))
        assert err < 1e-2, (name, err)


def test_naive_split_would_overflow():
    """The failure these functions avoid, so the strong-decay test above can fail: the paper-style
    split exp(G_r) * exp(-G_s) at the same decays is not finite in float32."""
    G = jnp.cumsum(jnp.full((64, 4), -50.0, jnp.float32), axis=0)
    naive = jnp.exp(G)[:, None, :] * jnp.exp(-G)[None, :, :]
    assert not bool(jnp.all(jnp.isfinite(naive)))


def test_scores_under_jit_and_vmap():
    rng = np.random.default_rng(5)
    X, Y, _, G = make(rng, 16, 4, 0.5, jnp.float32)
    direct = jax.jit(lambda x, y, g: scores.score(x, y, g, 8, 60.0, True))(X, Y, G)
    batched = jax.jit(jax.vmap(lambda x, y, g: scores.score(x, y, g, 8, 60.0, True)))(X, Y, G)
    # Same float32 arithmetic, batching only: equal to rounding.
    np.testing.assert_allclose(np.asarray(batched), np.asarray(direct), rtol=1e-5, atol=1e-6)
