"""The public functions of the chunked op: validate, pick the backend, run it (per shard on a
multi-device mesh) through :mod:`gdn2core.ops.dispatch`."""

from __future__ import annotations

import dataclasses
from typing import Unpack

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn2core.checks import state_dtype
from gdn2core.config import DEFAULT_CONFIG, KernelConfig
from gdn2core.features.activations import per_channel_bias
from gdn2core.ops.dispatch import run_backend
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.options import FeatureArgs, Features, SegmentMode
from gdn2core.platform import call_platform
from gdn2core.selection import AUTO, resolve_backend
from gdn2core.sharding.plan import AxesArg
from gdn2core.verdict import judge

Out = tuple[Float[Array, "B T HV dv"], Float[Array, "L HV dk dv"]]
#: With ``return_chunk_states``: ``(o, h_final, chunk_states)``.
OutChunks = tuple[
    Float[Array, "B T HV dv"], Float[Array, "B HV dk dv"], Float[Array, "B NC HV dk dv"]
]


def _prepare(args, scale, h0, config, backend, trainable, features: Features, chunk_states=False,
             continued=False):  # fmt: skip
    """Validate a call and choose its backend: ``(spec, config, backend, h0)``."""
    extras = features.extras
    spec = OpSpec.from_inputs(
        *args, scale, h0,
        segment_ids=extras.segment_ids, cu_seqlens=extras.cu_seqlens,
        activations=features.activations, A_log=extras.A_log, dt_bias=extras.dt_bias,
        per_head_dt_bias=True,
    )  # fmt: skip
    if continued:
        spec = dataclasses.replace(spec, continued=True)
    if config is None:
        config = DEFAULT_CONFIG
    elif not isinstance(config, KernelConfig):
        raise TypeError(f"config: expected a KernelConfig or None, got {type(config).__name__}")
    if not isinstance(chunk_states, bool):
        raise TypeError(f"return_chunk_states: expected a bool, got {type(chunk_states).__name__}")
    if chunk_states and spec.segments != SegmentMode.NONE:
        raise ValueError(
            f"return_chunk_states: expected a call without packed sequences, got {spec.segments} "
            "(chunk states are per chunk of a row, not per sequence)"
        )
    platform = call_platform(args[0])
    chosen = resolve_backend(
        spec, config, backend, trainable=trainable, platform=platform, chunk_states=chunk_states
    )
    acc = state_dtype(args[0].dtype)
    shape = (spec.state_rows, spec.value_heads, spec.dk, spec.dv)
    h0 = jnp.zeros(shape, acc) if h0 is None else h0
    return spec, config, chosen, h0.astype(acc)


def _call(args, scale, h0, config, backend, trainable, sharding, features, chunk_states=False):
    spec, config, chosen, h0 = _prepare(
        args, scale, h0, config, backend, trainable, features, chunk_states
    )

    def supports(local: OpSpec):
        return judge(chosen, local, config, trainable=trainable, auto=False, platform=None)

    extras = per_channel_bias(features.extras, spec.dk)  # dt_bias (Hg, dk) for every backend
    return run_backend(
        chosen, spec, config, args, h0, extras, sharding, supports,
        trainable=trainable, chunk_states=chunk_states,
    )  # fmt: skip


