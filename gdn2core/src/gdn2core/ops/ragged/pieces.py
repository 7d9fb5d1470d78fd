"""A ragged call as a packed forward: the flat row cut into pieces at every stored state.

Every request is a sequence of the row, and the state after a token the call stores (a prefix
checkpoint, a draft) must be a sequence's final state, so the row is cut after each such token:
the pieces are the sequences of a ``cu_seqlens`` forward. A piece that starts a request starts
from the request's state; any other piece continues from the piece before it, whose final state
the forward does not yet know when it runs. Two passes solve it:

1. The recurrence acts on each value column of the state alike, and linearly in the state:
   a piece maps its initial state ``S`` to ``A S + Z``. A forward over the pieces with ``dk``
   value columns that write nothing (``v = w = 0``) from the identity returns ``A_p`` as piece
   ``p``'s final state; one with the call's values from zeros returns ``Z_p``.
2. A scan over the pieces chains them (``S_in[p] = A_{p-1} S_in[p-1] + Z_{p-1}`` inside a
   request), and a second forward from those initial states gives the outputs and every stored
   state.

Without stored states the pieces are the requests and only the second pass runs. Empty pieces
and empty requests pass their initial state through (``A = I``, ``Z = 0``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gdn2core.indexing import count_at_most
from gdn2core.ops.ragged.spec import RaggedSlots, RaggedSpec, checkpoint_cuts


class Cuts(NamedTuple):
    """The stored states of a call after the requests' first tokens: where and into which slot."""

    tokens: jax.Array  # [K] int32: the global token each follows; T: none
    slots: jax.Array  # [K] int32: the slot it goes to; P: none


class Pieces(NamedTuple):
    """The pieces of the row: a ``cu_seqlens`` forward's sequences."""

    offsets: jax.Array  # [Q + 1] int32, 0 ... T
    request: jax.Array  # [Q] int32: the request of each piece's first token (N: padding)
    starts_request: jax.Array  # [Q] bool: the piece starts at its request's first token


def stored_cuts(spec: RaggedSpec, cu: jax.Array, context_lens, slots: RaggedSlots) -> Cuts:
    """The checkpoint and draft states of a call as one list of static length
    (:attr:`RaggedSpec.checkpoint_bound` + :attr:`RaggedSpec.draft_bound`).

    Args:
        spec: the call.
        cu: ``[N + 1]`` int32 offsets.
        context_lens: ``[N]`` tokens before this call (with checkpoints).
        slots: the call's slots after the rules for invalid values.

    Returns:
        The :class:`Cuts`; the unused entries hold token ``T`` and slot ``P``.
    """
    t, p = spec.tokens, spec.pool_size
    lens = cu[1:] - cu[:-1]  # [N]
    parts = []
    if spec.checkpoint_cols:
        local = checkpoint_cuts(spec, cu, context_lens)  # [N, M], -1: none
        parts.append((local, slots.checkpoints, spec.checkpoint_bound))
    if spec.draft_cols:
        j = jnp.broadcast_to(jnp.arange(spec.draft_cols, dtype=jnp.int32), slots.drafts.shape)
        local = jnp.where(j < lens[:, None], j, -1)  # [N, S]
        parts.append((local, slots.drafts, spec.draft_bound))
    tokens, targets = [], []
    for local, slot, bound in parts:
        use = (local >= 0) & (slot >= 0)  # [N, cols]
        tok = jnp.where(use, cu[:-1, None] + local, t).reshape(-1)  # [N cols]
        dst = jnp.where(use, slot, p).reshape(-1)
        order = jnp.argsort(tok, stable=True)[:bound]  # the used ones come first; at most bound
        tokens.append(tok[order])
        targets.append(dst[order])
    if not tokens:
        empty = jnp.zeros((0,), jnp.int32)
        return Cuts(empty, empty)
    return Cuts(jnp.concatenate(tokens), jnp.concatenate(targets))


def cut_row(spec: RaggedSpec, cu: jax.Array, cuts: Cuts) -> Pieces:
    """The pieces: the row cut at every request boundary and after every stored state's token.

    Args:
        spec: the call.
        cu: ``[N + 1]`` int32 offsets.
        cuts: the stored states.

    Returns:
        The :class:`Pieces` (``Q = N + K + 1``; the last holds the padding tokens, maybe none).
    """
    t = spec.tokens
    ends = jnp.minimum(cuts.tokens + 1, t)  # [K]
    inner = jnp.sort(jnp.concatenate([cu, ends]))  # [N + 1 + K], starts with cu[0] = 0
    offsets = jnp.concatenate([inner, jnp.full((1,), t, jnp.int32)]).astype(jnp.int32)
    first = offsets[:-1]  # [Q]
    request = count_at_most(cu[1:], first)  # [Q], N: padding
    return Pieces(offsets, request, first == cu[request])  # cu[N]: the padding's first token


def piece_ending_at(pieces: Pieces, end: jax.Array) -> jax.Array:
    """The piece whose last token is ``end - 1`` (``end`` an offset of the pieces, > 0).

    Args:
        pieces: the pieces.
        end: ``[...]`` int32 positions.

    Returns:
        ``[...]`` int32 piece indices.
    """
    return count_at_most(pieces.offsets, end - 1) - 1


def chain(pieces: Pieces, h0: jax.Array, maps: jax.Array, dk: int) -> jax.Array:
    """The initial state of every piece from the pieces' affine maps.

    Args:
        pieces: the pieces.
        h0: ``[N + 1, HV, dk, dv]`` the requests' initial states (row N: the padding's, zero).
        maps: ``[Q, HV, dk, dk + dv]`` each piece's final state from ``[I | 0]``: ``[A | Z]``.
        dk: the key size.

    Returns:
        ``[Q, HV, dk, dv]`` initial states.
    """

    def step(prev_out, x):  # prev_out: [HV, dk, dv] the state the previous piece left
        r, starts, m = x  # m: [HV, dk, dk + dv]
        s_in = jnp.where(starts, h0[r], prev_out)  # [HV, dk, dv]
        a, z = m[..., :dk], m[..., dk:]  # [HV, dk, dk], [HV, dk, dv]
        out = jnp.einsum("hij,hjv->hiv", a, s_in, precision=jax.lax.Precision.HIGHEST) + z
        return out, s_in

    _, s_in = jax.lax.scan(
        step, jnp.zeros(h0.shape[1:], h0.dtype), (pieces.request, pieces.starts_request, maps)
    )
    return s_in
