"""The decode ``pallas_call``: S tokens of N sequences against a state pool, in place.

Grid ``(HV / hb, N)``: a step takes ``hb`` heads of one sequence (decode_plan.py); the sequence
axis is sequential ("arbitrary"), the head-block axis "parallel" (its steps touch disjoint memory,
and every DMA a head block starts is waited within it). Two int32 arrays come in by scalar
prefetch (SMEM): ``slots``, each sequence's slot, or ``-1``: skip (decode_op.py has sanitised
them: a slot in ``[0, P)`` is named by one sequence at most), and ``sources``, the sequence whose
slot a step's pool block maps (decode_op.py).

Reads. The pool's BlockSpec (``state_in``) reads block ``(slots[sources[n]], heads)``, pipelined by
Pallas (the next step's block is fetched while a step computes). A valid sequence maps its own
slot. A skipped one maps the slot of the nearest valid sequence before it (after it, before the
first valid one), so that its step revisits a block its neighbour maps anyway: no fetch of its
own, and it never maps the slot it named. Its step does not look at the block: nothing depends on
what a VMEM buffer holds at a skipped step, or on whether Pallas refetches a revisited block (a
refetch could overlap the neighbour's write-back: a read of a value nobody uses).

Writes. The pool's output (``state_out``) is the same HBM buffer (``input_output_aliases``), left
in HBM (``memory_space=pl.ANY``) and written only by the kernel's own DMAs
(``pltpu.make_async_copy``): a valid step computes head ``h``'s new state into ``written[n % 2,
h]`` and at once starts its DMA to ``pool[slot, head]``, so the writes of a step overlap its later
heads and the next steps. A skipped step starts no DMA: its outputs are NaN and the pool is
untouched. Before a step writes ``written[n % 2]`` it waits for the DMAs of step ``n - 2`` (which
used that buffer, and had all of step ``n - 1`` to finish); the last step of a head block waits for
its own and step ``n - 1``'s. Starts and waits both test ``0 <= slots[n] < P``, so they pair up,
and each named slot is read once and written once.

Fused activations (``plan.activations``, the chunked op's ``use_*_in_kernel`` keywords): the
token blocks hold the raw inputs, and each token's rows are activated in VMEM first, in float32,
by the chunked kernels' own functions (activations.activate_rows, on the ``[hb, d]`` rows: one
per head), with the gate's ``(2, hb, K)`` parameters (``exp(A_log)``, ``dt_bias``) of the step's
heads, fetched once per head block (their block index does not change along the sequences).

Grouped heads (``plan.key_groups``, ``plan.gate_groups``: decode_op.py): the q, k (b, g) blocks
hold the ``hb / G`` heads of the step's value heads, so XLA repeats nothing before the call. With
b, g on the key heads too (``key_groups == gate_groups = G``) every per-row quantity below (the
decay, the read vectors, the columns, ``k . q``) is computed once per key head and value head
``h`` takes row ``h // G``; with b, g on the value heads, value head ``h`` takes row ``h // G`` of
q, k and its own of b, g, and its read vectors are formed per head. Nothing is repeated: doing
that in VMEM by a small exact product (``E [q | k]``, ``E`` the 0/1 matrix of the groups) cost
the kernel 25% at N = 64 (v5e, bf16 tokens and pool, 16 key and 32 value heads, b, g on the
value heads: 126.6 -> 158.5 us), more than the 18 us of XLA repeats it saved.

Per token, with the decay folded into the read vectors (``d = exp(g)``; the form of
``gdn2_jax_ref.decode``)::

    [r; oq] = [d b k; d q] S                              one product on the MXU       [2, V]
    u       = w v - r
    S_t     = d S + k u^T                                 on the VPU                   [K, V]
    o_t     = scale (oq + (k . q) u)

The two reads are a ``[8, K] x [K, V]`` product at full float32 precision (``MatmulPrecision.F32``:
the product would otherwise cost a column broadcast of ``d b k`` and of ``d q`` per state row
block, the most expensive part of the step: 1.25x -> 0.9x the HBM bound at N = 8 on v5e by the
static cycle estimate); on a bfloat16 pool's block, whose values are bfloat16, the same float32
result comes from one bfloat16 pass on the read vectors' exact parts (:func:`_read_bf16`). The
update scales the rows of ``S`` (keys on sublanes, values on lanes) by
``d`` and adds ``k u^T``, so ``d`` and ``k`` are needed as columns: the step's ``[hb, K]`` rows are
transposed once per token (``[K, hb]``), and head ``h`` takes lane ``h``. All of it in float32.

Cost (static cycle estimate of v5e, N = 8, HV = 32, d = 128, every slot valid and distinct):
33.2 us with a float32 pool, 27.6 us with a bfloat16 one, against 33.3 and 26.6 us for the same
step with the pool's writes pipelined as BlockSpec blocks too. Reads by explicit DMAs as well cost
48 to 86 us (the estimate prices an explicit HBM read far above a pipelined one); a step's writes
started after its last head, 35.5 us (float32).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2_pallas_tpu import activations as act
from gdn2_pallas_tpu import refs
from gdn2_pallas_tpu.blocks import I0, hbm_any, interpret_params
from gdn2_pallas_tpu.decode_plan import DecodePlan, cost_decode
from gdn2_pallas_tpu.matmul import MatmulPrecision, mm, split_bf16_exact, traced_for
from gdn2_pallas_tpu.plan import NUM_SUBLANES

F32 = jnp.float32
#: The NaN of a skipped sequence's outputs (a NumPy float32: a kernel may not capture arrays).
NAN = np.float32(np.nan)
ONE = np.int32(1)  # int32 also under jax_enable_x64


@dataclasses.dataclass(frozen=True)
class DecodeRefs:
    """The kernel's refs by name, as :func:`decode_call`'s table (refs.py) lists them."""

    slots: object  # [N] int32, SMEM: each sequence's slot, -1: skip
    sources: object  # [N] int32, SMEM: the sequence whose slot each step's pool block maps
    q: object  # [S, hb / key_groups, K] tokens of this sequence and head block
    k: object
    v: object  # [S, hb, V]
    w: object
    b: object  # [S, hb / gate_groups, K]
    g: object
    gate_params: object | None  # [2, hb / gate_groups, K] f32 exp(A_log), dt_bias (plan.gate)
    state_in: object  # [hb, K, V] pool dtype: the mapped slot's heads, as read (pipelined)
    o: object  # [S, hb, V]
    state_out: object  # [P, HV, K, V] pool dtype, HBM: the pool (aliased), written by DMAs
    token_states: object | None  # [S, hb, K, V] pool dtype
    # Scratch.
    written: object  # [2, hb, K, V] pool dtype: a step's new state, by sequence parity
    sems: object  # DMA semaphores [2, hb]: a step's write of each head, by sequence parity
    work: object | None  # [hb, K, V] f32: the state across tokens (bfloat16 pool, S > 1)


def _token_index(head_block, seq, slots_ref, sources_ref):
    """A step's ``(S, hb, d)`` tokens: its sequence, all tokens, its heads."""
    return (seq, I0, head_block, I0)


