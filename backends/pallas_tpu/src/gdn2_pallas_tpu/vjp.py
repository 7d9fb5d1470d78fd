"""The differentiable op: one ``jax.custom_vjp`` over the fused forward and backward kernels.

Residuals (``Residuals``, a registered dataclass): the six inputs in kernel layout (B, H, t_pad, d)
(layout.py; at the train shape a bitcast of the caller's arrays, so they cost no memory) and the float32 state entering every
``plan.ckpt``-th chunk, ``[B, H, N / ckpt, K, V]``. Everything else (phase A, R, the
other entry states) is recomputed in the backward kernel, in VMEM.

Platform guard: the kernels are TPU kernels. Unless ``plan.interpret``, each call goes through
``lax.platform_dependent``: the TPU branch runs the kernel, any other platform a callback that
raises at run time with the fix ("use a TPU or KernelConfig(interpret=True)"). The branch is chosen
at lowering time, so ``jit(...).lower(lowering_platforms=("tpu",))`` on a CPU host compiles the
real kernels and never sees the error branch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from gdn2_pallas_tpu.config import Plan
from gdn2_pallas_tpu.kernels_bwd import backward_call
from gdn2_pallas_tpu.kernels_fwd import forward_call
from gdn2_pallas_tpu.layout import from_kernel, to_kernel

CPU_MESSAGE = (
    "gdn2 backend 'pallas_tpu' runs Pallas TPU kernels and needs a TPU, but this call runs on "
    "another platform. Run it on a TPU, or pass KernelConfig(interpret=True) to run the kernels "
    "in the (slow) TPU interpreter, or choose backend='jax_ref'."
)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q", "k", "v", "w", "b", "g", "states"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Residuals:
    """What the backward reads from the forward. Token arrays in kernel layout (layout.py)."""

    q: jax.Array  # [B, H, Tp, K]
    k: jax.Array
    v: jax.Array  # [B, H, Tp, V]
    w: jax.Array
    b: jax.Array
    g: jax.Array
    states: jax.Array  # [B, H, N / ckpt, K, V] f32 state entering each superchunk


def _raise_not_tpu(*_):
    raise RuntimeError(CPU_MESSAGE)


def _on_tpu_only(fn, plan: Plan, *args):
    """Run ``fn(*args)`` (kernels) on TPU; elsewhere fail at run time with ``CPU_MESSAGE``."""
    if plan.interpret:
        return fn(*args)
    out_shapes = jax.eval_shape(fn, *args)

    def other(*a):
        return jax.pure_callback(_raise_not_tpu, out_shapes, *a, vmap_method="broadcast_all")

    return lax.platform_dependent(*args, tpu=fn, default=other)


def _forward(q, k, v, w, b, g, h0, plan: Plan, save_states: bool):
    xs = [to_kernel(x, plan) for x in (q, k, v, w, b, g)]
    call = functools.partial(forward_call, plan=plan, save_states=save_states)
    if save_states:
        o, hT, states = _on_tpu_only(call, plan, *xs, h0)
    else:
        o, hT = _on_tpu_only(lambda *a: call(*a)[:2], plan, *xs, h0)
        states = None
    return from_kernel(o, plan), hT, xs, states


def gdn2_pallas_forward(q, k, v, w, b, g, h0, plan: Plan):
    """Inference forward (no residuals saved)."""
    o, hT, _, _ = _forward(q, k, v, w, b, g, h0, plan, save_states=False)
    return o, hT


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def gdn2_pallas_trainable(q, k, v, w, b, g, h0, plan: Plan):
    """Differentiable forward: gradients in q, k, v, w, b, g, h0 by the fused backward kernel."""
    return gdn2_pallas_forward(q, k, v, w, b, g, h0, plan)


def _vjp_fwd(q, k, v, w, b, g, h0, plan: Plan):
    o, hT, xs, states = _forward(q, k, v, w, b, g, h0, plan, save_states=True)
    return (o, hT), Residuals(*xs, states=states)


def _vjp_bwd(plan: Plan, res: Residuals, cotangents):
    do, dhT = cotangents
    do_k = to_kernel(do.astype(res.v.dtype), plan)
    call = functools.partial(backward_call, plan=plan)
    grads = _on_tpu_only(
        call,
        plan,
        res.q,
        res.k,
        res.v,
        res.w,
        res.b,
        res.g,
        do_k,
        res.states,
        dhT.astype(jnp.float32),
    )
    dq, dk, dv, dw, db, dg, dh0 = grads
    return (*(from_kernel(x, plan) for x in (dq, dk, dv, dw, db, dg)), dh0)


gdn2_pallas_trainable.defvjp(_vjp_fwd, _vjp_bwd)
