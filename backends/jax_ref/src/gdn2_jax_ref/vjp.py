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

from gdn2_jax_ref.backward import gdn2_chunk_backward
from gdn2_jax_ref.forward import gdn2_chunk_forward
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
    :mod:`gdn2_jax_ref.varlen`), not both.
    """
    o, h_final, _ = gdn2_chunk_forward(
        q, k, v, w, b, g, h0, params, segment_ids=segment_ids, cu_seqlens=cu_seqlens
    )
    return o, h_final


def _fwd(q, k, v, w, b, g, h0, params, segment_ids=None, cu_seqlens=None):
    o, h_final, states = gdn2_chunk_forward(
        *(q, k, v, w, b, g, h0, params),
        keep_states=True,
        segment_ids=segment_ids,
        cu_seqlens=cu_seqlens,
    )
    seq_h0 = None if cu_seqlens is None else h0  # else the first group-entry state is h0
    res = Residuals(q, k, v, w, b, g, states, segment_ids, cu_seqlens, seq_h0, h0.dtype.name)
    return (o, h_final), res


def _bwd(params, res: Residuals, cotangents):
    do, dh_final = cotangents
    *grads, dh0 = gdn2_chunk_backward(
        *(res.q, res.k, res.v, res.w, res.b, res.g, res.states, do, dh_final, params),
        segment_ids=res.segment_ids,
        cu_seqlens=res.cu_seqlens,
        h0=res.h0,
    )
    return (*grads, dh0.astype(res.h0_dtype), None, None)


gdn2_chunk_trainable.defvjp(_fwd, _bwd)
