"""The token-serial checks: a backend's outputs and gradients next to the reference's.

Every gradient in gdn2 is of the same loss, ``sum(o * do) + sum(h_final * dh)`` (cotangents on both
outputs), in all seven arguments q, k, v, w, b, g, h0 (and the gate parameters A_log, dt_bias of a
fused gate: :attr:`Inputs.diff_args`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from gdn2_conformance.inputs import GRAD_NAMES, DecodeInputs, Inputs
from gdn2core.ops.decode.reference import gdn2_decode_reference
from gdn2core.ops.forward.reference import gdn2_token_serial_reference

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
    """``fn``'s outputs and the gradients of :func:`cotangent_loss`, in one jit.

    Args:
        fn: ``fn(*x.diff_args) -> (o, h_final)``: ``fn(q, k, v, w, b, g, h0)``, then the gate
            parameters present (see :func:`op_function`).
        x: the inputs and cotangents (a missing h0 is passed as zeros).

    Returns:
        ``(o, h_final, grads)``: ``(dq, dk, dv, dw, db, dg, dh0)``, then ``dA_log``,
        ``ddt_bias`` when present (labels: :attr:`Inputs.grad_names`).
    """

    return _jitted_vjp(fn)(x.diff_args, x.do, x.dh)


@functools.lru_cache(maxsize=16)
def _jitted_vjp(fn: OpFn):
    """One jitted program per ``fn`` (the same function on new inputs of the same shapes, e.g. a
    perturbed copy, reuses the compiled program)."""

    def run(args, do, dh):
        (o, h), vjp = jax.vjp(fn, *args)
        return o, h, vjp((do.astype(o.dtype), dh.astype(h.dtype)))

    return jax.jit(run)


def op_function(op: Callable, x: Inputs, **kwargs) -> OpFn:
    """``op`` (a public function's signature) as ``fn(*x.diff_args)``, with ``x.options`` (segment
    ids, cu_seqlens, activation flags) and ``kwargs`` (backend, config...) fixed.

    Args:
        op: ``gdn2_forward``, ``gdn2_forward_trainable`` or ``gdn2_token_serial_reference``.
        x: the inputs whose options and gate parameters the function takes.
        kwargs: more keywords for every call.

    Returns:
        ``fn(q, k, v, w, b, g, h0, *params) -> (o, h_final)``.
    """
    names = x.param_names

    def fn(q, k, v, w, b, g, h0, *params):
        gate = dict(zip(names, params, strict=True))
        return op(q, k, v, w, b, g, h0=h0, **x.options, **gate, **kwargs)

    return fn


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
        return outputs_and_grads(op_function(gdn2_token_serial_reference, wide), wide)


def reference_outputs(x: Inputs) -> tuple[jax.Array, jax.Array]:
    """The reference's ``(o, h_final)`` for ``x`` as :func:`reference_outputs_and_grads` computes
    them, without the gradients.

    Args:
        x: the inputs.

    Returns:
        ``(o, h_final)``.
    """
    wide = x.astype(x.dh.dtype)
    with jax.default_matmul_precision("highest"):
        return jax.jit(op_function(gdn2_token_serial_reference, wide))(*wide.diff_args)


def check_central_differences(
    loss: Callable, primals, *, seed: int = 7, eps: float = 1e-6, names=None, rtol: float = 1e-6
):
    """Directional derivatives of ``loss`` (float64) against its autodiff gradients.

    For each argument, a random direction ``d``: the central difference
    ``(loss(x + eps d) - loss(x - eps d)) / 2 eps`` must equal ``<grad, d>`` to ``rtol`` relative
    (truncation is O(eps^2) ~ 1e-12 and rounding ~ 1e-16 / eps = 1e-10 of |loss|, far below; any
    wrong term is O(1)). Needs ``jax_enable_x64``.

    Args:
        loss: ``loss(*primals) -> scalar`` (e.g. ``loss(q, k, v, w, b, g, h0)``).
        primals: the float64 arguments.
        seed: the directions' seed.
        eps: the step.
        names: the gradients' labels (default: :data:`GRAD_NAMES`, then ``d1``, ``d2``...).
        rtol: the tolerance, relative to ``max(1, |<grad, d>|)``.

    Raises:
        AssertionError: naming the gradient whose derivative disagrees.
    """
    loss = jax.jit(loss)
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(primals)))))(*primals)
    rng = np.random.default_rng(seed)
    names = names or (*GRAD_NAMES, *(f"d{i}" for i in range(len(GRAD_NAMES), len(primals))))
    for i, name in enumerate(names[: len(primals)]):
        d = jnp.asarray(rng.standard_normal(primals[i].shape))
        plus = [p + eps * d if j == i else p for j, p in enumerate(primals)]
        minus = [p - eps * d if j == i else p for j, p in enumerate(primals)]
        fd = float((loss(*plus) - loss(*minus)) / (2 * eps))
        ad = float(jnp.sum(grads[i] * d))
        assert abs(fd - ad) <= rtol * max(1.0, abs(ad)), (
            f"{name}: central difference {fd} vs autodiff {ad}"
        )


def decode_reference_outputs(x: DecodeInputs):
    """The ground truth of a decode call: the decode reference on the same input values computed
    in the accumulation dtype (float32; float64 for float64 inputs), at the highest matmul
    precision, with the per-token states.

    Args:
        x: the decode inputs (the pool keeps its dtype: a bfloat16 pool is rounded as the
            backend's is).

    Returns:
        ``(o, new_state, token_states)``.
    """
    acc = jnp.float64 if x.q.dtype == jnp.float64 else jnp.float32
    wide = x.astype(acc)

    def run(q, k, v, w, b, g, state, idx):
        return gdn2_decode_reference(q, k, v, w, b, g, state, idx, None, return_token_states=True)

    with jax.default_matmul_precision("highest"):
        return jax.jit(run)(*wide.args, wide.state, wide.state_indices)
