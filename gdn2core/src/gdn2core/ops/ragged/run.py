"""Running a validated ragged call: the leading decodes on the backend's decode op, the rest on
its packed forward (:mod:`gdn2core.ops.ragged.pieces`).

A request of one token must not cost a chunk. An engine puts its decodes first (as tpu-inference
orders its batches) and says how many (``num_decodes``, static, each at most ``decode_len``
tokens): their tokens are gathered into ``(D, decode_len)`` rows, shorter ones filled with tokens
that leave the state as it is (``k = 0``, ``g = 0`` after the activations), and run as one decode
call, at the cost of their tokens and their slots. The packed forward then sees the decodes'
tokens as one padded piece, so they cost it at most one chunk together, not one each.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gdn2core.checks import state_dtype
from gdn2core.features.activations import apply_activations
from gdn2core.features.scalar_gates import broadcast_gates
from gdn2core.indexing import count_at_most
from gdn2core.ops.decode.api import backend_decode
from gdn2core.ops.decode.spec import DecodeSpec
from gdn2core.ops.forward.api import forward_continued, gdn2_forward, which_backend
from gdn2core.ops.ragged import pieces as pc
from gdn2core.ops.ragged.spec import RaggedSlots, RaggedSpec
from gdn2core.options import NO_ACTIVATIONS, Features
from gdn2core.platform import call_platform
from gdn2core.registry import get_backend
from gdn2core.selection import AUTO, resolve_decode_backend


@dataclasses.dataclass(frozen=True)
class Call:
    """A validated call: the spec, the metadata as int32 arrays, the slots after the rules."""

    spec: RaggedSpec
    cu: jax.Array  # [N + 1]
    slots: RaggedSlots
    flags: jax.Array  # [N] bool has_initial_state
    context_lens: jax.Array | None  # [N] with checkpoints
    features: Features
    raw_features: dict
    config: object
    backend: str


def start_states(call: Call, pool: jax.Array, first: int) -> jax.Array:
    """``[N - first, HV, dk, dv]`` the initial state of requests ``first`` on: its slot, zeros (a
    new request or a padded one), NaN (skipped: an invalid index). The decodes (``first`` of
    them) are left out: the decode op reads their slots itself."""
    acc = state_dtype(call.spec.dtype)
    state, flags = call.slots.state[first:], call.flags[first:]
    read = state >= 0
    start = jnp.take(pool, jnp.where(read, state, 0), axis=0).astype(acc)
    start = jnp.where((read & flags)[:, None, None, None], start, 0.0)
    return jnp.where(call.slots.skipped[first:, None, None, None], jnp.nan, start)


def write_slots(pool: jax.Array, hit: jax.Array, target: jax.Array, source) -> jax.Array:
    """``pool`` with ``source(pool, i)`` written into slot ``target[i]`` wherever ``hit[i]``.

    One in-place slot write per hit, in a loop that runs as many times as there are hits. A
    scatter over every candidate would instead build all ``K`` updates on every step: for the
    decodes of a serving step (fresh decodes, checkpoints among them) far more bytes than the
    decodes' own slots, while a step has few hits or none (the TPU estimate of a 256-decode step
    put the scatter at 3.5x the decode kernel).

    Args:
        pool: ``[P, HV, dk, dv]``.
        hit: ``[K]`` bool, the candidates to write (their targets valid slots).
        target: ``[K]`` int32 slots.
        source: ``(pool, i) -> [1, HV, dk, dv]`` the value of candidate ``i``.

    Returns:
        The pool.
    """
    order = jnp.argsort(~hit, stable=True)  # [K]: the hits first

    def write(n, pool):
        i = order[n]
        value = source(pool, i).astype(pool.dtype)  # [1, HV, dk, dv]
        return jax.lax.dynamic_update_slice(pool, value, (target[i], 0, 0, 0))

    return jax.lax.fori_loop(0, jnp.sum(hit, dtype=jnp.int32), write, pool)


def run_decodes(call: Call, x, pool: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The first ``num_decodes`` requests on the backend's decode op.

    Their tokens are the first ``cu[D] <= D * decode_len`` of the call, so their outputs come back
    as that leading region alone: ``R = min(T, D * decode_len)`` rows, gathered from the decode
    op's ``[D, decode_len]`` rows, never a scatter over all T tokens.

    Args:
        call: the call.
        x: the flat ``(q, k, v, w, b, g)``.
        pool: the pool.

    Returns:
        ``(o, mine, pool)``: o ``[R, HV, dv]`` the outputs of the first R tokens (zero where
        ``mine`` is false), mine ``[R]`` bool whether a token is a decode's, and the pool with the
        decodes' slots (final, checkpoint and draft states).
    """
    spec = call.spec
    d, s = spec.num_decodes, spec.decode_len
    cu, slots = call.cu, call.slots
    lens = cu[1 : d + 1] - cu[:d]  # [D]
    j = jnp.arange(s, dtype=jnp.int32)  # [S]
    real = j[None] < lens[:, None]  # [D, S]
    where = jnp.where(real, cu[:d, None] + j[None], 0)  # [D, S] flat token of each, < T
    # in bounds (cu[D] <= T): no select for out-of-range indices around the gathers
    q, k, v, w, b, g = (a.at[where].get(mode="promise_in_bounds") for a in x)  # [D, S, ...]
    # Token states are needed for drafts, and for checkpoints inside rows of several tokens; a
    # checkpoint of a one-token decode is its final state, copied from its slot afterwards.
    token_cuts = bool(spec.draft_cols) or bool(spec.checkpoint_cols and s > 1)
    indices = jax.ShapeDtypeStruct((d,), jnp.int32)  # the call's, checked already
    dspec = DecodeSpec.from_inputs(q, k, v, w, b, g, pool, indices, spec.scale, token_cuts)
    # Scalar gates on every channel: the decode kernels take full gates (ops/decode/api.py).
    dspec, w, b, g = broadcast_gates(dspec, w, b, g)
    chosen = resolve_decode_backend(
        dspec.resolved(), call.config, call.backend, platform=call_platform(x[0])
    )  # fmt: skip
    act, extras = call.features.activations, call.features.extras
    fused = act.any and chosen.capabilities.decode_activations  # raw inputs to the backend
    if act.any and not fused:
        q, k, w, b, g = apply_activations(act, q, k, w, b, g, extras.A_log, extras.dt_bias)
    # Filler tokens leave the state as it is: k = 0 and a decay of 1, that is g = 0 after the
    # activations (a raw g = -inf, when the backend activates a fused gate itself).
    keep = real[:, :, None, None]
    g_fill = -jnp.inf if fused and act.gate != "none" else 0.0
    k, g = jnp.where(keep, k, 0), jnp.where(keep, g, g_fill)
    zero = jnp.zeros((1, *pool.shape[1:]), pool.dtype)  # a slot of zeros
    fresh = (slots.state[:d] >= 0) & ~call.flags[:d]  # [D] new requests start from zeros
    pool = write_slots(pool, fresh, slots.state[:d], lambda pool, i: zero)
    od, pool, token_states = backend_decode(
        chosen, dspec, (q, k, v, w, b, g), pool, slots.state[:d], call.config,
        act if fused else NO_ACTIVATIONS, extras,
    )  # fmt: skip
    if token_cuts:
        flat = token_states.reshape(-1, *token_states.shape[2:])  # [D S, HV, dk, dv]
    token = jnp.arange(min(spec.tokens, d * s), dtype=jnp.int32)  # [R]
    row = jnp.minimum(count_at_most(cu[1 : d + 1], token), d - 1)  # [R]
    col = token - cu[row]  # [R]
    mine = (token < cu[d]) & (col < s)
    said = mine & ~slots.padded[:d][row]  # [R]: a padded decode's output is zero
    got = od.at[row, jnp.minimum(col, s - 1)].get(mode="promise_in_bounds")  # [R, HV, dv]
    o = jnp.where(said[:, None, None], got, 0.0).astype(x[2].dtype)
    if spec.checkpoint_cols:  # checkpoints among the decodes' tokens: few, one write each
        every, cols = spec.checkpoint_every, spec.checkpoint_cols
        ctx = call.context_lens[:d, None]  # [D, 1]
        pos = ctx + j[None] + 1  # [D, S] the absolute position after each token
        col = pos // every - ctx // every - 1  # [D, S] its checkpoint column
        ck = jnp.take_along_axis(slots.checkpoints[:d], jnp.clip(col, 0, cols - 1), axis=1)
        hit = real & (pos % every == 0) & (col < cols) & (ck >= 0)  # [D, S]
        final = slots.state[:d]  # [D]: a one-token row ends in its slot

        def source(pool, i):
            if token_cuts:  # the state after flat token i of the rows
                return jax.lax.dynamic_slice_in_dim(flat, i, 1)
            return jax.lax.dynamic_slice_in_dim(pool, final[i], 1)

        pool = write_slots(pool, hit.reshape(-1), ck.reshape(-1), source)
    if spec.draft_cols:  # drafts: a slot per token, as many writes as the tokens
        width = min(s, spec.draft_cols)
        dr = jnp.full((d, s), -1, jnp.int32).at[:, :width].set(slots.drafts[:d, :width])
        target = jnp.where(real & (dr >= 0), dr, spec.pool_size).reshape(-1)  # [D S]
        pool = pool.at[target].set(flat.astype(pool.dtype), mode="drop")
    return o, mine, pool


