"""The blocked WY inverse in isolation, against jnp.linalg.inv in float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_jax_ref.wy import wy_inverse


def strictly_lower(rng, lead, C, scale):
    a = scale * rng.standard_normal((*lead, C, C))
    return jnp.asarray(np.tril(a, -1))


@pytest.mark.parametrize(
    ("C", "mb", "wy_eps"),
    [(16, 4, 0.0), (64, 16, 0.0), (24, 8, 1e-3), (8, 8, 0.0), (12, 1, 0.25)],
)
def test_wy_inverse_matches_dense_inverse(x64, C, mb, wy_eps):
    rng = np.random.default_rng(C + mb)
    # Entries of size 0.3: well conditioned, so any error is the algorithm's, not conditioning.
    A_kk = strictly_lower(rng, (3, 2), C, 0.3)  # [3, 2, C, C] f64
    T = jax.jit(wy_inverse, static_argnums=(1, 2))(A_kk, mb, wy_eps)
    M = (1.0 + wy_eps) * jnp.eye(C) + A_kk
    expected = jnp.linalg.inv(M)
    # float64 and |T| = O(1): a correct blocked inverse differs from LU by rounding only (~1e-15);
    # a wrong block (sign, transposition, missing term) gives O(0.1).
    assert float(jnp.max(jnp.abs(T - expected))) < 1e-12
    assert float(jnp.max(jnp.abs(jnp.triu(T, 1)))) == 0.0  # lower triangular by construction


def test_wy_eps_acts_on_the_diagonal_only(x64):
    rng = np.random.default_rng(7)
    A_kk = strictly_lower(rng, (2,), 16, 0.3)
    T = wy_inverse(A_kk, 4, 0.5)
    # T = ((1 + eps) I + A)^-1 has diagonal exactly 1 / (1 + eps).
    np.testing.assert_allclose(
        np.diagonal(np.asarray(T), axis1=-2, axis2=-1), 1.0 / 1.5, rtol=1e-15
    )


def test_wy_rejects_a_partial_micro_block():
    with pytest.raises(ValueError, match="micro-block"):
        wy_inverse(jnp.zeros((10, 10)), 4, 0.0)
