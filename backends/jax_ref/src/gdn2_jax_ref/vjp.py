"""The differentiable entry: a ``jax.custom_vjp`` around the chunkwise forward and the
hand-derived backward.

Residuals (a registered dataclass) are the six inputs, as given, and the entry states of every
group of G chunks, ``[n_groups, B, H, K, V]`` (a subset of the chunk-entry states); everything else,
including the other chunk-entry states, is recomputed in the backward. No per-token state is kept.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jaxtyping import Array, Float

from gdn2_jax_ref.backward import gdn2_chunk_backward
from gdn2_jax_ref.forward import gdn2_chunk_forward
from gdn2_jax_ref.params import ChunkParams


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q", "k", "v", "w", "b", "g", "states"],
    meta_fields=["h0_dtype"],
)
@dataclasses.dataclass(frozen=True)
class Residuals:
    """What the forward saves for the backward."""

    q: Float[Array, "B T H K"]
    k: Float[Array, "B T H K"]
    v: Float[Array, "B T H V"]
    w: Float[Array, "B T H V"]
    b: Float[Array, "B T H K"]
    g: Float[Array, "B T H K"]
    states: Float[Array, "n B H K V"]  # group-entry states, accumulation dtype
    h0_dtype: str  # dh0 is returned in h0's dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def gdn2_chunk_trainable(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    w: Float[Array, "B T H V"],
    b: Float[Array, "B T H K"],
    g: Float[Array, "B T H K"],
    h0: Float[Array, "B H K V"],
    params: ChunkParams,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B H K V"]]:
    """Chunkwise GDN-2, differentiable in q, k, v, w, b, g and h0. Returns ``(o, h_final)``."""
    o, h_final, _ = gdn2_chunk_forward(q, k, v, w, b, g, h0, params)
    return o, h_final


def _fwd(q, k, v, w, b, g, h0, params):
    o, h_final, states = gdn2_chunk_forward(q, k, v, w, b, g, h0, params, keep_states=True)
    return (o, h_final), Residuals(q, k, v, w, b, g, states, h0.dtype.name)


def _bwd(params, res: Residuals, cotangents):
    do, dh_final = cotangents
    dq, dk, dv, dw, db, dg, dh0 = gdn2_chunk_backward(
        res.q, res.k, res.v, res.w, res.b, res.g, res.states, do, dh_final, params
    )
    return dq, dk, dv, dw, db, dg, dh0.astype(res.h0_dtype)


gdn2_chunk_trainable.defvjp(_fwd, _bwd)