def run_packed(call: Call, x, pool: jax.Array, start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The requests after the decodes on the backend's packed forward, the decodes' tokens one
    padded piece.

    Args:
        call: the call.
        x: the flat ``(q, k, v, w, b, g)``.
        pool: the pool.
        start: ``[N - num_decodes, HV, dk, dv]`` these requests' initial states.

    Returns:
        ``(o, pool)``: o ``[T, HV, dv]`` (zero on the decodes' tokens), the pool with these
        requests' slots written.
    """
    spec, d = call.spec, call.spec.num_decodes
    acc = state_dtype(spec.dtype)
    t, p = spec.tokens, spec.pool_size
    # The requests of the packed part: the decodes as one padded request, then the rest.
    cu = call.cu[d:] if d == 0 else jnp.concatenate([call.cu[:1], call.cu[d:]])
    n = spec.n_requests - d + (1 if d else 0)
    slots = call.slots

    def rows(a, fill):
        return (
            a[d:]
            if d == 0
            else jnp.concatenate([jnp.full((1, *a.shape[1:]), fill, a.dtype), a[d:]])
        )

    part = dataclasses.replace(spec, n_requests=n, num_decodes=0)
    slots = RaggedSlots(
        rows(slots.state, -1), rows(slots.padded, True), rows(slots.skipped, False),
        rows(slots.checkpoints, -1), rows(slots.drafts, -1),
    )  # fmt: skip
    if d:
        start = jnp.concatenate([jnp.zeros((1, *start.shape[1:]), start.dtype), start])
    ctx = None if call.context_lens is None else rows(call.context_lens, 0)
    h0 = jnp.concatenate([start, jnp.zeros((1, *start.shape[1:]), acc)])  # [n + 1]: padding last

    cuts = pc.stored_cuts(part, cu, ctx, slots)  # [K]
    pieces = pc.cut_row(part, cu, cuts)  # Q = n + K + 1 pieces
    row = tuple(a[None] for a in x)  # [1, T, heads, d]: one packed row
    run = dict(scale=spec.scale, config=call.config, **call.raw_features)
    backend = call.backend
    if backend == AUTO:  # one backend for both passes
        backend = which_backend(
            *row, h0=jnp.zeros((pieces.request.shape[0], *start.shape[1:]), acc),
            cu_seqlens=pieces.offsets, trainable=False, **run,
        )  # fmt: skip
    continued = get_backend(backend).capabilities.continued
    if cuts.tokens.shape[0] and continued:  # one pass: the pieces of a request carry its state
        o, finals = forward_continued(
            row, h0[pieces.request], cu_seqlens=pieces.offsets,
            continues=~pieces.starts_request, **run, backend=backend,
        )  # fmt: skip
    elif cuts.tokens.shape[0]:  # three passes: the pieces' maps, chained, then the forward
        q_, k_, v_, _, b_, g_ = row
        pieces_n = pieces.request.shape[0]
        eye = jnp.broadcast_to(
            jnp.eye(spec.dk, dtype=acc), (pieces_n, spec.heads, spec.dk, spec.dk)
        )
        no_write = jnp.zeros((1, t, spec.heads, spec.dk), v_.dtype)
        common = dict(cu_seqlens=pieces.offsets, backend=backend, **run)
        # A: the linear part, the identity carried through with nothing written ([Q, HV, dk, dk]);
        # Z: what each piece writes from a zero state ([Q, HV, dk, dv]). Two calls of the op's own
        # widths, not one of width dk + dv: a backend that joins grouped value heads into one
        # wide head would exceed its widest head.
        _, a = gdn2_forward(q_, k_, no_write, no_write, b_, g_, h0=eye, **common)
        _, z = gdn2_forward(*row, h0=jnp.zeros((pieces_n, *start.shape[1:]), acc), **common)
        piece_h0 = pc.chain(pieces, h0, jnp.concatenate([a, z], axis=-1), spec.dk)  # [Q, ...]
        o, finals = gdn2_forward(*row, h0=piece_h0, **common)
    else:  # the pieces are the requests (and the padding)
        o, finals = gdn2_forward(
            *row, h0=h0[pieces.request], cu_seqlens=pieces.offsets, backend=backend, **run
        )  # o: [1, T, HV, dv]; finals: [Q, HV, dk, dv]

    seq = count_at_most(cu[1:], jnp.arange(t, dtype=jnp.int32))  # [T]
    silent = jnp.concatenate([slots.padded, jnp.ones((1,), bool)])[seq]  # padding, padded
    o = jnp.where(silent[:, None, None], 0.0, o[0]).astype(x[2].dtype)

    lens = cu[1:] - cu[:-1]  # [n]
    last = finals[pc.piece_ending_at(pieces, jnp.maximum(cu[1:], 1))]  # [n, ...]
    final = jnp.where((lens > 0)[:, None, None, None], last, start)
    target = jnp.concatenate([jnp.where(slots.state >= 0, slots.state, p), cuts.slots])
    stored = finals[pc.piece_ending_at(pieces, jnp.clip(cuts.tokens + 1, 1, t))]  # [K, ...]
    value = jnp.concatenate([final, stored]).astype(pool.dtype)
    return o, pool.at[target].set(value, mode="drop")