def gdn2_forward(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T HV dv"],
    w: Float[Array, "B T HV dv"],
    b: Float[Array, "B T Hg dk"],
    g: Float[Array, "B T Hg dk"],
    scale: float | None = None,
    h0: Float[Array, "L HV dk dv"] | None = None,
    config: KernelConfig | None = None,
    backend: str = AUTO,
    *,
    mesh=None,
    batch_axes: AxesArg = None,
    head_axes: AxesArg = None,
    context_axis: str | None = None,
    return_chunk_states: bool = False,
    **features: Unpack[FeatureArgs],
) -> Out | OutChunks:
    """The GDN-2 operator, forward only (inference). The contract is ``docs/operator.md``.

    Args:
        q, k: query and key, ``(B, T, H, dk)``.
        v, w: value and write gate, ``(B, T, HV, dv)``; ``HV`` (value heads) is ``H`` or a
            multiple of it (grouped value heads: value head ``j`` reads key head
            ``j // (HV // H)``).
        b, g: erase gate and log decay, ``(B, T, Hg, dk)`` with ``Hg`` = ``H`` (shared by each
            group of value heads) or ``HV``. All six share one floating dtype (float32,
            bfloat16 or float64), except ``g``, which may be float32 beside bfloat16 inputs
            (fla's layers compute the log decay in float32; it is then kept in float32).
        scale: query scale, a real number; None for ``dk ** -0.5``.
        h0: initial state ``(B, HV, dk, dv)`` (``(N, HV, dk, dv)`` with ``cu_seqlens``), float32
            (float32 or float64 for float64 inputs); None for zeros.
        config: blocking and numerics of chunked backends; None for ``DEFAULT_CONFIG``.
        backend: a name from :func:`list_backends`, or ``"auto"``: the ``GDN2_BACKEND``
            environment variable when set, else the highest-priority backend that would run the
            call here. A named backend never falls back to another one.
        mesh, batch_axes, head_axes, context_axis: multi-device execution (see
            :mod:`gdn2core.sharding`): with the inputs on a multi-device mesh, or ``mesh=`` given,
            the backend runs once per device on its shard: batch over ``batch_axes``, heads over
            ``head_axes`` (default: read from the inputs' ``NamedSharding``) and, opt-in, time
            over ``context_axis`` (context parallelism; ``T`` must divide evenly; not with
            ``cu_seqlens``).
        return_chunk_states: also return the state at every chunk boundary (prefix caching,
            resuming a prompt): the state entering each chunk of ``config.bt`` tokens. Single
            device only, not with ``segment_ids`` or ``cu_seqlens``; backends declare it
            (``Capabilities.chunk_states``).
        **features: the model features (:class:`gdn2core.options.FeatureArgs`, fla's names):
            ``segment_ids``, ``cu_seqlens`` (packed sequences; ``cu_seqlens`` values must start
            at 0, not decrease and end at T: checked when concrete, unspecified results under
            ``jax.jit``), ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``, ``A_log``,
            ``dt_bias``, ``lower_bound``, ``use_bw_sigmoid_in_kernel``, ``allow_neg_eigval``
            (the fused activations; ``A_log`` and ``dt_bias`` are differentiable).

    Returns:
        ``(o, h_final)``: o ``(B, T, HV, dv)`` in v's dtype, h_final ``(B, HV, dk, dv)``
        (``(N, HV, dk, dv)`` with ``cu_seqlens``) in the state dtype (float32; float64 for
        float64 inputs). With ``return_chunk_states``, ``(o, h_final, chunk_states)``:
        chunk_states ``(B, ceil(T / bt), HV, dk, dv)`` in the state dtype, entry ``i`` the state
        after the first ``i * bt`` tokens (entry 0 is h0; the state after all T tokens is
        h_final).

    Raises:
        ValueError, TypeError: bad shapes, dtypes, scale, config or feature arguments (the
            message names the argument, the expected and the actual value).
        BackendNotFoundError: the named backend is not installed, or no backend can run the call.
        BackendUnsupportedError: the named backend cannot run this call here (with its reason,
            e.g. ``segment_ids`` on a backend without packed sequences).
    """
    sharding = dict(
        mesh=mesh, batch_axes=batch_axes, head_axes=head_axes, context_axis=context_axis
    )
    parsed = Features.parse(features, op="gdn2_forward")
    args = (q, k, v, w, b, g)
    return _call(args, scale, h0, config, backend, False, sharding, parsed, return_chunk_states)


