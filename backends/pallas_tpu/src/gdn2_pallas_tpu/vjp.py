"""The differentiable op: one ``jax.custom_vjp`` over the forward and backward kernels.

Residuals (:class:`Residuals`, a registered dataclass): the six inputs in kernel layout (a bitcast
of the caller's arrays at the train shape, so they cost no memory), and what the training forward
writes for the backward: ``T`` and ``A_qk`` of every chunk, packed into one matrix (in the dtype the backward's products
round them to, see plan.py) and the float32 state entering every grid step. The backward recomputes
the rest (decay factors, ``Y``, ``U``, the states inside a step) in VMEM.

Platform guard: the kernels are TPU kernels. Unless ``plan.interpret``, each call goes through
``lax.platform_dependent``: the TPU branch runs the kernel, any other platform a callback that
raises at run time with the fix. The branch is chosen at lowering time, so
``jit(...).lower(lowering_platforms=("tpu",))`` on a CPU host compiles the real kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from gdn2_pallas_tpu.blocks import from_kernel, to_kernel
from gdn2_pallas_tpu.kernels_bwd import backward_call
from gdn2_pallas_tpu.kernels_fwd import forward_call
from gdn2_pallas_tpu.plan import Plan

CPU_MESSAGE = (
    "gdn2 backend 'pallas_tpu' runs Pallas TPU kernels and needs a TPU, but this call runs on "
    "another platform. Run it on a TPU, or pass KernelConfig(interpret=True) to run the kernels "
    "in the (slow) TPU interpreter, or choose backend='jax_ref'."
)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q", "k", "v", "w", "b", "g", "TA", "states"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Residuals:
    """What the backward reads from the forward (token arrays in kernel layout, blocks.py)."""

    q: jax.Array  # [B, H, t_pad, K]
    k: jax.Array  # [B, H, t_pad, K]
    v: jax.Array  # [B, H, t_pad, V]
    w: jax.Array  # [B, H, t_pad, V]
    b: jax.Array  # [B, H, t_pad, K]
    g: jax.Array  # [B, H, t_pad, K]
    TA: jax.Array  # [B, H / hb, n_steps, U, C, C] A_qk (lower) and T^T (strictly upper) per chunk
    states: jax.Array  # [B, H / hb, n_steps, hb, K, V] f32 state entering every step


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


def _forward(q, k, v, w, b, g, h0, plan: Plan, save: bool):
    xs = [to_kernel(x, plan) for x in (q, k, v, w, b, g)]
    call = functools.partial(forward_call, plan=plan, save=save)
    outs = _on_tpu_only(call, plan, *xs, h0.astype(jnp.float32))
    return from_kernel(outs[0], plan), outs[1], xs, outs[2:]


def gdn2_pallas_forward(q, k, v, w, b, g, h0, plan: Plan):
    """Inference forward: ``(o, h_final)``, no residuals written."""
    o, h_final, _, _ = _forward(q, k, v, w, b, g, h0, plan, save=False)
    return o, h_final


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def gdn2_pallas_trainable(q, k, v, w, b, g, h0, plan: Plan):
    """Differentiable forward: gradients in q, k, v, w, b, g, h0 by the backward kernel."""
    return gdn2_pallas_forward(q, k, v, w, b, g, h0, plan)


def _vjp_fwd(q, k, v, w, b, g, h0, plan: Plan):
    o, h_final, xs, (TA, states) = _forward(q, k, v, w, b, g, h0, plan, save=True)
    return (o, h_final), Residuals(*xs, TA=TA, states=states)


def _vjp_bwd(plan: Plan, res: Residuals, cotangents):
    do, dh_final = cotangents
    do_k = to_kernel(do.astype(res.v.dtype), plan)
    call = functools.partial(backward_call, plan=plan)
    *grads, dh0 = _on_tpu_only(
        call,
        plan,
        *(res.q, res.k, res.v, res.w, res.b, res.g),
        do_k,
        res.TA,
        res.states,
        dh_final.astype(jnp.float32),
    )
    return (*(from_kernel(x, plan) for x in grads), dh0)


gdn2_pallas_trainable.defvjp(_vjp_fwd, _vjp_bwd)
