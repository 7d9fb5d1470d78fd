"""``KernelConfig(hybrid_forward=True)``: the jax_ref forward with the Pallas backward.

The outputs (o, h_final) come from the jax_ref backend (imported lazily, so gdn2-jax-ref is only
needed in this mode). The Pallas backward reads the entry state of every ``plan.ckpt``-th chunk;
jax_ref's own residuals use a different grouping, so the forward rule also runs the Pallas forward
kernel for those states (its o output is discarded). That costs one extra Pallas forward pass:
the mode is a debugging aid (isolate a suspected forward-kernel problem), not a fast path.
"""

from __future__ import annotations

import functools

import jax

from gdn2_pallas_tpu.config import Plan
from gdn2_pallas_tpu.vjp import Residuals, _forward, _vjp_bwd
from gdn2core.config import KernelConfig
from gdn2core.spec import OpSpec


def jax_ref_forward(q, k, v, w, b, g, h0, *, spec: OpSpec, config: KernelConfig):
    """(o, h_final) of the jax_ref backend for the same blocking (flags of this mode cleared)."""
    from gdn2_jax_ref.backend import JaxRefBackend

    ref_config = config.model_copy(update={"hybrid_forward": False, "interpret": False})
    return JaxRefBackend().forward(q, k, v, w, b, g, h0, spec=spec, config=ref_config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def gdn2_hybrid_trainable(q, k, v, w, b, g, h0, plan: Plan, spec: OpSpec, config: KernelConfig):
    return jax_ref_forward(q, k, v, w, b, g, h0, spec=spec, config=config)


def _hybrid_fwd(q, k, v, w, b, g, h0, plan: Plan, spec: OpSpec, config: KernelConfig):
    o, h_final = jax_ref_forward(q, k, v, w, b, g, h0, spec=spec, config=config)
    _, _, xs, states = _forward(q, k, v, w, b, g, h0, plan, save_states=True)
    return (o, h_final), Residuals(*xs, states=states)


def _hybrid_bwd(plan: Plan, spec: OpSpec, config: KernelConfig, res: Residuals, cotangents):
    del spec, config
    return _vjp_bwd(plan, res, cotangents)


gdn2_hybrid_trainable.defvjp(_hybrid_fwd, _hybrid_bwd)