def _state_index(head_block, seq, slots_ref, sources_ref, *, pool_size: int):
    """A step's ``(hb, K, V)`` pool block: the heads of the slot of its source sequence (clipped
    into the pool: slot 0 when no sequence is valid)."""
    slot = slots_ref[sources_ref[seq]]
    return (jnp.clip(slot, I0, np.int32(pool_size - 1)), head_block, I0, I0)


def _head_block_index(head_block, seq, slots_ref, sources_ref):
    """The ``(2, hb, K)`` gate parameters of a step's heads (the same for every sequence)."""
    return (head_block, I0, I0, I0)


def _token_state_index(head_block, seq, slots_ref, sources_ref):
    """A step's ``(S, hb, K, V)`` block of the token states."""
    return (seq, I0, head_block, I0, I0)


class _Writes:
    """The write-back DMAs of one head block's steps (module docstring)."""

    def __init__(self, r: DecodeRefs, plan: DecodePlan, head_block):
        self.r, self.plan, self.head_block = r, plan, head_block

    def valid(self, seq) -> jax.Array:
        """[] bool: sequence ``seq`` has a slot (in range: no DMA leaves the pool)."""
        slot = self.r.slots[seq]
        return jnp.logical_and(slot >= 0, slot < self.plan.pool_size)

    def copies(self, seq) -> list:
        """The DMA of each head of valid sequence ``seq``: ``[K, V]`` VMEM -> its slot in HBM.
        The step's scalars (parity, slot, first head) are computed once for all ``hb``: the
        scalar unit issues the DMAs, and per-head index arithmetic cost 15% of a bfloat16 step
        (static cycle estimate, N = 8)."""
        r = self.r
        parity = jnp.bitwise_and(seq, ONE)  # [] int32: the buffer of this sequence
        src = r.written.at[parity]  # [hb, K, V] VMEM
        dst = r.state_out.at[r.slots[seq]]  # [HV, K, V] HBM: the slot
        sems = r.sems.at[parity]  # [hb]
        first = self.head_block * self.plan.hb
        return [
            pltpu.make_async_copy(src.at[h], dst.at[first + h], sems.at[h])
            for h in map(np.int32, range(self.plan.hb))
        ]

    def wait(self, seq) -> None:
        """Wait for every head's DMA of sequence ``seq``, if it is valid (else none started)."""

        @pl.when(self.valid(seq))
        def _():
            for copy in self.copies(seq):
                copy.wait()


