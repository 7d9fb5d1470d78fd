"""Running a backend per shard: batch/head sharding and context parallelism, both in shard_map.

``fn`` is a backend's ``forward`` or ``forward_trainable`` (keyword arguments ``spec`` and
``config``); it runs once per device on that device's shard, so it never has to be partitioned by
XLA (a Pallas kernel cannot be).

Context parallelism (time split into ``P`` contiguous shards over ``plan.context_axis``). Written
per (batch, head), the state after a shard that starts from ``S_in`` is affine in ``S_in``::

    S_out = A_p S_in + B_p                  A_p (dk, dk): transition, B_p (dk, dv): zero-start state
    o_t   = o0_t + S_in^T a_t               o0_t: output from a zero start, a_t = scale A_{1..t}^T q_t

because every value column of the state evolves independently under the same left-multiplying
operators ``(I - k_t (b_t k_t)^T) D_t``. One backend call on the shard computes all four: the
value axis is widened to ``dv + dk``; the first ``dv`` columns are the real ``(w * v)`` writes from
``h0 = 0`` (giving ``o0`` and ``B_p``), the last ``dk`` columns have ``w = v = 0`` (no writes) from
``h0 = I`` (giving ``a_t`` as their output and ``A_p`` as their final state). If the backend cannot
take ``dv + dk`` it is called twice (value sizes ``dv`` and ``dk``). Then the ``(A_p, B_p)`` of all
shards are all-gathered over the context axis (``P * dk * (dk + dv)`` floats per head), every device
runs the ``P``-step combine ``S_in^{p+1} = A_p S_in^p + B_p`` from the true ``h0``, picks its own
incoming state, and completes its outputs with one ``(T/P, dk) x (dk, dv)`` matmul per head. No
tensor of length ``T`` crosses devices, forward or backward (the backward of the all-gather is a
reduce-scatter of the same small summaries).

Two shard_maps: stage 1 runs only the backend (type check ``check_vma`` off unless the backend
opts in, since a backend's scan carries need not be typed for shard_map) and returns the
summaries with a leading axis of size ``P``; stage 2 (type-checked) holds every collective.
Both make manual only the mesh axes the plan uses; other mesh axes stay automatic, so inputs
replicated over them are neither gathered nor their gradients all-reduced.

Scalar gates (``(B, T, H)``, KDA's and GDN's) reach the shards' calls as they are, context
parallelism's too: b and g act on the key axis, which is not widened, and w enters only as
``w * v``, with ``v = 0`` on the transition columns, so a scalar w needs no value there (and gets
no gradient from them).

Packed sequences (``segment_ids``): each shard's call gets its own slice of the ids, so resets
inside a shard happen in the backend call (a reset zeroes the ``h0 = I`` columns too: the
transition of a shard with a start inside is 0 from there on). A shard whose first token starts a
new sequence (its id differs from the previous shard's last) starts its transition columns from
``0`` instead of ``I``, so the incoming state does not enter it. ``cu_seqlens`` with context
parallelism is refused.

Precision: ``o0`` and ``a`` come out of the backend in the inputs' dtype, so bfloat16 inputs round
them before the completion ``o0 + S_in^T a`` (float32); the state path is float32 throughout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from gdn2core.config import KernelConfig
from gdn2core.features.segments import shard_boundary_starts
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.options import OpExtras
from gdn2core.sharding.plan import ShardPlan

BackendFn = Callable[..., tuple[jax.Array, jax.Array]]

_HI = lax.Precision.HIGHEST


def shard_map(f, *, mesh, in_specs, out_specs, check_vma: bool, axis_names: frozenset[str]):
    """``jax.shard_map`` making only ``axis_names`` manual (the other mesh axes stay automatic)."""
    kw = {} if axis_names == frozenset(mesh.axis_names) else {"axis_names": axis_names}
    return jax.shard_map(
        f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma, **kw
    )


def sharded_call(
    fn: BackendFn,
    plan: ShardPlan,
    q,
    k,
    v,
    w,
    b,
    g,
    h0,
    *,
    spec: OpSpec,
    config: KernelConfig,
    extras: OpExtras | None = None,
    supports: Callable[[OpSpec], bool] | None = None,
    check_vma: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``fn`` on every shard of ``plan``; returns the global ``(o, h_final)``.

    ``extras`` (the backend's feature arrays, or None) are split with the inputs: segment_ids by
    batch (and time), A_log and dt_bias by heads, cu_seqlens replicated (its one row is never
    split over batch; context parallelism with cu_seqlens is refused). ``supports(local_spec)``
    says whether ``fn`` takes a widened value axis (context parallelism uses ``dv + dk`` columns
    when it can, else two calls); None means yes. ``check_vma``: the shard_map type check of the
    backend's own shard_map (off by default: a backend's scan carries need not be typed for
    shard_map); the context-parallel combine is always checked.
    """
    local = plan.local_spec(spec)
    _require(supports, local, plan)
    tok, st = plan.token_spec, plan.state_spec
    # a scalar gate (B, T, H) splits as the token arrays without their channel axis
    gates = tuple(PartitionSpec(*tok[:3]) if x.ndim == 3 else tok for x in (w, b, g))
    names, arrays, specs = _extras_args(plan, extras)
    q, k, v, w, b, g, h0, *arrays = reshard_explicit(
        plan.mesh, (q, k, v, w, b, g, h0, *arrays), (tok, tok, tok, *gates, st, *specs)
    )

    def rebuild(local_arrays) -> dict:
        if extras is None:
            return {}
        return {"extras": OpExtras(**dict(zip(names, local_arrays, strict=True)))}

    if plan.context_axis is None:

        def body(q, k, v, w, b, g, h0, *xs):
            return fn(q, k, v, w, b, g, h0, spec=local, config=config, **rebuild(xs))

        mapped = shard_map(
            body,
            mesh=plan.mesh,
            axis_names=plan.used_axes,
            in_specs=(tok, tok, tok, *gates, st, *specs),
            out_specs=(tok, st),
            check_vma=check_vma,
        )
        return mapped(q, k, v, w, b, g, h0, *arrays)

    if extras is not None and extras.cu_seqlens is not None:
        raise ValueError(
            f"cu_seqlens: context parallelism (context_axis={plan.context_axis!r}) is not "
            "supported with cu_seqlens; pass segment_ids instead (h0 then enters the first "
            "sequence of the row and h_final leaves the last), or drop context_axis"
        )
    # Stage 1: the backend on every shard, no communication. Summaries come out with a leading
    # axis of size P (one entry per context shard): (P, B, H, dk, dk) and (P, B, H, dk, dv).
    axis = plan.context_axis
    wide = dataclasses.replace(local, dv=local.dv + local.dk)
    fused = supports is None or bool(supports(wide))
    if not fused:  # two calls: value sizes dv, then dk (the transition)
        _require(supports, dataclasses.replace(local, dv=local.dk), plan)
    varying = (*plan.batch_axes, *plan.head_axes, axis) if check_vma else ()
    summary = PartitionSpec(axis, *st[:2], None, None)
    # A shard whose first token starts a new sequence ignores the incoming state: (B, P) flags.
    segment_ids = None if extras is None else extras.segment_ids
    resets = (
        () if segment_ids is None else (shard_boundary_starts(segment_ids, plan.context_shards),)
    )
    reset_spec = (PartitionSpec(tok[0], axis),) * len(resets)

    def stage1(q, k, v, w, b, g, *rest):
        reset = rest[0][:, 0] if resets else None  # [B] this shard starts a sequence
        more = rebuild(rest[len(resets) :])
        o0, a, b_p, a_p = shard_summaries(
            fn, local, config, fused, q, k, v, w, b, g, axes=varying, reset=reset, **more
        )
        return o0, a, b_p[None], a_p[None]

    o0, a, b_all, a_all = shard_map(
        stage1,
        mesh=plan.mesh,
        axis_names=plan.used_axes,
        in_specs=(tok, tok, tok, *gates, *reset_spec, *specs),
        out_specs=(tok, tok, summary, summary),
        check_vma=check_vma,
    )(q, k, v, w, b, g, *resets, *arrays)

    # Stage 2: exchange the summaries, combine, complete the outputs (type-checked shard_map).
    def stage2(o0, a, b_p, a_p, h0):
        return _combine_local(axis, plan.context_shards, o0, a, b_p[0], a_p[0], h0, v.dtype)

    return shard_map(
        stage2,
        mesh=plan.mesh,
        axis_names=plan.used_axes,
        in_specs=(tok, tok, summary, summary, st),
        out_specs=(tok, st),
        check_vma=True,
    )(o0, a, b_all, a_all, h0)


