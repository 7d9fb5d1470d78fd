"""``gdn2core.indexing.count_at_most`` against NumPy's ``searchsorted(..., side="right")``, on
both of its methods (all comparisons at once, and the unrolled binary search above
``COMPARE_ALL_MAX`` comparisons), eagerly and under ``jax.jit``: exact integers, no tolerance.
Edges with repeats, values below, between, on and above them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2core import indexing
from gdn2core.plugin import count_at_most


@pytest.mark.parametrize("method_limit", [indexing.COMPARE_ALL_MAX, 0], ids=["compare", "unrolled"])
@pytest.mark.parametrize("n, m", [(1, 7), (9, 100), (257, 1000)])
def test_count_at_most_is_searchsorted_right(monkeypatch, method_limit, n, m):
    monkeypatch.setattr(indexing, "COMPARE_ALL_MAX", method_limit)
    rng = np.random.default_rng(n * 1000 + m)
    edges = np.sort(rng.integers(0, 50, n)).astype(np.int32)  # repeats likely
    values = np.concatenate([edges, rng.integers(-3, 54, m)]).astype(np.int32)
    want = np.searchsorted(edges, values, side="right")
    got = count_at_most(jnp.asarray(edges), jnp.asarray(values))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), want)
    jitted = jax.jit(count_at_most)(jnp.asarray(edges), jnp.asarray(values))
    np.testing.assert_array_equal(np.asarray(jitted), want)


@pytest.mark.parametrize("method_limit", [indexing.COMPARE_ALL_MAX, 0], ids=["compare", "unrolled"])
def test_count_at_most_has_no_loop(monkeypatch, method_limit):
    """Neither method lowers to a ``while`` loop (``jnp.searchsorted``'s default does: on a TPU an
    XLA op per binary-search step)."""
    monkeypatch.setattr(indexing, "COMPARE_ALL_MAX", method_limit)
    edges, values = jnp.arange(256, dtype=jnp.int32), jnp.arange(300, dtype=jnp.int32)
    lowered = jax.jit(count_at_most).lower(edges, values).as_text()
    assert "while" not in lowered
    default = jax.jit(jnp.searchsorted).lower(edges, values).as_text()
    assert "while" in default  # the check above can fail