def _decode_kernel(r: DecodeRefs, *, plan: DecodePlan):
    head_block, seq = pl.program_id(0), pl.program_id(1)
    writes = _Writes(r, plan, head_block)
    valid = writes.valid(seq)
    last = np.int32(plan.n_seqs - 1)

    if plan.n_seqs > 2:

        @pl.when(seq >= 2)
        def _():  # written[seq % 2] is free once step seq - 2's DMAs are done
            writes.wait(seq - 2)

    @pl.when(jnp.logical_not(valid))
    def _():  # skipped: no DMA, the outputs NaN
        r.o[...] = jnp.full(r.o.shape, NAN, r.o.dtype)
        if r.token_states is not None:
            r.token_states[...] = jnp.full(r.token_states.shape, NAN, r.token_states.dtype)

    @pl.when(valid)
    def _():
        dst = r.written.at[jnp.bitwise_and(seq, ONE)]  # [hb, K, V]
        copies = writes.copies(seq)

        def write_back(h: int) -> None:  # head h's new state is in dst[h]: to the pool
            copies[h].start()

        if r.work is not None:  # bf16 pool, S > 1: the tokens on a float32 copy, rounded once
            _decode_token(r, r.state_in, r.work, I0, plan)
            _tokens(r, r.work, np.int32(1), np.int32(plan.tokens), plan)
            for h in range(plan.hb):
                dst[h] = r.work[h].astype(dst.dtype)
                write_back(h)
        elif plan.tokens == 1:
            _decode_token(r, r.state_in, dst, I0, plan, write_back)
        else:  # token 0 reads the fetched block, every token writes the new one
            _decode_token(r, r.state_in, dst, I0, plan)
            _tokens(r, dst, np.int32(1), np.int32(plan.tokens - 1), plan)
            _decode_token(r, dst, dst, np.int32(plan.tokens - 1), plan, write_back)

    @pl.when(seq == last)
    def _():  # no DMA of this head block may be in flight when it ends
        if plan.n_seqs > 1:
            writes.wait(seq - 1)
        writes.wait(seq)


def _tokens(r: DecodeRefs, state, start, stop, plan: DecodePlan) -> None:
    """Tokens ``start .. stop - 1`` in place on ``state`` [hb, K, V]."""

    def token(s, carry):
        _decode_token(r, state, state, s, plan)
        return carry

    lax.fori_loop(start, stop, token, 0)