def _extras_args(plan: ShardPlan, extras: OpExtras | None):
    """The present fields of ``extras`` as (names, arrays, PartitionSpecs)."""
    if extras is None:
        return (), [], []
    tok = plan.token_spec
    heads = tok[2]
    layout = {
        "segment_ids": PartitionSpec(tok[0], tok[1]),  # (B, T)
        "cu_seqlens": PartitionSpec(),  # (N + 1,) replicated
        "A_log": PartitionSpec(heads),  # (H,)
        "dt_bias": PartitionSpec(heads, None),  # (H, dk)
    }
    present = [(n, getattr(extras, n)) for n in layout if getattr(extras, n) is not None]
    return (
        tuple(n for n, _ in present),
        [x for _, x in present],
        [layout[n] for n, _ in present],
    )


def _require(supports, local: OpSpec, plan: ShardPlan) -> None:
    """Refuse, with the backend's reason, a per-device call the backend cannot run."""
    if supports is None:
        return
    verdict = supports(local)
    if not verdict:
        reason = getattr(verdict, "reason", "")
        raise ValueError(
            f"gdn2: the backend cannot run the per-device shard ({plan.describe()}; "
            f"B={local.batch} T={local.seq_len} H={local.heads} dk={local.dk} dv={local.dv}): "
            f"{reason}"
        )


