"""The ragged op: one call over a serving engine's flat batch of requests against a state pool.

An engine packs every step's requests (decodes of 1 or k + 1 tokens, prefills, resumed prompts)
into one flat token stream and calls each layer once. :func:`gdn2_ragged` takes that stream with
fla's varlen offsets (``cu_seqlens``) and vLLM's slot metadata (``state_indices``,
``has_initial_state``), and stores prefix checkpoints and draft states into slots of the same
pool. The contract is the ragged section of ``docs/operator.md``.

The core runs it on the backends' own ops (:mod:`gdn2core.ops.ragged.run`): the leading decodes
(``num_decodes``) on the decode op, the rest on the packed forward
(:mod:`gdn2core.ops.ragged.pieces`: one pass when the call stores no intermediate state, two when
it does). Backends need nothing beyond a ``cu_seqlens`` forward with an initial state per
sequence and, for decodes, a decode op.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Unpack

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from gdn2core.config import DEFAULT_CONFIG, KernelConfig
from gdn2core.ops.ragged.mesh import head_plan, sharded_ragged
from gdn2core.ops.ragged.pooled import run_pooled
from gdn2core.ops.ragged.run import Call, run_decodes, run_packed, start_states
from gdn2core.ops.ragged.spec import RaggedSpec, ragged_slots
from gdn2core.options import FeatureArgs, Features
from gdn2core.selection import AUTO


def gdn2_ragged(
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
    num_decodes: int = 0,
    decode_len: int = 1,
    mesh: Any = None,
    head_axes: str | Sequence[str] | None = None,
    config: KernelConfig | None = None,
    backend: str = AUTO,
    **features: Unpack[FeatureArgs],
) -> tuple[Float[Array, "T HV dv"], Float[Array, "P HV dk dv"]]:
    """A ragged batch of requests against a state pool (inference only).

    Request ``i`` owns the flat tokens ``cu_seqlens[i]:cu_seqlens[i + 1]`` (none is allowed); it
    starts from ``pool[state_indices[i]]`` when ``has_initial_state[i]``, else from zeros, runs
    the GDN-2 recurrence over its tokens exactly as :func:`gdn2_forward` would with that state as
    ``h0``, and leaves its last state in the same slot. The state is float32 (float64 for float64
    inputs) from the slot to the last token and rounded to the pool's dtype once, when stored.

    Args:
        q, k: ``(T, H, dk)``; v, w: ``(T, HV, dv)``; b, g: ``(T, H or HV, dk)``: the flat tokens
            of every request, one floating dtype (but g may be float32 beside bfloat16 inputs,
            as in :func:`gdn2_forward`); ``HV`` a multiple of ``H`` (grouped value heads). Tokens
            past ``cu_seqlens[N]`` are padding: their outputs are zero. Scalar gates (KDA's and
            GDN's beta, GDN's decay) may come without their channel axis, w ``(T, HV)`` and b, g
            ``(T, H or HV)``: broadcast to their channels before the backend (the pooled and
            decode kernels take full gates).
        pool: ``(P, HV, dk, dv)`` float32 or bfloat16 (float64 too for float64 inputs). Slots the
            call does not name keep their value bit for bit.
        cu_seqlens: ``(N + 1,)`` integers: 0, non-decreasing, at most T.
        state_indices: ``(N,)`` integers: each request's slot; negative marks a padded request
            (nothing read or written, zero outputs).
        has_initial_state: ``(N,)`` bools, None for all true: whether request ``i`` starts from
            its slot (false: from zeros, a new request reusing a slot).
        scale: query scale; None for ``dk ** -0.5``.
        checkpoint_every: prefix checkpoints (static, a positive int, with ``context_lens`` and
            ``checkpoint_slots``): the state at every absolute position of a request that is a
            multiple of it.
        context_lens: ``(N,)`` integers: tokens of request ``i`` processed before this call
            (positions count from there).
        checkpoint_slots: ``(N, M)`` integers: checkpoint ``m`` of request ``i`` in this call (the
            state after its ``(context_lens[i] // every + 1 + m) * every``-th token) goes to
            ``checkpoint_slots[i, m]`` (negative: not stored). A request restarted from any
            checkpoint (``state_indices`` its slot, ``context_lens`` its position) continues the
            uninterrupted run.
        draft_slots: ``(N, S)`` integers: the state after the ``j``-th token of request ``i`` in
            this call goes to ``draft_slots[i, j]`` (negative: not stored); an engine rolls back
            to the last accepted draft by naming that slot next step.
        num_decodes: the first ``num_decodes`` requests are decodes of at most ``decode_len``
            tokens each (both static; an engine orders its batch decodes first). They run on
            the backend's decode op at the cost of their tokens, not a chunk each; 0: every
            request runs on the packed forward.
        decode_len: the most tokens of a decode request (1, or k + 1 to verify k drafts).
        mesh: a ``Mesh`` to split the heads over (:mod:`gdn2core.ops.ragged.mesh`); None: the
            mesh of q's sharding, if any.
        head_axes: the mesh axes of the heads (H, HV and the pool's HV split alike); None: those
            q's sharding shows, else every free axis whose size divides the heads.
        config: the backend's kernel config; None for the default.
        backend: a backend name, or ``"auto"``, as for :func:`gdn2_forward`; a named backend never
            falls back to another one.
        **features: the fused activations, as for :func:`gdn2_forward` (no ``segment_ids``).

    Every non-negative entry of ``state_indices``, ``checkpoint_slots`` and ``draft_slots`` is a
    slot the call writes; no slot may be named twice. Concrete metadata is checked (a
    ``ValueError`` names the argument and the entry). Under ``jax.jit`` the values are not known:
    an entry at or past ``P``, or a slot named twice, is invalid; a request with an invalid state
    index is skipped (nothing read or written, its checkpoints and drafts included; NaN outputs),
    an invalid checkpoint or draft entry is not stored, and a request's checkpoints past its
    ``M``-th are not stored. Offsets that decrease or pass T give unspecified outputs, but no
    write outside the slots named.

    Returns:
        ``(o, pool)``: o ``(T, HV, dv)`` in v's dtype; the pool with the named slots written.
        Donate the pool to the enclosing ``jax.jit`` (``donate_argnums``) to update it in place.

    Raises:
        ValueError, TypeError: bad shapes, dtypes or metadata (naming the argument).
        BackendNotFoundError, BackendUnsupportedError: as :func:`gdn2_forward`.
    """
    parsed = Features.parse(features, op="gdn2_ragged", packed=False)
    spec = RaggedSpec.from_inputs(
        q, k, v, w, b, g, pool, cu_seqlens=cu_seqlens, state_indices=state_indices,
        has_initial_state=has_initial_state, scale=scale, checkpoint_every=checkpoint_every,
        context_lens=context_lens, checkpoint_slots=checkpoint_slots, draft_slots=draft_slots,
        num_decodes=num_decodes, decode_len=decode_len,
    )  # fmt: skip
    if config is None:
        config = DEFAULT_CONFIG
    elif not isinstance(config, KernelConfig):
        raise TypeError(f"config: expected a KernelConfig or None, got {type(config).__name__}")
    metadata = dict(
        cu_seqlens=cu_seqlens, state_indices=state_indices, has_initial_state=has_initial_state,
        context_lens=context_lens, checkpoint_slots=checkpoint_slots, draft_slots=draft_slots,
    )  # fmt: skip
    static = dict(
        scale=scale, checkpoint_every=checkpoint_every, num_decodes=num_decodes,
        decode_len=decode_len, config=config, backend=backend,
    )  # fmt: skip
    plan = head_plan(spec, q, mesh=mesh, head_axes=head_axes)
    if plan is not None:
        local = functools.partial(ragged_call, **static)
        return sharded_ragged(local, plan, (q, k, v, w, b, g), pool, metadata, features)
    return run_call(spec, parsed, (q, k, v, w, b, g), pool, metadata, features, config, backend)


def ragged_call(q, k, v, w, b, g, pool, metadata: dict, features: dict, **static):
    """One device's call on the heads of its shard (``static``: the keywords bound in
    :func:`gdn2_ragged`): the shapes checked again, then run."""
    config, backend = static.pop("config"), static.pop("backend")
    parsed = Features.parse(features, op="gdn2_ragged", packed=False)
    spec = RaggedSpec.from_inputs(q, k, v, w, b, g, pool, **static, **metadata)
    return run_call(spec, parsed, (q, k, v, w, b, g), pool, metadata, features, config, backend)


def run_call(spec: RaggedSpec, parsed: Features, x, pool, metadata: dict, features: dict,
             config: KernelConfig, backend: str):  # fmt: skip
    """The validated call on one device: the decodes, then the packed requests."""
    n, d = spec.n_requests, spec.num_decodes
    flags = metadata["has_initial_state"]
    flags = jnp.ones((n,), bool) if flags is None else jnp.asarray(flags)
    ctx = metadata["context_lens"]
    ctx = None if ctx is None else jnp.asarray(ctx).astype(jnp.int32)
    slots = ragged_slots(
        spec, metadata["state_indices"], metadata["checkpoint_slots"], metadata["draft_slots"]
    )
    call = Call(
        spec=spec, cu=jnp.asarray(metadata["cu_seqlens"]).astype(jnp.int32), slots=slots,
        flags=flags, context_lens=ctx, features=parsed, raw_features=features, config=config,
        backend=backend,
    )  # fmt: skip
    if d == n:  # decodes only: o theirs (zero on tokens of no decode), padded to T rows
        o = jnp.zeros((0, spec.heads, spec.dv), x[2].dtype)
        if d:
            o, _, pool = run_decodes(call, x, pool)  # [R, HV, dv]
        return jnp.pad(o, ((0, spec.tokens - o.shape[0]), (0, 0), (0, 0))), pool
    done = run_pooled(call, x, pool)  # the kernels address the slots
    if done is not None:
        o, pool = done
    else:  # o [T, HV, dv]: zero on the decodes' tokens (one padded piece there)
        start = start_states(call, pool, d)
        o, pool = run_packed(call, x, pool, start)
    if d:  # the decodes' outputs into the leading R rows, in place
        o_dec, mine, pool = run_decodes(call, x, pool)  # [R, HV, dv], [R]
        r = o_dec.shape[0]
        # o's first R rows read apart (a barrier keeps XLA from fusing the read into the
        # update): an update that reads the buffer it writes is done on a copy of all of o
        # (in the v5e estimate 77 us for 64 decodes and 2 prompts of 2048, 4% of the step)
        head = jax.lax.optimization_barrier(o[:r])  # [R, HV, dv]
        o = o.at[:r].set(jnp.where(mine[:, None, None], o_dec, head))
    return o, pool


__all__ = ["gdn2_ragged"]