def _decode_token(
    r: DecodeRefs, src, dst, s, plan: DecodePlan, after_head: Callable[[int], None] | None = None
) -> None:
    """Token ``s``: every head's state read from ``src`` [hb, K, V], the new one written to
    ``dst`` [hb, K, V] (then ``after_head(h)``), o and the token state written. A bfloat16
    ``src`` (the pool's block) is read by :func:`_read_bf16`, a float32 one at
    ``MatmulPrecision.F32``."""
    Gk, Gg = plan.key_groups, plan.gate_groups  # value heads per row of q, k and of b, g
    q, k = (x[s].astype(F32) for x in (r.q, r.k))  # [hb / Gk, K]
    b, g = (x[s].astype(F32) for x in (r.b, r.g))  # [hb / Gg, K]
    v, w = (x[s].astype(F32) for x in (r.v, r.w))  # [hb, V]
    if plan.activations is not None:  # raw -> activated, as the chunked kernels (activations.py)
        gp = None if r.gate_params is None else r.gate_params[...]  # [2, hb / Gg, K]
        x = act.activate_rows(q, k, b, w, g, gp, plan.activations, plan.l2norm_eps)
        q, k, b, w, g = x.q, x.k, x.b, x.w, x.g  # rows as given
    K = plan.dk
    d = jnp.exp(g)  # [hb / Gg, K]
    if Gk == Gg:  # one row per head of all four: each quantity once per row
        cols = jnp.swapaxes(jnp.stack([d, k]), 1, 2)  # [2, K, hb / Gk]: row i's d, k in lane i
        d_cols, k_cols = cols[0], cols[1]
        reads = jnp.stack([d * b * k, d * q], axis=1)  # [hb / Gk, 2, K]
    else:  # b, g on the value heads: the read vectors mix rows, per head below
        d_cols, k_cols = jnp.swapaxes(d, 0, 1), jnp.swapaxes(k, 0, 1)  # [K, hb / Gg], [K, hb / Gk]
        db = d * b  # [hb / Gg, K]
    pad = jnp.zeros((NUM_SUBLANES - 2, K), F32)  # the reads' rows padded to a sublane tile
    exact_parts = src.dtype == jnp.bfloat16
    z = w * v  # [hb, V]
    kq = jnp.sum(k * q, axis=1, keepdims=True)  # [hb / Gk, 1]
    outs = []
    for h in range(plan.hb):
        i, j = h // Gk, h // Gg  # value head h's rows of q, k and of b, g
        if Gk == Gg:
            read = reads[i]  # [2, K]: d b k, d q
        else:
            ki, qi, dj = k[i : i + 1], q[i : i + 1], d[j : j + 1]  # [1, K]
            read = jnp.concatenate([db[j : j + 1] * ki, dj * qi])  # [2, K]
        S = src[h].astype(F32)  # [K, V]
        if exact_parts:
            r_oq = _read_bf16(read, S)  # [2, V]
        else:
            lhs = jnp.concatenate([read, pad])  # [8, K]: d b k, d q, zeros
            r_oq = mm(lhs[None], S[None], MatmulPrecision.F32)[0]  # [8, V] on the MXU
        r_h, oq = r_oq[0:1], r_oq[1:2]  # [1, V]: S^T (d b k), S^T (d q)
        u = z[h : h + 1] - r_h  # [1, V]
        S_new = d_cols[:, j : j + 1] * S + k_cols[:, i : i + 1] * u  # [K, V] d S + k u^T
        dst[h] = S_new.astype(dst.dtype)
        if after_head is not None:
            after_head(h)
        if r.token_states is not None:
            r.token_states[s, h] = S_new.astype(r.token_states.dtype)
        outs.append(oq + kq[i : i + 1] * u)  # [1, V]
    r.o[s] = (plan.scale * jnp.concatenate(outs, axis=0)).astype(r.o.dtype)  # [hb, V]


