"""Sorted-array lookups for the index arithmetic around the kernels.

``jnp.searchsorted``'s default method is a ``while`` loop of ``log2(n)`` binary-search steps: on
a TPU one small XLA op per step, each about 1-3 us whatever the sizes (TPU compiler static
estimate, v5e: the ragged step's 256 decodes spent 71 us in one such loop over 256 tokens, 7%
of the step). Comparing every value with every edge is one fused op and, for the sizes of a
serving step, cheaper; above :data:`COMPARE_ALL_MAX` comparisons the steps are unrolled instead
(no loop, the same ``log2(n)`` ops).
"""

from __future__ import annotations

from typing import Final

import jax
import jax.numpy as jnp

#: Most comparisons (edges times values) done at once.
COMPARE_ALL_MAX: Final = 1 << 24


def count_at_most(edges: jax.Array, values: jax.Array) -> jax.Array:
    """``jnp.searchsorted(edges, values, side="right")`` as int32 (module docstring for the
    method).

    Args:
        edges: ``[n]`` sorted (ascending; repeats allowed).
        values: ``[m]`` any.

    Returns:
        ``[m]`` int32: for each value, how many of the edges are ``<= value``.
    """
    method = "compare_all" if edges.size * values.size <= COMPARE_ALL_MAX else "scan_unrolled"
    return jnp.searchsorted(edges, values, side="right", method=method).astype(jnp.int32)
