"""The differentiable op: one ``jax.custom_vjp`` over the forward and backward kernels.

Residuals (:class:`Residuals`, a registered dataclass): the six inputs in kernel layout (a bitcast
of the caller's arrays at the train shape, so they cost no memory), and what the training forward
writes for the backward: ``T`` and ``A_qk`` of every chunk, packed into one matrix (in the dtype the backward's products
round them to, see plan.py) and the float32 state entering every grid step. The backward recomputes
the rest (decay factors, ``Y``, ``U``, the states inside a step) in VMEM.

``jax.vmap``: the kernels write their outputs with manual DMAs indexed by grid position, which
Pallas's own batching of a ``pallas_call`` would not re-index. A vmapped call therefore folds the
mapped axis into the batch axis B (every kernel argument leads with B) and runs the kernels once
(:func:`_fold_vmap`).

Platform guard: the kernels are TPU kernels. Unless ``plan.interpret``, each call goes through
``lax.platform_dependent``: the TPU branch runs the kernel, any other platform a callback that
raises at run time with the fix. The branch is chosen at lowering time, so
``jit(...).lower(lowering_platforms=("tpu",))`` on a CPU host compiles the real kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gdn2_pallas_tpu import pooled, varlen
from gdn2_pallas_tpu.blocks import (
    TokenIO,
    forward_step,
    scalar_from_kernel,
    scalar_to_kernel,
    sequence_starts,
)
from gdn2_pallas_tpu.kernels_bwd import backward_call
from gdn2_pallas_tpu.kernels_fwd import forward_call
from gdn2_pallas_tpu.plan import Plan
from gdn2core.plugin import group_state

CPU_MESSAGE = (
    "gdn2 backend 'pallas_tpu' runs Pallas TPU kernels and needs a TPU, but this call runs on "
    "another platform. Run it on a TPU, or pass KernelConfig(interpret=True) to run the kernels "
    "in the (slow) TPU interpreter, or choose backend='jax_ref'."
)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q", "k", "v", "w", "b", "g", "starts", "TA", "states", "h0"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Residuals:
    """What the backward reads from the forward (token arrays in kernel layout, blocks.py)."""

    q: jax.Array  # [B, H, t_pad, K] (HEAD_MAJOR) or [B, t_pad, H, K] (TOKEN_MAJOR; H / key_groups)
    k: jax.Array
    v: jax.Array  # ... V ([B, t_pad, G H, V / G] with plan.value_groups = G)
    w: jax.Array  # ... V, or a scalar gate's [B, H / hb, n_steps, hb, nc C] f32 (blocks.py)
    b: jax.Array  # ... K, or a scalar gate's
    g: jax.Array  # ... K, or a scalar gate's
    starts: jax.Array | None  # [B, t_pad, 1] f32 sequence starts (packed sequences), or None
    TA: jax.Array  # [B, H / hb, n_steps, U, C, C] T (strictly lower) and A_qk^T (upper) per chunk
    states: jax.Array | None  # [B, H / hb, n_steps - 1, hb, K, V] plan.saved_state_dtype: the
    #   state entering every step but the first (None with one step)
    h0: jax.Array  # [B, H, K, V] f32: the state entering the first step


def _raise_not_tpu(*_):
    raise RuntimeError(CPU_MESSAGE)


def _on_tpu_only(fn, plan: Plan, *args):
    """Run ``fn(*args)`` (kernels) on TPU; elsewhere fail at run time with ``CPU_MESSAGE``.
    ``None`` arguments (absent optional inputs) are passed through to ``fn`` as they are."""
    present = [i for i, a in enumerate(args) if a is not None]

    def with_nones(*arrays):
        full = [None] * len(args)
        for i, a in zip(present, arrays, strict=True):
            full[i] = a
        return fn(*full)

    return _on_tpu_only_arrays(with_nones, plan, *(args[i] for i in present))


def _on_tpu_only_arrays(fn, plan: Plan, *args):
    if plan.interpret:
        return fn(*args)
    out_shapes = jax.eval_shape(fn, *args)

    def other(*a):
        return jax.pure_callback(_raise_not_tpu, out_shapes, *a, vmap_method="broadcast_all")

    return lax.platform_dependent(*args, tpu=fn, default=other)


def _fold_vmap(kernel_call, plan: Plan):
    """``kernel_call(*args)`` (every array argument and result leads with B; ``None`` arguments
    pass through), under ``jax.vmap`` run once on the mapped axis folded into B."""

    def call(*args):
        present = [i for i, a in enumerate(args) if a is not None]

        @jax.custom_batching.custom_vmap
        def arrays_call(*arrays):
            full = [None] * len(args)
            for i, a in zip(present, arrays, strict=True):
                full[i] = a
            return tuple(kernel_call(*full))

        @arrays_call.def_vmap
        def _rule(axis_size, in_batched, *arrays):
            if plan.varlen:
                raise NotImplementedError(
                    "gdn2 pallas_tpu: jax.vmap of a cu_seqlens call is not supported (the packed "
                    "row is one batch row); pack the sequences of every call into one row instead"
                )
            arrays = [
                x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
                for x, batched in zip(arrays, in_batched, strict=True)
            ]
            folded = [x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in arrays]
            full = [None] * len(args)
            for i, a in zip(present, folded, strict=True):
                full[i] = a
            plan_n = dataclasses.replace(plan, batch=axis_size * plan.batch)
            outs = _fold_vmap(_with_plan(kernel_call, plan_n), plan_n)(*full)
            outs = tuple(y.reshape(axis_size, plan.batch, *y.shape[1:]) for y in outs)
            return outs, (True,) * len(outs)

        return arrays_call(*(args[i] for i in present))

    return call


def _with_plan(kernel_call, plan: Plan):
    """The same kernel call with another plan (``kernel_call`` is a partial with ``plan=``)."""
    return functools.partial(
        kernel_call.func, *kernel_call.args, **{**kernel_call.keywords, "plan": plan}
    )


def _io(plan: Plan, name: str = "q") -> TokenIO:
    """The layout of input ``name`` (or of its gradient; o and dO are v's)."""
    io = TokenIO(plan, forward_step)
    return io.values() if name in VALUE_NAMES else io


INPUT_NAMES = ("q", "k", "v", "w", "b", "g")
VALUE_NAMES = ("v", "w")  # grouped values: in the caller's (B, T, HV, dv) (blocks.TokenIO.values)


def _to_kernel(plan: Plan, xs) -> list[jax.Array]:
    """``(q, k, v, w, b, g)`` in kernel layout: a scalar gate ``(B, T, H)`` as its
    ``(B, H / hb, n_steps, hb, nc C)`` float32 blocks (blocks.scalar_to_kernel)."""
    return [
        scalar_to_kernel(x, plan) if plan.scalar(name) else _io(plan, name).to_kernel(x)
        for name, x in zip(INPUT_NAMES, xs, strict=True)
    ]


def _from_kernel(plan: Plan, ys) -> list[jax.Array]:
    """Inverse of :func:`_to_kernel`; a scalar gate's (gradient) back in its input's dtype."""
    return [
        scalar_from_kernel(y, plan, plan.input_dtype(name))
        if plan.scalar(name)
        else _io(plan, name).from_kernel(y)
        for name, y in zip(INPUT_NAMES, ys, strict=True)
    ]


def _gate_params(A_log, dt_bias, plan: Plan):
    """(H, 2, K) float32: row 0 ``exp(A_log)``, row 1 ``dt_bias`` (zeros when absent); None
    without a fused gate."""
    if not plan.gate:
        return None
    a = jnp.broadcast_to(jnp.exp(A_log.astype(jnp.float32))[:, None], (plan.heads, plan.dk))
    dt = jnp.zeros_like(a) if dt_bias is None else dt_bias.astype(jnp.float32)
    return jnp.stack([a, dt], axis=1)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["segment_ids", "A_log", "dt_bias", "table", "seq_h0"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Extras:
    """The optional inputs of a call (None when absent): packed sequences (``segment_ids``
    (B, T); or the cu_seqlens chunk table (3, n_chunks) and per-sequence initial states
    (N, H, K, V), varlen.py) and the fused gate's parameters (``A_log`` (H,), ``dt_bias`` (H, K))."""

    segment_ids: jax.Array | None = None
    A_log: jax.Array | None = None
    dt_bias: jax.Array | None = None
    table: jax.Array | None = None
    seq_h0: jax.Array | None = None


NO_EXTRAS = Extras()


def _forward(q, k, v, w, b, g, h0, ex: Extras, plan: Plan, save: bool):
    """The forward kernel: ``(o, h_final, seq_h_final | None, saved, residual outputs)``."""
    xs = _to_kernel(plan, (q, k, v, w, b, g))
    starts = None if ex.segment_ids is None else sequence_starts(ex.segment_ids, plan)
    gate = _gate_params(ex.A_log, ex.dt_bias, plan)
    call = functools.partial(forward_call, plan=plan, save=save)
    outs = _on_tpu_only(
        _fold_vmap(call, plan), plan, *xs, starts, gate, ex.table, ex.seq_h0, h0.astype(jnp.float32)
    )
    o, h_final, *outs = outs
    seq_h_final = outs.pop(0) if plan.varlen else None
    return _io(plan, "v").from_kernel(o), h_final, seq_h_final, (xs, starts, gate), tuple(outs)


def gdn2_pallas_forward(q, k, v, w, b, g, h0, plan: Plan, extras: Extras = NO_EXTRAS):
    """Inference forward: ``(o, h_final, seq_h_final)`` (the last None without cu_seqlens), no
    residuals written."""
    o, h_final, seq_h_final, _, _ = _forward(q, k, v, w, b, g, h0, extras, plan, False)
    return o, h_final, seq_h_final


def gdn2_pallas_chunk_states(q, k, v, w, b, g, h0, plan: Plan, extras: Extras = NO_EXTRAS):
    """Inference forward that also writes the state entering every chunk (``plan.chunk_states``;
    no packed sequences): ``(o, h_final, chunk_states)``, the last ``(B, ceil(T / C), H, K, V)``
    float32."""
    if not plan.chunk_states or plan.varlen or plan.segments:
        raise ValueError("gdn2_pallas_chunk_states: expected a plan with chunk_states and no packed "
                         f"sequences, got chunk_states={plan.chunk_states}, varlen={plan.varlen}, "
                         f"segments={plan.segments}")  # fmt: skip
    o, h_final, _, _, (chunks,) = _forward(q, k, v, w, b, g, h0, extras, plan, False)
    n_chunks = -(-plan.seq_len // plan.C)  # the chunks of the caller's T, not of t_pad
    chunks = chunks if chunks.shape[1] == n_chunks else chunks[:, :n_chunks]
    if plan.value_groups > 1:  # (B, n, HV, K, V / G) -> the core's view (B, n, H, K, V)
        chunks = group_state(chunks, plan.value_groups)
    return o, h_final, chunks


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def gdn2_pallas_trainable(q, k, v, w, b, g, h0, extras: Extras, plan: Plan):
    """Differentiable forward: ``(o, h_final, seq_h_final)``; gradients in q, k, v, w, b, g, h0,
    and in the gate parameters and per-sequence initial states of ``extras``, by the backward
    kernel."""
    return gdn2_pallas_forward(q, k, v, w, b, g, h0, plan, extras)


def _vjp_fwd(q, k, v, w, b, g, h0, extras: Extras, plan: Plan):
    o, h_final, seq_h_final, (xs, starts, gate), (TA, *states) = _forward(
        q, k, v, w, b, g, h0, extras, plan, save=True
    )
    states = states[0] if states else None  # one step: none saved
    res = Residuals(*xs, starts=starts, TA=TA, states=states, h0=h0.astype(jnp.float32))
    return (o, h_final, seq_h_final), (res, gate, extras)


def _vjp_bwd(plan: Plan, saved, cotangents):
    res, gate, ex = saved
    do, dh_final, d_seq_h_final = cotangents
    do_k = _io(plan, "v").to_kernel(do.astype(res.v.dtype))
    if plan.varlen and d_seq_h_final is None:
        d_seq_h_final = jnp.zeros_like(ex.seq_h0)
    call = _fold_vmap(functools.partial(backward_call, plan=plan), plan)
    outs = _on_tpu_only(
        call,
        plan,
        *(res.q, res.k, res.v, res.w, res.b, res.g),
        do_k,
        res.starts,
        gate,
        ex.table,
        ex.seq_h0,
        None if not plan.varlen else d_seq_h_final.astype(jnp.float32),
        res.TA,
        res.states,
        res.h0,
        dh_final.astype(jnp.float32),
    )
    grads, dh0, outs = outs[:6], outs[6], list(outs[7:])
    d_gate = outs.pop(0) if plan.gate else None
    d_seq_h0 = outs.pop(0) if plan.varlen else None
    dA_log = d_dt = None
    if d_gate is not None:  # (B, H / hb, steps, hb, 2, K) per-step sums -> (H, 2, K)
        sums = jnp.sum(d_gate, axis=(0, 2)).reshape(plan.heads, 2, plan.dk)
        dA_log = jnp.sum(sums[:, 0], axis=1).astype(ex.A_log.dtype)
        d_dt = None if ex.dt_bias is None else sums[:, 1].astype(ex.dt_bias.dtype)
    d_ex = Extras(
        segment_ids=_no_gradient(ex.segment_ids),
        A_log=dA_log,
        dt_bias=d_dt,
        table=_no_gradient(ex.table),
        seq_h0=d_seq_h0,
    )
    if plan.key_groups > 1:  # dq, dk (B, t_pad, H / G * K) -> q's kernel layout
        grads = [g.reshape(res.q.shape) if i < 2 else g for i, g in enumerate(grads)]
    return (*_from_kernel(plan, grads), dh0, d_ex)


def _no_gradient(x):
    """The cotangent of an integer input (float0 zeros), or None."""
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


gdn2_pallas_trainable.defvjp(_vjp_fwd, _vjp_bwd)


def _row_h0(plan: Plan) -> jax.Array:
    """The zero h0 of a chunk-aligned row (its sequences' states enter by DMA)."""
    return jnp.zeros((1, plan.heads, plan.dk, plan.dv), jnp.float32)


def _padded_inputs(x, lay, plan: Plan, names: str = "qkvwbg"):
    """``(q, k, v, w, b, g)`` moved into the chunk-aligned row of ``lay`` (varlen.py or
    pooled.py); only those in ``names``, the others None. A padding or filler token must leave
    the state unchanged: g = 0, or with a fused gate the raw value whose activation is 0
    (softplus(-inf) = sigmoid(-inf) = 0)."""
    g_fill = -jnp.inf if plan.gate else 0.0
    return [
        varlen.to_padded(a, lay, fill=g_fill if n == "g" else 0.0) if n in names else None
        for n, a in zip("qkvwbg", x, strict=True)
    ]


def gdn2_pallas_varlen(q, k, v, w, b, g, seq_h0, cu_seqlens, plan: Plan, trainable: bool,
                       A_log=None, dt_bias=None, continues=None):  # fmt: skip
    """Packed sequences by ``cu_seqlens`` (varlen.py): q..g ``(1, T, H, d)``, ``seq_h0``
    ``(N, H, K, V)``; ``plan`` is the plan of the chunk-aligned row (``seq_len = t_pad``,
    ``n_seqs = N``); ``continues`` ``(N,)`` bool or None (forward only: those sequences start
    from the carried state). Returns ``(o, seq_h_final)``."""
    lay = varlen.layout(cu_seqlens, q.shape[1], plan.C, plan.t_pad, continues)
    xs, h0 = _padded_inputs((q, k, v, w, b, g), lay, plan), _row_h0(plan)
    ex = Extras(A_log=A_log, dt_bias=dt_bias, table=lay.table, seq_h0=seq_h0.astype(jnp.float32))
    if trainable:
        o, _, seq_h_final = gdn2_pallas_trainable(*xs, h0, ex, plan)
    else:
        o, _, seq_h_final = gdn2_pallas_forward(*xs, h0, plan, ex)
    return varlen.from_padded(o, lay), seq_h_final


def gdn2_pallas_pooled(q, k, v, w, b, g, pool, cu_seqlens, requests, plan: Plan, A_log=None,
                       dt_bias=None):  # fmt: skip
    """A ragged call's packed requests against the pool (pooled.py): q..g ``(1, T, H, d)``, the
    pool ``(P, HV, K, dv)`` float32 or bfloat16, ``requests`` a ``PoolRequests``; ``plan`` is the
    plan of the chunk-aligned row (``pool_groups = HV / H``). Returns ``(o, pool)``, the pool in
    place."""
    t = q.shape[1]
    lay = pooled.layout(cu_seqlens, requests, t, plan.C, plan.t_pad)
    slots, hv, dk, dv = pool.shape
    view = pool.reshape(slots, plan.heads, plan.pool_groups * dk, dv)  # [P, H, G K, dv]
    ex = Extras(A_log=A_log, dt_bias=dt_bias, table=lay.table, seq_h0=view)
    if plan.flat_tokens:
        # The kernel reads the flat tokens (flat_tokens.py), v and w as the caller laid them out
        # (T, HV, dv): the core's (T, H, G dv) view of them and this one cancel, no relayout.
        # Scalar gates (4 bytes a head and token) are moved into the row like a head-major call's.
        if not plan.scalar("w"):
            w = w.reshape(1, t, hv, dv)
        v = v.reshape(1, t, hv, dv)
        x = (q, k, v, w, b, g)
        scalar = _padded_inputs(x, lay, plan, "".join(plan.scalar_gates))  # None: not scalar
        xs = [
            pooled.flat_row(a, plan.step_len) if s is None else s
            for a, s in zip(x, scalar, strict=True)
        ]
    else:
        xs = _padded_inputs((q, k, v, w, b, g), lay, plan)
    o, _, new = gdn2_pallas_forward(*xs, _row_h0(plan), plan, ex)
    if plan.flat_tokens:  # o (1, T, HV, dv) at the flat tokens, in the core's view
        return o[:, :t].reshape(1, t, plan.heads, -1), new.reshape(pool.shape)  # [1, T, H, dv]
    return pooled.from_padded(o, lay), new.reshape(pool.shape)
