"""The packed requests of a ragged call on a backend's pooled forward, when it has one
(``Capabilities.pooled``, :mod:`gdn2core.features.pooled`): the kernels read every request's
start from its slot and write its final and checkpoint states to theirs, so nothing is gathered
from or scattered into the pool around them, and a checkpoint is the end of a chunk, not a cut
of the row. The decodes' tokens belong to no packed request: they cost the packed forward
nothing.

Calls the pooled forward cannot take run the pieces path of :mod:`gdn2core.ops.ragged.run` on
the same backend: a backend without it, or whose ``supports_pooled`` refuses the call (on
pallas_tpu: a checkpoint period the chunk does not divide, a chunk table too long for SMEM),
and calls with draft slots (a draft state follows any token, not a chunk's end).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gdn2core.checks import state_dtype
from gdn2core.features.pooled import FROM_NAN, FROM_ZEROS, PoolRequests
from gdn2core.ops.dispatch import backend_inputs
from gdn2core.ops.forward.api import which_backend
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.ops.ragged.run import Call, write_slots
from gdn2core.ops.ragged.spec import checkpoint_cuts
from gdn2core.options import OpExtras, SegmentMode
from gdn2core.registry import get_backend
from gdn2core.selection import AUTO
from gdn2core.verdict import ask, judge


def pool_requests(call: Call) -> PoolRequests:
    """The slots of the requests after the decodes, after the rules for invalid values."""
    spec, slots, d = call.spec, call.slots, call.spec.num_decodes
    state, flags = slots.state[d:], call.flags[d:]  # [n]
    starts = jnp.where((state >= 0) & flags, state, FROM_ZEROS)  # padded, new: zeros
    starts = jnp.where(slots.skipped[d:], FROM_NAN, starts).astype(jnp.int32)
    if not spec.checkpoint_cols:
        return PoolRequests(starts, state)
    ctx = call.context_lens[d:]  # [n]
    local = checkpoint_cuts(spec, call.cu[d:], ctx)  # [n, M]
    return PoolRequests(starts, state, ctx, local, slots.checkpoints[d:], spec.checkpoint_every)


def run_pooled(call: Call, x, pool: jax.Array) -> tuple[jax.Array, jax.Array] | None:
    """The requests after the decodes on the backend's pooled forward, or None when it has none
    or refuses the call (the caller then takes the pieces path).

    Args:
        call: the call.
        x: the flat ``(q, k, v, w, b, g)``.
        pool: the pool.

    Returns:
        ``(o, pool)``: o ``[T, HV, dv]`` (zero on the decodes' tokens, the padding and padded
        requests), the pool with these requests' slots written; or None.
    """
    spec, d = call.spec, call.spec.num_decodes
    if spec.draft_cols:
        return None
    n, t = spec.n_requests - d, spec.tokens
    row = tuple(a[None] for a in x)  # [1, T, heads, d]: one packed row
    cu = call.cu[d:]  # [n + 1]: the packed requests' offsets; the decodes' tokens before them
    features = call.features
    run = dict(scale=spec.scale, config=call.config, **call.raw_features)
    backend = call.backend
    if backend == AUTO:
        offsets = np.array([0] + [t] * n, np.int32)  # only the count matters to the choice
        backend = which_backend(*row, cu_seqlens=offsets, trainable=False, **run)
    chosen = get_backend(backend)
    if not chosen.capabilities.pooled:
        return None
    extras = features.extras
    op = OpSpec.from_inputs(
        *row, spec.scale, activations=features.activations, A_log=extras.A_log,
        dt_bias=extras.dt_bias,
    )  # fmt: skip
    op = dataclasses.replace(op, segments=SegmentMode.CU_SEQLENS, n_seqs=n)
    requests = pool_requests(call)
    config = call.config
    # The backend's verdict on the packed call, then on its pool (a refusal: the pieces path,
    # whose forward names the reason if the backend cannot run the call at all).
    if not judge(chosen, op, config, trainable=False, auto=False, platform=None):
        return None
    view = chosen.capabilities.view(op)
    if not ask(chosen, "supports_pooled", view, config, requests, spec.state_dtype):
        return None
    acc = state_dtype(spec.dtype)
    empty = jnp.zeros((0, *pool.shape[1:]), acc)
    given = OpExtras(cu_seqlens=cu, A_log=extras.A_log, dt_bias=extras.dt_bias)
    view, inputs, _, more = backend_inputs(chosen, op, row, empty, given, pooled=True)
    # An empty request writes its start to its slot: nothing to do, but for a new one (zeros).
    lens = cu[1:] - cu[:-1]  # [n]
    fresh = (lens == 0) & (requests.starts == FROM_ZEROS) & (requests.writes >= 0)
    zero = jnp.zeros((1, *pool.shape[1:]), pool.dtype)
    pool = write_slots(pool, fresh, requests.writes, lambda pool, i: zero)
    o, pool = chosen.forward_pooled(
        *inputs, pool, spec=view, config=config, extras=more, requests=requests
    )  # o: [1, T, H', dv']
    # o is zero on the decodes' tokens, the padding and padded requests (Backend.forward_pooled)
    return o.reshape(t, spec.heads, spec.dv).astype(x[2].dtype), pool  # [T, HV, dv]
