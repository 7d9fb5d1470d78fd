"""The token-serial checks: a backend's outputs and gradients next to the reference's.

Every gradient in gdn2 is of the same loss, ``sum(o * do) + sum(h_final * dh)`` (cotangents on both
outputs), in all seven arguments q, k, v, w, b, g, h0.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from gdn2core.reference import gdn2_token_serial_reference
from gdn2core.testing.inputs import Inputs

OpFn = Callable[..., tuple[jax.Array, jax.Array]]


def cotangent_loss(o: jax.Array, h_final: jax.Array, do: jax.Array, dh: jax.Array) -> jax.Array:
    """``sum(o * do) + sum(h_final * dh)`` in the state dtype.

    Args:
        o, h_final: the operator's outputs.
        do, dh: their cotangents.

    Returns:
        The scalar loss whose gradients are the vector-Jacobian products for ``(do, dh)``.
    """
    acc = h_final.dtype
    return jnp.sum(o.astype(acc) * do.astype(acc)) + jnp.sum(h_final * dh.astype(acc))


def outputs_and_grads(fn: OpFn, x: Inputs) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """``fn``'s outputs and the seven gradients of :func:`cotangent_loss`, in one jit.

    Args:
        fn: ``fn(q, k, v, w, b, g, h0) -> (o, h_final)``.
        x: the inputs and cotangents (a missing h0 is passed as zeros).

    Returns:
        ``(o, h_final, (dq, dk, dv, dw, db, dg, dh0))``.
    """

    def run(args, do, dh):
        (o, h), vjp = jax.vjp(fn, *args)
        return o, h, vjp((do.astype(o.dtype), dh.astype(h.dtype)))

    return jax.jit(run)((*x.args, x.h0_or_zeros), x.do, x.dh)


def reference(q, k, v, w, b, g, h0):
    """The token-serial reference with the default scale, in the positional form of ``fn``.

    Args:
        q, k, v, w, b, g, h0: the operator's inputs.

    Returns:
        ``(o, h_final)``.
    """
    return gdn2_token_serial_reference(q, k, v, w, b, g, None, h0)


def reference_outputs_and_grads(x: Inputs):
    """The ground truth for ``x``: the reference on the same input values, computed in the state
    dtype (a bfloat16 call is judged against float32 arithmetic on its bfloat16 values), at the
    highest matmul precision.

    Args:
        x: the inputs and cotangents.

    Returns:
        As :func:`outputs_and_grads`.
    """
    acc = x.dh.dtype
    wide = x.astype(acc)
    with jax.default_matmul_precision("highest"):
        return outputs_and_grads(reference, wide)