def reshard_explicit(mesh, args, specs):
    """On a mesh with ``Explicit`` axes shard_map refuses arguments whose sharding differs from its
    in_specs (Auto axes are resharded silently): reshard them (a no-op when they already match)."""
    if not any(t == AxisType.Explicit for t in mesh.axis_types):
        return args
    return tuple(
        jax.sharding.reshard(x, NamedSharding(mesh, s)) for x, s in zip(args, specs, strict=True)
    )


def _vary(x, axes: tuple[str, ...]):
    """``x`` (a constant built inside the shard) typed as varying over the manual mesh ``axes``,
    like the sharded inputs: shard_map's type check wants a backend's scan carry built from ``x``
    to match its outputs built from the inputs."""
    if not axes:
        return x
    pcast = getattr(lax, "pcast", None)
    if pcast is not None:
        return pcast(x, axes, to="varying")
    pvary = getattr(lax, "pvary", None)  # JAX versions before pcast
    return x if pvary is None else pvary(x, axes)


def shard_summaries(
    fn, local: OpSpec, config, fused: bool, q, k, v, w, b, g, *, axes=(), reset=None, **more
):
    """Per-shard ``(o0, a, B_p, A_p)`` of the module docstring, from one or two calls of ``fn``.

    ``axes``: the manual mesh axes the inputs vary over (inside shard_map), for the constants.
    ``reset``: None, or ``(B,)`` bool: the shard's first token starts a new sequence, so the
    incoming state does not enter (``a = 0``, ``A_p = 0``). ``more``: ``extras=`` for ``fn``.
    """
    bl, tl, hl, dk = q.shape
    dv = v.shape[-1]
    acc = jnp.float64 if v.dtype == jnp.float64 else jnp.float32
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=acc), (bl, hl, dk, dk))  # [B, H, dk, dk]
    if reset is not None:
        eye = jnp.where(reset[:, None, None, None], jnp.zeros_like(eye), eye)
    eye = _vary(eye, axes)
    zeros_k = _vary(jnp.zeros((bl, tl, hl, dk), v.dtype), axes)
    zero_state = _vary(jnp.zeros((bl, hl, dk, dv), acc), axes)
    # w enters only as w * v, and v = 0 on the transition columns: a scalar w (B, T, H) needs
    # no columns of its own there (its gradient from them is 0), so it reaches the calls as is
    scalar_w = w.ndim == 3
    if fused:
        spec2 = dataclasses.replace(local, dv=dv + dk)
        o2, s2 = fn(
            q, k,
            jnp.concatenate([v, zeros_k], axis=-1),
            w if scalar_w else jnp.concatenate([w, zeros_k], axis=-1),
            b, g,
            jnp.concatenate([zero_state, eye], axis=-1),
            spec=spec2, config=config, **more,
        )  # fmt: skip
        return o2[..., :dv], o2[..., dv:], s2[..., :dv], s2[..., dv:]
    o0, b_p = fn(q, k, v, w, b, g, zero_state, spec=local, config=config, **more)
    spec_a = dataclasses.replace(local, dv=dk)
    w_a = w if scalar_w else zeros_k
    a, a_p = fn(q, k, zeros_k, w_a, b, g, eye, spec=spec_a, config=config, **more)
    return o0, a, b_p, a_p


def combine_summaries(h0, a_all, b_all):
    """Sequential combine over the ``P`` shards: returns (incoming states ``[P, ...]``, final)."""

    def step(s, ab):
        a_p, b_p = ab
        s_next = jnp.einsum("bhij,bhjv->bhiv", a_p, s, precision=_HI) + b_p
        return s_next, s

    h_final, incoming = lax.scan(step, h0, (a_all, b_all))
    return incoming, h_final


def _combine_local(axis, n_shards, o0, a, b_p, a_p, h0, out_dtype):
    # The only communication: P x (dk x dk + dk x dv) per local head.
    a_all = lax.all_gather(a_p.astype(h0.dtype), axis)
    b_all = lax.all_gather(b_p.astype(h0.dtype), axis)
    # h0 is replicated over the context axis; the gathered summaries are typed as varying.
    incoming, h_final = combine_summaries(_vary(h0, (axis,)), a_all, b_all)
    me = lax.axis_index(axis)
    s_in = lax.dynamic_index_in_dim(incoming, me, axis=0, keepdims=False)
    o = o0.astype(h0.dtype) + jnp.einsum("bthk,bhkv->bthv", a.astype(h0.dtype), s_in, precision=_HI)
    # Every device holds the same h_final; take the last shard's, so that it is replicated over
    # the context axis by construction (a psum of dk x dv per head).
    h_final = lax.psum(jnp.where(me == n_shards - 1, h_final, jnp.zeros_like(h_final)), axis)
    return o.astype(out_dtype), h_final
