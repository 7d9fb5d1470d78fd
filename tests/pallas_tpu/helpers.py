"""Shared inputs, loss and tolerances of the pallas_tpu tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gdn2core import gdn2_token_serial_reference

GRAD_NAMES = ("q", "k", "v", "w", "b", "g", "h0")

#: Tolerances on max|x - ref| / max|ref| (ref: token-serial float32 reference of the same inputs).
#: float32: the kernels reassociate the serial recurrence (chunked WY form, matmul cumsums); the
#: measured error is ~1e-6 (ALGORITHM.md 5.4 reports 2e-6..1e-5 for fp32), 1e-4 leaves margin for
#: other platforms' summation orders.
#: bfloat16: every computation is float32, so the error is the final rounding of o and the six
#: token gradients to bfloat16 (relative 2^-8 = 3.9e-3 per element), and for all gradients the
#: rounding of the o cotangent, which JAX hands over in o's dtype (bfloat16). h_final is float32
#: computed from the same bfloat16 inputs as the reference: float32 tolerance.
TOL = {
    "float32": {"o": 1e-4, "h_final": 1e-4, "grad": 1e-4},
    "bfloat16": {"o": 1e-2, "h_final": 1e-4, "grad": 1e-2},
}


def make_inputs(B, T, H, dk, dv, dtype, *, seed=0, strong=0.1, b_max=2.0, with_h0=True):
    """L2-normalised keys, g = log(sigmoid(.)) with a fraction ``strong`` of entries at -30,
    b in (0, b_max), w in (0, 1)."""
    r = np.random.default_rng(seed)
    q = r.standard_normal((B, T, H, dk))
    k = r.standard_normal((B, T, H, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = r.standard_normal((B, T, H, dv))
    w = 1.0 / (1.0 + np.exp(-r.standard_normal((B, T, H, dv))))
    b = b_max / (1.0 + np.exp(-r.standard_normal((B, T, H, dk))))
    g = -np.logaddexp(0.0, -(2.0 * r.standard_normal((B, T, H, dk)) + 1.0))
    g[r.random(g.shape) < strong] = -30.0
    h0 = 0.5 * r.standard_normal((B, H, dk, dv)) if with_h0 else np.zeros((B, H, dk, dv))
    do = r.standard_normal((B, T, H, dv))
    dh = r.standard_normal((B, H, dk, dv))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    args = (*(cast(x) for x in (q, k, v, w, b, g)), f32(h0))
    return args, f32(do), f32(dh)


def outputs_and_grads(fn, args, do, dh):
    """One jit: ``fn``'s (o, h_final) and the seven gradients of sum(o*do) + sum(h_final*dh)."""

    def run(args, do, dh):
        (o, h_final), vjp = jax.vjp(fn, *args)
        grads = vjp((do.astype(o.dtype), dh))
        return o, h_final, grads

    return jax.jit(run)(args, do, dh)


def reference_value_and_grad(args, do, dh):
    """Outputs and the seven gradients of the float32 token-serial reference."""
    args32 = tuple(x.astype(jnp.float32) for x in args)

    def fn(q, k, v, w, b, g, h0):
        return gdn2_token_serial_reference(q, k, v, w, b, g, None, h0)

    return outputs_and_grads(fn, args32, do, dh)


def rel_err(x, ref) -> float:
    x = np.asarray(jnp.asarray(x, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    return float(np.max(np.abs(x - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
