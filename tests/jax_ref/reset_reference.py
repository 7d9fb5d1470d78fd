"""A token-serial GDN-2 with resets, for the packed-sequence tests of jax_ref.

The recurrence of ``gdn2core.gdn2_token_serial_reference``, one ``lax.scan`` step per token, with
the state set to zero before every sequence start except the row's first token (there h0 enters):
the operator's definition of packed sequences, with no chunks, masks or cumsums to get wrong.
Differentiable by autodiff; the tests run it in float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def starts_of(segment_ids) -> jax.Array:
    """``(B, T)`` bool: a new sequence starts at the token (the row's first token excluded)."""
    ids = jnp.asarray(segment_ids)
    first = jnp.zeros_like(ids[:, :1], dtype=bool)
    return jnp.concatenate([first, ids[:, 1:] != ids[:, :-1]], axis=1)


def serial_with_resets(q, k, v, w, b, g, h0, scale, segment_ids):
    """``(o, h_final)`` of the packed rows ``segment_ids`` (B, T)."""
    resets = jnp.swapaxes(starts_of(segment_ids), 0, 1)  # [T, B]
    xs = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, w, b, g))  # [T, B, H, d]

    def step(S, x):  # S: [B, H, dk, dv]
        (qt, kt, vt, wt, bt, gt), reset = x
        S = jnp.where(reset[:, None, None, None], 0.0, S)  # the sequence start
        S = jnp.exp(gt)[..., None] * S
        r = jnp.einsum("bhkv,bhk->bhv", S, bt * kt)
        S = S + kt[..., None] * (wt * vt - r)[..., None, :]
        return S, scale * jnp.einsum("bhkv,bhk->bhv", S, qt)

    h_final, o = jax.lax.scan(step, h0, (xs, resets))
    return jnp.swapaxes(o, 0, 1), h_final


def serial_varlen(q, k, v, w, b, g, h0, scale, cu_seqlens):
    """``(o, h_final)`` for the sequences ``cu_seqlens`` (a concrete sequence) of the single row,
    each run on its own from its own ``h0[n]``; ``h_final`` is ``(N, H, dk, dv)``."""
    cu = [int(c) for c in np.asarray(cu_seqlens)]
    outs, finals = [], []
    for n in range(len(cu) - 1):
        if cu[n + 1] == cu[n]:
            finals.append(h0[n])  # an empty sequence leaves its state as it was
            continue
        piece = tuple(x[:, cu[n] : cu[n + 1]] for x in (q, k, v, w, b, g))
        ids = jnp.zeros(piece[0].shape[:2], jnp.int32)  # one sequence
        o, h = serial_with_resets(*piece, h0[n][None], scale, ids)
        outs.append(o)
        finals.append(h[0])
    return jnp.concatenate(outs, axis=1), jnp.stack(finals)
