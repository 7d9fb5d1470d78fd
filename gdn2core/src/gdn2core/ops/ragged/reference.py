"""The token-serial reference of the ragged op: the ground truth of every ragged backend.

One ``lax.scan`` step per flat token (:func:`gdn2core.ops.forward.reference.feature_token_step`,
the step of the chunked op's reference, features included): the token's request starts from its
slot (or zeros), and every state the call stores is taken right after the token it follows. The
slot rules for invalid values are :func:`gdn2core.ops.ragged.spec.ragged_slots`.
"""

from __future__ import annotations

from typing import Unpack

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from gdn2core.checks import state_dtype
from gdn2core.features.scalar_gates import broadcast_gates
from gdn2core.features.segments import varlen_layout
from gdn2core.ops.forward.reference import feature_token_step
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.ops.ragged.spec import RaggedSpec, checkpoint_cuts, ragged_slots
from gdn2core.options import FeatureArgs, Features


def gdn2_ragged_reference(
    q: Float[Array, "T H dk"],
    k: Float[Array, "T H dk"],
    v: Float[Array, "T HV dv"],
    w: Float[Array, "T HV dv"] | Float[Array, "T HV"],
    b: Float[Array, "T Hg dk"] | Float[Array, "T Hg"],
    g: Float[Array, "T Hg dk"] | Float[Array, "T Hg"],
    pool: Float[Array, "P HV dk dv"],
    *,
    cu_seqlens: Int[Array, " N1"],
    state_indices: Int[Array, " N"],
    has_initial_state: Bool[Array, " N"] | None = None,
    scale: float | None = None,
    checkpoint_every: int | None = None,
    context_lens: Int[Array, " N"] | None = None,
    checkpoint_slots: Int[Array, "N M"] | None = None,
    draft_slots: Int[Array, "N S"] | None = None,
    **features: Unpack[FeatureArgs],
) -> tuple[Float[Array, "T HV dv"], Float[Array, "P HV dk dv"]]:
    """Token-serial ragged call: each request's tokens in order, from its slot, into its slot.

    Args:
        As :func:`gdn2core.gdn2_ragged`.

    Returns:
        ``(o, pool)`` as :func:`gdn2core.gdn2_ragged`.
    """
    parsed = Features.parse(features, op="gdn2_ragged_reference", packed=False)
    spec = RaggedSpec.from_inputs(
        q, k, v, w, b, g, pool, cu_seqlens=cu_seqlens, state_indices=state_indices,
        has_initial_state=has_initial_state, scale=scale, checkpoint_every=checkpoint_every,
        context_lens=context_lens, checkpoint_slots=checkpoint_slots, draft_slots=draft_slots,
    )  # fmt: skip
    spec, w, b, g = broadcast_gates(spec, w, b, g)  # scalar gates: on every channel
    n, t = spec.n_requests, spec.tokens
    acc = state_dtype(q.dtype)
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)  # [N + 1]
    cu_all = jnp.concatenate([cu, jnp.full((1,), t, jnp.int32)])  # the padding as request N
    fwd = OpSpec.from_inputs(
        *(x[None] for x in (q, k, v, w, b, g)), spec.scale, None,
        cu_seqlens=cu_all, activations=parsed.activations,
        A_log=parsed.extras.A_log, dt_bias=parsed.extras.dt_bias,
    )  # fmt: skip
    token = feature_token_step(fwd, parsed.extras, acc)
    slots = ragged_slots(spec, state_indices, checkpoint_slots, draft_slots)
    flags = jnp.ones((n,), bool) if has_initial_state is None else jnp.asarray(has_initial_state)
    read = slots.state >= 0
    start = jnp.take(pool, jnp.where(read, slots.state, 0), axis=0).astype(acc)  # [N, HV, dk, dv]
    start = jnp.where((read & flags)[:, None, None, None], start, 0.0)
    start = jnp.where(slots.skipped[:, None, None, None], jnp.nan, start)
    zero = jnp.zeros((1, *start.shape[1:]), acc)
    h0 = jnp.concatenate([start, zero])  # [N + 1, HV, dk, dv]

    seq, first, _ = varlen_layout(cu_all, t)  # [T]: the request of each token (N: padding)
    local = jnp.arange(t, dtype=jnp.int32) - cu_all[seq]  # [T] index in its request
    cols_m, cols_s = spec.checkpoint_cols, spec.draft_cols
    if cols_m:
        cuts = checkpoint_cuts(spec, cu, context_lens)  # [N, M]
        cuts = jnp.concatenate([cuts, jnp.full((1, cols_m), -1, jnp.int32)])  # [N + 1, M]
        ck_col = jnp.argmax(cuts[seq] == local[:, None], axis=1)  # [T] the checkpoint it ends
        is_ck = jnp.any(cuts[seq] == local[:, None], axis=1)  # [T]
    else:
        ck_col = is_ck = jnp.zeros((t,), jnp.int32)
    shape = (n + 1, *start.shape[1:])
    ck_states = jnp.zeros((n + 1, cols_m, *shape[1:]), acc)
    dr_states = jnp.zeros((n + 1, cols_s, *shape[1:]), acc)
    xs = tuple(x[:, None].astype(acc) for x in (q, k, v, w, b, g))  # [T, 1, heads, d]

    def step(carry, x):
        S, finals, cks, drs = (
            carry  # [1, HV, dk, dv], [N + 1, ...], [N + 1, M, ...], [N + 1, S, ...]
        )
        r, is_first, j, ck, col, tok = x
        S = jnp.where(is_first, h0[r][None], S)
        S_new, o = token(S, tok)
        finals = finals.at[r].set(S_new[0])  # the last token of r leaves its final state
        if cols_m:
            cks = cks.at[r, col].set(jnp.where(ck, S_new[0], cks[r, col]))
        if cols_s:
            jj = jnp.minimum(j, cols_s - 1)
            drs = drs.at[r, jj].set(jnp.where(j < cols_s, S_new[0], drs[r, jj]))
        return (S_new, finals, cks, drs), o[0]

    init = (zero, h0, ck_states, dr_states)
    (_, finals, cks, drs), o = jax.lax.scan(step, init, (seq, first, local, is_ck, ck_col, xs))
    # o: [T, HV, dv]; padding tokens and padded requests give zeros, skipped requests NaN.
    silent = jnp.concatenate([slots.padded, jnp.ones((1,), bool)])[seq]  # [T]
    o = jnp.where(silent[:, None, None], 0.0, o).astype(v.dtype)

    targets = [jnp.where(slots.state >= 0, slots.state, spec.pool_size)]
    values = [finals[:n]]
    if cols_m:
        met = (cuts[:n] >= 0) & (slots.checkpoints >= 0)  # [N, M] positions this call reaches
        targets.append(jnp.where(met, slots.checkpoints, spec.pool_size).reshape(-1))
        values.append(cks[:n].reshape(-1, *shape[1:]))
    if cols_s:
        lens = (cu[1:] - cu[:-1])[:, None]  # [N, 1]
        dr = jnp.where(jnp.arange(cols_s)[None] < lens, slots.drafts, -1)  # only tokens that exist
        targets.append(jnp.where(dr >= 0, dr, spec.pool_size).reshape(-1))
        values.append(drs[:n].reshape(-1, *shape[1:]))
    target = jnp.concatenate(targets)
    value = jnp.concatenate(values).astype(pool.dtype)
    return o, pool.at[target].set(value, mode="drop")