def _read_bf16(rows: jax.Array, S: jax.Array) -> jax.Array:
    """``rows @ S`` [2, V] at float32 precision in one bfloat16 MXU pass, for ``S`` [K, V] of
    bfloat16 values (a bfloat16 pool's block): the float32 rows [2, K] go in as their three
    exact bfloat16 parts (matmul.split_bf16_exact) on six rows of one [8, K] operand, each
    product of two bfloat16 values is exact in the float32 accumulator, and the three partial
    rows are added back. Against ``Precision.HIGHEST`` (six passes): static cycle estimate of
    the N = 8, HV = 32, d = 128 step with a bfloat16 pool: v6e 44,946 -> 28,928 cycles, v5e
    37,490 -> 36,838. (A float32 pool split into three parts the same way, three passes: v6e
    45,876 -> 32,706 but v5e 39,623 -> 47,847; not taken.)"""
    K = rows.shape[1]
    parts = [x.astype(F32) for x in split_bf16_exact(rows)]  # 3 x [2, K] bf16 values
    lhs = jnp.concatenate([*parts, jnp.zeros((NUM_SUBLANES - 6, K), F32)])  # [8, K]
    out = mm(lhs[None], S[None], MatmulPrecision.BF16)[0]  # [8, V]
    return out[0:2] + out[2:4] + out[4:6]  # [2, V]


def decode_call(q, k, v, w, b, g, gate_params, state, slots, sources, *, plan: DecodePlan):
    """Tokens ``(N, S, HV, d)`` (raw with ``plan.activations``; q, k with ``HV / key_groups``
    heads and b, g with ``HV / gate_groups``: grouped heads, module docstring), the fused gate's
    parameters ``(HV / hb, 2, hb / gate_groups, K)`` float32 (None without one: ``plan.gate``;
    decode_op.gate_params),
    the pool ``(P, HV, K, V)``, ``slots`` and ``sources`` ``(N,)`` int32 -> ``(o, new_pool)``,
    plus the token states ``(N, S, HV, K, V)`` when ``plan.token_states``. The pool is updated
    in place when the caller donates it.

    ``slots``: each sequence's slot or ``-1``, no slot in ``[0, P)`` twice (two sequences on one
    slot would race; ``decode_op.gdn2_pallas_decode`` sanitises them; a slot out of range is
    skipped here too). ``sources``: ``decode_op.step_sources(slots)``."""
    S, hb, K, V = plan.tokens, plan.hb, plan.dk, plan.dv
    keys = pl.BlockSpec((None, S, hb // plan.key_groups, K), _token_index)  # q, k
    gates = pl.BlockSpec((None, S, hb // plan.gate_groups, K), _token_index)  # b, g
    vals = pl.BlockSpec((None, S, hb, V), _token_index)
    pool = pl.BlockSpec((None, hb, K, V), functools.partial(_state_index, pool_size=plan.pool_size))
    token_states = jax.ShapeDtypeStruct((plan.n_seqs, S, plan.heads, K, V), state.dtype)
    kernel_refs = refs.Table(
        refs.Prefetch("slots", slots),
        refs.Prefetch("sources", sources),
        refs.Input("q", keys, q),
        refs.Input("k", keys, k),
        refs.Input("v", vals, v),
        refs.Input("w", vals, w),
        refs.Input("b", gates, b),
        refs.Input("g", gates, g),
        refs.Input(
            "gate_params",
            pl.BlockSpec((None, 2, hb // plan.gate_groups, K), _head_block_index),
            gate_params if plan.gate else None,
        ),
        refs.Input("state_in", pool, state),
        refs.Output("o", vals, jax.ShapeDtypeStruct((plan.n_seqs, S, plan.heads, V), v.dtype)),
        refs.Output("state_out", hbm_any(), jax.ShapeDtypeStruct(state.shape, state.dtype)),
        refs.Output(
            "token_states",
            pl.BlockSpec((None, S, hb, K, V), _token_state_index),
            token_states if plan.token_states else None,
        ),
        refs.Scratch("written", pltpu.VMEM((2, hb, K, V), state.dtype)),
        refs.Scratch("sems", pltpu.SemaphoreType.DMA((2, hb))),
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
        kernel_refs.kernel(
            traced_for(functools.partial(_decode_kernel, plan=plan), plan.interpret is not None),
            DecodeRefs,
        ),
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
