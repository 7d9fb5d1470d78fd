"""Deterministic benchmark inputs, generated with NumPy so that a peer (e.g. the fla script in
``benchmarks/peers``) can build bit-identical arrays without JAX.

The distributions are those a GDN-2 layer feeds the operator (see ``gdn2core.layers``): q ~ N(0, 1)
L2-normalised per head, k likewise, v ~ N(0, 1), gates ``w, b = sigmoid(N(0, 1))``, and the decay
``g = -A * softplus(N(0, 1) + dt_bias)`` with ``A ~ U(1, 16)`` per head and ``dt_bias`` the inverse
softplus of a log-uniform step in ``[1e-3, 1e-1]`` per key channel (g in about [-10, 0)).
``h0 ~ 0.1 N(0, 1)``. Cotangents: ``do ~ N(0, 1)``, ``dh ~ 0.1 N(0, 1)``.
"""

from __future__ import annotations

import numpy as np

from gdn2core.bench.shapes import BenchShape

INPUT_NAMES = ("q", "k", "v", "w", "b", "g")
GRAD_NAMES = ("dq", "dk", "dv", "dw", "db", "dg", "dh0")


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _l2(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def make_inputs_np(shape: BenchShape, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 NumPy arrays ``q, k, v, w, b, g, h0`` (public layout) for ``shape``."""
    rng = np.random.default_rng([seed, *shape.as_dict().values()])
    B, T, H, dk, dv = shape.B, shape.T, shape.H, shape.dk, shape.dv
    kshape, vshape = (B, T, H, dk), (B, T, H, dv)

    def normal(s):
        return rng.standard_normal(s, dtype=np.float32)

    q = _l2(normal(kshape))
    k = _l2(normal(kshape))
    v = normal(vshape)
    w = _sigmoid(normal(vshape))
    b = _sigmoid(normal(kshape))
    A = rng.uniform(1.0, 16.0, size=(H, 1)).astype(np.float32)
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), size=(H, dk))).astype(np.float32)
    dt_bias = dt + np.log(-np.expm1(-dt))
    g = -A * _softplus(normal(kshape) + dt_bias)
    h0 = 0.1 * normal((B, H, dk, dv))
    out = {"q": q, "k": k, "v": v, "w": w, "b": b, "g": g, "h0": h0}
    return {n: np.ascontiguousarray(a, dtype=np.float32) for n, a in out.items()}


def make_cotangents_np(shape: BenchShape, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 cotangents ``do`` ``(B, T, H, dv)`` and ``dh`` ``(B, H, dk, dv)``."""
    rng = np.random.default_rng([seed + 1, *shape.as_dict().values()])
    do = rng.standard_normal((shape.B, shape.T, shape.H, shape.dv), dtype=np.float32)
    dh = 0.1 * rng.standard_normal((shape.B, shape.H, shape.dk, shape.dv), dtype=np.float32)
    return {"do": do, "dh": dh}


def make_inputs(shape: BenchShape, dtype: str, seed: int = 0):
    """JAX arrays: ``(xs, h0, cts)``: the six inputs in ``dtype``, float32 h0, and the cotangents
    ``(do in dtype, dh float32)``."""
    import jax.numpy as jnp

    arrays = make_inputs_np(shape, seed)
    cts = make_cotangents_np(shape, seed)
    xs = tuple(jnp.asarray(arrays[n], dtype=dtype) for n in INPUT_NAMES)
    h0 = jnp.asarray(arrays["h0"], dtype=jnp.float32)
    return xs, h0, (jnp.asarray(cts["do"], dtype=dtype), jnp.asarray(cts["dh"], jnp.float32))
