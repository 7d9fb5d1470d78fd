"""Random GDN-2 inputs for tests, with the knobs the conformance suite sweeps."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    """One input configuration. ``decay``: "weak" (g near 0), "mixed" (typical model gates) or
    "strong" (10% of tokens at g = -30 per channel, the rest mixed)."""

    B: int = 1
    T: int = 24
    H: int = 2
    dk: int = 8
    dv: int = 8
    h0: bool = True
    b_max: float = 1.0
    decay: str = "mixed"
    seed: int = 0

    @property
    def id(self) -> str:
        h0 = "h0" if self.h0 else "noh0"
        return (
            f"B{self.B}T{self.T}H{self.H}k{self.dk}v{self.dv}-{h0}-b{self.b_max:g}-{self.decay}"
            f"-s{self.seed}"
        )


@dataclasses.dataclass(frozen=True)
class Inputs:
    q: jax.Array
    k: jax.Array
    v: jax.Array
    w: jax.Array
    b: jax.Array
    g: jax.Array
    h0: jax.Array | None
    do: jax.Array  # cotangent of o
    dh: jax.Array  # cotangent of h_final

    @property
    def args(self) -> tuple[jax.Array, ...]:
        return (self.q, self.k, self.v, self.w, self.b, self.g)

    def astype(self, dtype) -> Inputs:
        """q..g in ``dtype``; h0 and the cotangents stay in their own (float) dtype."""
        cast = {n: getattr(self, n).astype(dtype) for n in ("q", "k", "v", "w", "b", "g")}
        return dataclasses.replace(self, **cast)


def make_inputs(case: Case, dtype=jnp.float32) -> Inputs:
    """L2-normalised q and k (as models do), sigmoid gates, log decays per ``case.decay``."""
    rng = np.random.default_rng(case.seed)
    B, T, H, dk, dv = case.B, case.T, case.H, case.dk, case.dv
    acc = np.float64 if jnp.dtype(dtype) == jnp.float64 else np.float32

    def normal(*shape):
        return rng.standard_normal(shape)

    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    q = normal(B, T, H, dk)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k = normal(B, T, H, dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = normal(B, T, H, dv)
    w = sigmoid(normal(B, T, H, dv))
    b = case.b_max * sigmoid(normal(B, T, H, dk))
    if case.decay == "weak":
        g = -1e-3 * sigmoid(normal(B, T, H, dk))
    else:
        g = -np.log1p(np.exp(normal(B, T, H, dk) - 1.0))  # -softplus(x - 1), about -0.3
        if case.decay == "strong":
            g = np.where(rng.random((B, T, H, 1)) < 0.1, -30.0, g)
    h0 = 0.5 * normal(B, H, dk, dv) if case.h0 else None
    do = normal(B, T, H, dv)
    dh = normal(B, H, dk, dv)

    def arr(x, dt=dtype):
        return None if x is None else jnp.asarray(x.astype(acc), dtype=dt)

    return Inputs(
        q=arr(q),
        k=arr(k),
        v=arr(v),
        w=arr(w),
        b=arr(b),
        g=arr(g),
        h0=arr(h0, acc),
        do=arr(do, acc),
        dh=arr(dh, acc),
    )


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected| (0/0 -> 0), in float64."""
    a = np.asarray(jnp.asarray(actual, jnp.float32) if actual.dtype == jnp.bfloat16 else actual)
    e = np.asarray(expected, dtype=np.float64)
    a = a.astype(np.float64)
    scale = np.max(np.abs(e))
    diff = np.max(np.abs(a - e)) if a.size else 0.0
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(diff / scale) if scale > 0 else float(diff)
