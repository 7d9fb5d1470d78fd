"""The differentiable entry: a ``jax.custom_vjp`` around the chunkwise forward and the
hand-derived backward.

Residuals (a registered dataclass) are the six inputs, as given, and the entry states of every
group of G chunks, ``[n_groups, B, H, K, V]`` (a subset of the chunk-entry states); everything else,
including the other chunk-entry states, is recomputed in the backward. No per-token state is kept.
Packed sequences add their segment ids, or cu_seqlens and the per-sequence h0 (the re-laid row's
group-entry states do not hold them: a sequence's first chunk is entered with its own h0).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jaxtyping import Array, Float, Int

from gdn2_jax_ref.backward import gdn2_chunk_backward, gdn2_varlen_backward
from gdn2_jax_ref.forward import gdn2_chunk_forward, gdn2_varlen_forward
from gdn2_jax_ref.params import ChunkParams


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q", "k", "v", "w", "b", "g", "states", "segment_ids", "cu_seqlens", "h0"],
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
    segment_ids: Int[Array, "B T"] | None  # packed sequences (not differentiated)
    cu_seqlens: Int[Array, " N1"] | None  # packed sequences, B = 1 (not differentiated)
    h0: Float[Array, "N H K V"] | None  # the per-sequence h0 with cu_seqlens, else None
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
    segment_ids: Int[Array, "B T"] | None = None,
    cu_seqlens: Int[Array, " N1"] | None = None,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B H K V"]]:
    """Chunkwise GDN-2, differentiable in q, k, v, w, b, g and h0. Returns ``(o, h_final)``.

    Packed sequences: ``segment_ids`` (see :func:`gdn2_jax_ref.forward.gdn2_chunk_forward`) or
    ``cu_seqlens`` (B = 1, h0 and h_final ``(N, H, K, V)``, see
    :func:`gdn2_jax_ref.forward.gdn2_varlen_forward`), not both.
    """
    if cu_seqlens is None:
        o, h_final, _ = gdn2_chunk_forward(q, k, v, w, b, g, h0, params, segment_ids=segment_ids)
    else:
        o, h_final, _ = gdn2_varlen_forward(q, k, v, w, b, g, h0, cu_seqlens, params)
    return o, h_final


def _fwd(q, k, v, w, b, g, h0, params, segment_ids=None, cu_seqlens=None):
    if cu_seqlens is None:
        o, h_final, states = gdn2_chunk_forward(
            q, k, v, w, b, g, h0, params, keep_states=True, segment_ids=segment_ids
        )
        seq_h0 = None  # the first group-entry state is h0
    else:
        o, h_final, states = gdn2_varlen_forward(
            q, k, v, w, b, g, h0, cu_seqlens, params, keep_states=True
        )
        seq_h0 = h0
    res = Residuals(q, k, v, w, b, g, states, segment_ids, cu_seqlens, seq_h0, h0.dtype.name)
    return (o, h_final), res


def _bwd(params, res: Residuals, cotangents):
    do, dh_final = cotangents
    inputs = (res.q, res.k, res.v, res.w, res.b, res.g)
    if res.cu_seqlens is None:
        *grads, dh0 = gdn2_chunk_backward(
            *inputs, res.states, do, dh_final, params, segment_ids=res.segment_ids
        )
    else:
        *grads, dh0 = gdn2_varlen_backward(
            *inputs, res.h0, res.cu_seqlens, res.states, do, dh_final, params
        )
    return (*grads, dh0.astype(res.h0_dtype), None, None)


gdn2_chunk_trainable.defvjp(_fwd, _bwd)
