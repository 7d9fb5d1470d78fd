"""Benchmark inputs: the kit's one generator (:mod:`gdn2core.testing.inputs`) at a bench shape,
with the decay a GDN-2 layer produces (``Decay.MODEL``)."""

from __future__ import annotations

import jax.numpy as jnp

from gdn2_tools.bench.shapes import BenchShape
from gdn2core.testing import GRAD_NAMES, Case, Decay
from gdn2core.testing import make_inputs as kit_inputs

__all__ = ["GRAD_NAMES", "bench_case", "make_inputs"]


def bench_case(shape: BenchShape, seed: int = 0) -> Case:
    """The kit's case for a bench shape.

    Args:
        shape: the bench shape.
        seed: the input seed.

    Returns:
        A :class:`~gdn2core.testing.Case` with model-like decay and an initial state.
    """
    return Case(
        B=shape.B, T=shape.T, H=shape.H, dk=shape.dk, dv=shape.dv, decay=Decay.MODEL, seed=seed
    )


def make_inputs(shape: BenchShape, dtype: str, seed: int = 0):
    """JAX inputs of one bench row.

    Args:
        shape: the bench shape.
        dtype: the input dtype.
        seed: the input seed.

    Returns:
        ``(xs, h0, cts)``: the six inputs in ``dtype``, float32 h0, and the cotangents
        ``(do in dtype, dh float32)``.
    """
    x = kit_inputs(bench_case(shape, seed), jnp.dtype(dtype))
    return x.args, x.h0_or_zeros, (x.do.astype(dtype), x.dh)