def gdn2_forward_trainable(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T HV dv"],
    w: Float[Array, "B T HV dv"],
    b: Float[Array, "B T Hg dk"],
    g: Float[Array, "B T Hg dk"],
    scale: float | None = None,
    h0: Float[Array, "L HV dk dv"] | None = None,
    config: KernelConfig | None = None,
    backend: str = AUTO,
    *,
    mesh=None,
    batch_axes: AxesArg = None,
    head_axes: AxesArg = None,
    context_axis: str | None = None,
    **features: Unpack[FeatureArgs],
) -> Out:
    """The GDN-2 operator, differentiable in q, k, v, w, b, g, h0, A_log and dt_bias.

    Gradients take cotangents on both o and h_final; they flow through the per-shard calls and
    the (small) context-parallel collectives; with fused activations they are with respect to the
    raw inputs. ``segment_ids`` and ``cu_seqlens`` are not differentiable. ``backend="auto"``
    passes over forward-only backends; naming one raises :class:`BackendUnsupportedError`.

    Args:
        q, k, v, w, b, g, scale, h0, config, backend, mesh, batch_axes, head_axes, context_axis,
            **features: as for :func:`gdn2_forward`.

    Returns:
        ``(o, h_final)`` as for :func:`gdn2_forward`.

    Raises:
        As :func:`gdn2_forward`.
    """
    sharding = dict(
        mesh=mesh, batch_axes=batch_axes, head_axes=head_axes, context_axis=context_axis
    )
    parsed = Features.parse(features, op="gdn2_forward_trainable")
    args = (q, k, v, w, b, g)
    return _call(args, scale, h0, config, backend, True, sharding, parsed)


def forward_continued(
    args: tuple[jax.Array, ...],
    h0: jax.Array,
    *,
    cu_seqlens: jax.Array,
    continues: jax.Array,
    scale: float,
    config: KernelConfig | None,
    backend: str,
    **features: Unpack[FeatureArgs],
) -> Out:
    """A packed forward whose sequences may continue the state of the one before (the ragged op's
    one-pass path; inference only, single device). Not a public function: the sequences a caller
    sees are the ones it packed; the ragged op cuts its requests into pieces and joins them here.

    Args:
        args: ``(q, k, v, w, b, g)`` of one packed row (B = 1).
        h0: ``(N, HV, dk, dv)`` per sequence (read only where ``continues`` is false).
        cu_seqlens: ``(N + 1,)`` offsets.
        continues: ``(N,)`` bool: sequence ``n`` starts from the state sequence ``n - 1`` left.
        scale, config, backend, **features: as for :func:`gdn2_forward`.

    Returns:
        ``(o, h_final)`` as for :func:`gdn2_forward` with ``cu_seqlens``.

    Raises:
        BackendUnsupportedError: the backend does not declare ``Capabilities.continued``.
    """
    parsed = Features.parse({**features, "cu_seqlens": cu_seqlens}, op="forward_continued")
    extras = dataclasses.replace(parsed.extras, continues=jnp.asarray(continues, bool))
    parsed = dataclasses.replace(parsed, extras=extras)
    spec, config, chosen, h0 = _prepare(args, scale, h0, config, backend, False, parsed, False,
                                        continued=True)  # fmt: skip

    def supports(local: OpSpec):
        return judge(chosen, local, config, trainable=False, auto=False, platform=None)

    extras = per_channel_bias(extras, spec.dk)
    return run_backend(chosen, spec, config, args, h0, extras, {}, supports, trainable=False)


def which_backend(
    q,
    k,
    v,
    w,
    b,
    g,
    scale=None,
    h0=None,
    config=None,
    backend: str = AUTO,
    trainable=True,
    **features: Unpack[FeatureArgs],
) -> str:
    """The name of the backend a call with these arguments would run (nothing is computed).

    Args:
        q, k, v, w, b, g, scale, h0, config, backend: as for :func:`gdn2_forward`.
        trainable: judge a :func:`gdn2_forward_trainable` call (True) or a
            :func:`gdn2_forward` call (False).
        **features: as for :func:`gdn2_forward` (a backend without packed sequences is not
            chosen for a call with ``segment_ids``).

    Returns:
        The backend name.

    Raises:
        As :func:`gdn2_forward`.
    """
    parsed = Features.parse(features, op="which_backend")
    args = (q, k, v, w, b, g)
    return _prepare(args, scale, h0, config, backend, trainable, parsed)[2].name


__all__ = ["gdn2_forward", "gdn2_forward_trainable", "which_backend"]
