"""The decode ``pallas_call``: S tokens of N sequences against a state pool, in place.

Grid ``(HV / hb, N)``: a step takes ``hb`` heads of one sequence (decode_plan.py); the sequence
axis is sequential ("arbitrary"), the head-block axis "parallel" (its steps touch disjoint
memory). Two int32 arrays come in by scalar prefetch (SMEM): ``slots``, each sequence's slot or
``-1`` (skip), and ``blocks``, the slot whose block the step maps (decode_op.py). The pool's
BlockSpec reads block ``(blocks[n], heads)`` and the output BlockSpec, aliased to the pool
(``input_output_aliases``), writes it back to the same place: only the named slots are read and
written, once each, every other slot is never touched, and Pallas's pipeline fetches the next
step's block and writes the previous one back while a step computes.

A skipped sequence maps the block of the nearest valid sequence before it (after it, for skipped
sequences before the first valid one): consecutive steps on the same block are a revisit (no
refetch, one writeback), and the skipped step copies the input block to the output block,
unchanged. For that copy to carry an update a valid step made just before it, a valid step writes
its new state to both blocks. Its outputs are NaN.

Per token, with the decay folded into the read vectors (``d = exp(g)``; the form of
``gdn2_jax_ref.decode``)::

    [r; oq] = [d b k; d q] S                              one product on the MXU       [2, V]
    u       = w v - r
    S_t     = d S + k u^T                                 on the VPU                   [K, V]
    o_t     = scale (oq + (k . q) u)

The two reads are a ``[8, K] x [K, V]`` product at full float32 precision (``MatmulPrecision.F32``:
the product would otherwise cost a column broadcast of ``d b k`` and of ``d q`` per state row
block, the most expensive part of the step: 1.25x -> 0.9x the HBM bound at N = 8 on v5e by the
static cycle estimate). The update scales the rows of ``S`` (keys on sublanes, values on lanes) by
``d`` and adds ``k u^T``, so ``d`` and ``k`` are needed as columns: the step's ``[hb, K]`` rows are
transposed once per token (``[K, hb]``), and head ``h`` takes lane ``h``. All of it in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2_pallas_tpu import refs
from gdn2_pallas_tpu.blocks import I0, interpret_params
from gdn2_pallas_tpu.decode_plan import DecodePlan, cost_decode
from gdn2_pallas_tpu.matmul import MatmulPrecision, mm
from gdn2_pallas_tpu.plan import NUM_SUBLANES

F32 = jnp.float32
#: The NaN of a skipped sequence's outputs (a NumPy float32: a kernel may not capture arrays).
NAN = np.float32(np.nan)


@dataclasses.dataclass(frozen=True)
class DecodeRefs:
    """The kernel's refs by name, as :func:`decode_call`'s table (refs.py) lists them."""

    slots: object  # [N] int32, SMEM: each sequence's slot, -1: skip
    blocks: object  # [N] int32, SMEM: the slot whose block each step maps
    q: object  # [S, hb, K] tokens of this sequence and head block
    k: object
    v: object  # [S, hb, V]
    w: object
    b: object  # [S, hb, K]
    g: object
    state_in: object  # [hb, K, V] pool dtype: the slot's heads, as read
    o: object  # [S, hb, V]
    state_out: object  # [hb, K, V] pool dtype: written back to the same slot (aliased)
    token_states: object | None  # [S, hb, K, V] pool dtype
    # Scratch.
    work: object | None  # [hb, K, V] f32: the state across tokens (bfloat16 pool, S > 1)


def _token_index(head_block, seq, slots_ref, blocks_ref):
    """A step's ``(S, hb, d)`` tokens: its sequence, all tokens, its heads."""
    return (seq, I0, head_block, I0)


def _state_index(head_block, seq, slots_ref, blocks_ref):
    """A step's ``(hb, K, V)`` pool block: the heads of the slot the step maps."""
    return (blocks_ref[seq], head_block, I0, I0)


def _token_state_index(head_block, seq, slots_ref, blocks_ref):
    """A step's ``(S, hb, K, V)`` block of the token states."""
    return (seq, I0, head_block, I0, I0)


def _decode_kernel(r: DecodeRefs, *, plan: DecodePlan):
    seq = pl.program_id(1)
    valid = r.slots[seq] >= 0

    @pl.when(jnp.logical_not(valid))
    def _():  # skipped: the block unchanged, the outputs NaN
        r.state_out[...] = r.state_in[...]
        r.o[...] = jnp.full(r.o.shape, NAN, r.o.dtype)
        if r.token_states is not None:
            r.token_states[...] = jnp.full(r.token_states.shape, NAN, r.token_states.dtype)

    @pl.when(valid)
    def _():
        # f32 pool: token 0 reads the input block; every token writes the output block, the last
        # one also the input block (for a skipped step revisiting it). bf16 pool with S > 1: the
        # tokens run on a float32 copy, rounded once at the end.
        if r.work is not None:
            r.work[...] = r.state_in[...].astype(F32)
            first, rest, last = r.work, r.work, (r.work,)
        else:
            first, rest, last = r.state_in, r.state_out, (r.state_out, r.state_in)
        if plan.tokens == 1:
            _decode_token(r, first, last, I0, plan)
        else:
            _decode_token(r, first, (rest,), I0, plan)

            def token(s, carry):
                _decode_token(r, rest, (rest,), s, plan)
                return carry

            lax.fori_loop(np.int32(1), np.int32(plan.tokens - 1), token, 0)
            _decode_token(r, rest, last, np.int32(plan.tokens - 1), plan)
        if r.work is not None:
            r.state_out[...] = r.work[...].astype(r.state_out.dtype)
            r.state_in[...] = r.state_out[...]


