"""Benchmark inputs: the kit's one generator (:mod:`gdn2_conformance.inputs`) at a bench shape,
with the decay a GDN-2 layer produces (``Decay.MODEL``).

Grouped value heads (``shape.HV``): the kit's inputs at HV heads, of which q, k, b, g keep the
first head of each group (b and g on the key heads); packed rows (``shape.seqs``): the
``segment_ids`` of :func:`make_options`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from gdn2_conformance import GRAD_NAMES, Case, Decay
from gdn2_conformance import make_inputs as kit_inputs
from gdn2_tools.bench.shapes import BenchShape

__all__ = ["GRAD_NAMES", "bench_case", "make_inputs", "make_options"]


def bench_case(shape: BenchShape, seed: int = 0, decay: Decay = Decay.MODEL) -> Case:
    """The kit's case for a bench shape.

    Args:
        shape: the bench shape.
        seed: the input seed.
        decay: the log decays' distribution (model-like unless a tool asks for another).

    Returns:
        A :class:`~gdn2_conformance.Case` with that decay and an initial state.
    """
    H = shape.value_heads
    return Case(B=shape.B, T=shape.T, H=H, dk=shape.dk, dv=shape.dv, decay=decay, seed=seed)


def make_inputs(shape: BenchShape, dtype: str, seed: int = 0, decay: Decay = Decay.MODEL):
    """JAX inputs of one bench row.

    Args:
        shape: the bench shape.
        dtype: the input dtype.
        seed: the input seed.
        decay: the log decays' distribution (:func:`bench_case`).

    Returns:
        ``(xs, h0, cts)``: the six inputs in ``dtype``, float32 h0, and the cotangents
        ``(do in dtype, dh float32)``.
    """
    x = kit_inputs(bench_case(shape, seed, decay), jnp.dtype(dtype))
    xs = x.args
    if shape.HV:
        step = shape.HV // shape.H  # value heads per key head
        q, k, v, w, b, g = xs
        xs = (q[:, :, ::step], k[:, :, ::step], v, w, b[:, :, ::step], g[:, :, ::step])
    return xs, x.h0_or_zeros, (x.do.astype(dtype), x.dh)


def make_options(shape: BenchShape, seed: int = 0) -> dict:
    """The row's non-differentiable keywords: ``segment_ids`` ``(B, T)`` int32 for a packed shape
    (``seqs`` sequences per row, starts drawn at random per row, so anywhere in a chunk), else
    none.

    Args:
        shape: the bench shape.
        seed: the seed.

    Returns:
        ``{}`` or ``{"segment_ids": ...}``.
    """
    if shape.seqs == 1:
        return {}
    rng = np.random.default_rng(seed + 1)
    starts = np.zeros((shape.B, shape.T), np.int32)
    for row in starts:
        row[rng.choice(np.arange(1, shape.T), shape.seqs - 1, replace=False)] = 1
    return {"segment_ids": jnp.asarray(np.cumsum(starts, axis=1, dtype=np.int32))}