def _decode_token(r: DecodeRefs, src, dsts, s, plan: DecodePlan) -> None:
    """Token ``s``: every head's state read from ``src`` [hb, K, V], the new one written to each
    of ``dsts``, o and the token state written."""
    q, k, b, g = (x[s].astype(F32) for x in (r.q, r.k, r.b, r.g))  # [hb, K]
    v, w = (x[s].astype(F32) for x in (r.v, r.w))  # [hb, V]
    K = plan.dk
    d = jnp.exp(g)  # [hb, K]
    cols = jnp.swapaxes(jnp.stack([d, k]), 1, 2)  # [2, K, hb]: head h's d and k in lane h
    reads = jnp.stack([d * b * k, d * q], axis=1)  # [hb, 2, K]
    pad = jnp.zeros((NUM_SUBLANES - 2, K), F32)  # the reads' rows padded to a sublane tile
    z = w * v  # [hb, V]
    kq = jnp.sum(k * q, axis=1, keepdims=True)  # [hb, 1]
    outs = []
    for h in range(plan.hb):
        S = src[h].astype(F32)  # [K, V]
        lhs = jnp.concatenate([reads[h], pad])  # [8, K]: d b k, d q, zeros
        r_oq = mm(lhs[None], S[None], MatmulPrecision.F32)[0]  # [8, V] on the MXU
        r_h, oq = r_oq[0:1], r_oq[1:2]  # [1, V]: S^T (d b k), S^T (d q)
        u = z[h : h + 1] - r_h  # [1, V]
        S_new = cols[0, :, h : h + 1] * S + cols[1, :, h : h + 1] * u  # [K, V] d S + k u^T
        for dst in dsts:
            dst[h] = S_new.astype(dst.dtype)
        if r.token_states is not None:
            r.token_states[s, h] = S_new.astype(r.token_states.dtype)
        outs.append(oq + kq[h : h + 1] * u)  # [1, V]
    r.o[s] = (plan.scale * jnp.concatenate(outs, axis=0)).astype(r.o.dtype)  # [hb, V]


def decode_call(q, k, v, w, b, g, state, slots, blocks, *, plan: DecodePlan):
    """Tokens ``(N, S, HV, d)``, the pool ``(P, HV, K, V)``, ``slots`` and ``blocks`` ``(N,)``
    int32 -> ``(o, new_pool)``, plus the token states ``(N, S, HV, K, V)`` when
    ``plan.token_states``. The pool is updated in place when the caller donates it."""
    S, hb, K, V = plan.tokens, plan.hb, plan.dk, plan.dv
    keys = pl.BlockSpec((None, S, hb, K), _token_index)
    vals = pl.BlockSpec((None, S, hb, V), _token_index)
    pool = pl.BlockSpec((None, hb, K, V), _state_index)
    token_states = jax.ShapeDtypeStruct((plan.n_seqs, S, plan.heads, K, V), state.dtype)
    kernel_refs = refs.Table(
        refs.Prefetch("slots", slots),
        refs.Prefetch("blocks", blocks),
        refs.Input("q", keys, q),
        refs.Input("k", keys, k),
        refs.Input("v", vals, v),
        refs.Input("w", vals, w),
        refs.Input("b", keys, b),
        refs.Input("g", keys, g),
        refs.Input("state_in", pool, state),
        refs.Output("o", vals, jax.ShapeDtypeStruct((plan.n_seqs, S, plan.heads, V), v.dtype)),
        refs.Output("state_out", pool, jax.ShapeDtypeStruct(state.shape, state.dtype)),  # aliased
        refs.Output(
            "token_states",
            pl.BlockSpec((None, S, hb, K, V), _token_state_index),
            token_states if plan.token_states else None,
        ),
        refs.Scratch("work", pltpu.VMEM((hb, K, V), F32) if plan.staged_f32 else None),
        aliases={"state_in": "state_out"},  # the pool, in place
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=kernel_refs.num_scalar_prefetch,
        grid=plan.grid(),
        in_specs=kernel_refs.in_specs,
        out_specs=kernel_refs.out_specs,
        scratch_shapes=kernel_refs.scratch_shapes,
    )
    return pl.pallas_call(
        kernel_refs.kernel(functools.partial(_decode_kernel, plan=plan), DecodeRefs),
        out_shape=kernel_refs.out_shape,
        grid_spec=grid_spec,
        input_output_aliases=kernel_refs.input_output_aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"),
            vmem_limit_bytes=plan.vmem_limit_bytes,
        ),
        cost_estimate=pl.CostEstimate(**cost_decode(plan)),
        interpret=interpret_params(plan),
        name="gdn2_decode",
    )(*kernel_refs.operands)
