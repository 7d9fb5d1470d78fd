"""The public functions: validate, pick the backend, run it (per shard on a multi-device mesh)."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from gdn2core.checks import state_dtype
from gdn2core.config import DEFAULT_CONFIG, KernelConfig
from gdn2core.features.activations import ACTIVATION_ARGS, activations_of
from gdn2core.ops.dispatch import run_backend, run_chunk_states
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.options import OpExtras, SegmentMode
from gdn2core.platform import call_platform
from gdn2core.selection import AUTO, resolve_backend
from gdn2core.sharding.plan import AxesArg, resolve_plan
from gdn2core.verdict import verdict

Out = tuple[Float[Array, "B T HV dv"], Float[Array, "L HV dk dv"]]
#: With ``return_chunk_states``: ``(o, h_final, chunk_states)``.
OutChunks = tuple[
    Float[Array, "B T HV dv"], Float[Array, "B HV dk dv"], Float[Array, "B NC HV dk dv"]
]


#: The keyword arguments of the model features (``docs/operator.md``), in signature order.
FEATURE_ARGS = ("segment_ids", "cu_seqlens", *ACTIVATION_ARGS)


def _features(arguments: dict) -> dict:
    """The feature keywords out of a public function's ``locals()``."""
    return {name: arguments[name] for name in FEATURE_ARGS}


def _prepare(args, scale, h0, config, backend, trainable, features, chunk_states=False):
    """Validate a call and choose its backend: ``(spec, config, backend, h0, extras)``."""
    activations = activations_of(features)
    extras = OpExtras(
        features["segment_ids"], features["cu_seqlens"], features["A_log"], features["dt_bias"]
    )
    spec = OpSpec.from_inputs(
        *args,
        scale,
        h0,
        segment_ids=extras.segment_ids,
        cu_seqlens=extras.cu_seqlens,
        activations=activations,
        A_log=extras.A_log,
        dt_bias=extras.dt_bias,
    )
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
    return spec, config, chosen, h0.astype(acc), extras


def _call(args, scale, h0, config, backend, trainable, sharding, features):
    spec, config, chosen, h0, extras = _prepare(
        args, scale, h0, config, backend, trainable, features
    )
    method = chosen.forward_trainable if trainable else chosen.forward

    def supports(local: OpSpec):
        return verdict(chosen, local, config, trainable=trainable, auto=False, platform=None)

    return run_backend(method, chosen, spec, config, args, h0, extras, sharding, supports)


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
    segment_ids: Int[Array, "B T"] | None = None,
    cu_seqlens: Int[Array, " N1"] | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Float[Array, " Hg"] | None = None,
    dt_bias: Float[Array, "Hg dk"] | None = None,
    lower_bound: float | None = None,
    use_bw_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    return_chunk_states: bool = False,
) -> Out | OutChunks:
    """The GDN-2 operator, forward only (inference). The contract is ``docs/operator.md``.

    Args:
        q, k: query and key, ``(B, T, H, dk)``.
        v, w: value and write gate, ``(B, T, HV, dv)``; ``HV`` (value heads) is ``H`` or a
            multiple of it (grouped value heads: value head ``j`` reads key head
            ``j // (HV // H)``).
        b, g: erase gate and log decay, ``(B, T, Hg, dk)`` with ``Hg`` = ``H`` (shared by each
            group of value heads) or ``HV``. All six share one floating dtype (float32,
            bfloat16 or float64).
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
        segment_ids: ``(B, T)`` integers, packed sequences: a sequence starts at token 0 and
            wherever the id differs from the previous token's; the state is reset to zero at
            every start except token 0, where ``h0`` enters; ``h_final`` leaves the last
            sequence of each row. Not with ``cu_seqlens``.
        cu_seqlens: ``(N + 1,)`` integers, fla's variable-length convention (B must be 1):
            sequence ``n`` is tokens ``cu_seqlens[n]:cu_seqlens[n + 1]``, starting from
            ``h0[n]``; ``h_final[n]`` is its last state. Must start at 0, not decrease and end at
            T (checked when concrete; under ``jax.jit`` invalid offsets give unspecified results).
        use_qk_l2norm_in_kernel: q and k are divided by ``sqrt(sum over dk of x^2 + 1e-6)``.
        use_gate_in_kernel: g is raw: ``g = -exp(A_log) * softplus(g + dt_bias)`` per head and
            channel, or with ``lower_bound``: ``g = lower_bound * sigmoid(exp(A_log) * g)``.
        A_log: ``(Hg,)``, with ``use_gate_in_kernel`` (any floating dtype; used in the state
            dtype); differentiable.
        dt_bias: ``(Hg, dk)``, with ``use_gate_in_kernel`` and no ``lower_bound``; differentiable.
        lower_bound: a float in ``[-5, 0)``: the bounded gate (only with ``use_gate_in_kernel``).
        use_bw_sigmoid_in_kernel: b and w are raw: ``b = sigmoid(b)``, ``w = sigmoid(w)``.
        allow_neg_eigval: ``b = 2 * sigmoid(b)`` (erase eigenvalues down to -1); needs
            ``use_bw_sigmoid_in_kernel``.
        return_chunk_states: also return the state at every chunk boundary (prefix caching,
            resuming a prompt): the state entering each chunk of ``config.bt`` tokens. Single
            device only, not with ``segment_ids`` or ``cu_seqlens``; backends declare it
            (``Capabilities.chunk_states``).

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
    features = _features(locals())
    args = (q, k, v, w, b, g)
    if return_chunk_states is False:
        return _call(args, scale, h0, config, backend, False, sharding, features)
    spec, config, chosen, h0, extras = _prepare(
        args, scale, h0, config, backend, False, features, chunk_states=return_chunk_states
    )
    if resolve_plan(chosen.capabilities.view(spec), q, **sharding) is not None:
        raise ValueError(
            "return_chunk_states: expected a single-device call, got a multi-device mesh "
            "(chunk states are not gathered across shards)"
        )
    return run_chunk_states(chosen, spec, config, args, h0, extras)


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
    segment_ids: Int[Array, "B T"] | None = None,
    cu_seqlens: Int[Array, " N1"] | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Float[Array, " Hg"] | None = None,
    dt_bias: Float[Array, "Hg dk"] | None = None,
    lower_bound: float | None = None,
    use_bw_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
) -> Out:
    """The GDN-2 operator, differentiable in q, k, v, w, b, g, h0, A_log and dt_bias.

    Gradients take cotangents on both o and h_final; they flow through the per-shard calls and
    the (small) context-parallel collectives; with fused activations they are with respect to the
    raw inputs. ``segment_ids`` and ``cu_seqlens`` are not differentiable. ``backend="auto"``
    passes over forward-only backends; naming one raises :class:`BackendUnsupportedError`.

    Args:
        q, k, v, w, b, g, scale, h0, config, backend, mesh, batch_axes, head_axes, context_axis,
            segment_ids, cu_seqlens, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log,
            dt_bias, lower_bound, use_bw_sigmoid_in_kernel, allow_neg_eigval: as for
            :func:`gdn2_forward`.

    Returns:
        ``(o, h_final)`` as for :func:`gdn2_forward`.

    Raises:
        As :func:`gdn2_forward`.
    """
    sharding = dict(
        mesh=mesh, batch_axes=batch_axes, head_axes=head_axes, context_axis=context_axis
    )
    features = _features(locals())
    args = (q, k, v, w, b, g)
    return _call(args, scale, h0, config, backend, True, sharding, features)


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
    *,
    segment_ids=None,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log=None,
    dt_bias=None,
    lower_bound: float | None = None,
    use_bw_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
) -> str:
    """The name of the backend a call with these arguments would run (nothing is computed).

    Args:
        q, k, v, w, b, g, scale, h0, config, backend: as for :func:`gdn2_forward`.
        trainable: judge a :func:`gdn2_forward_trainable` call (True) or a
            :func:`gdn2_forward` call (False).
        segment_ids, cu_seqlens, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
            lower_bound, use_bw_sigmoid_in_kernel, allow_neg_eigval: as for
            :func:`gdn2_forward` (a backend without packed sequences is not chosen for a call
            with ``segment_ids``).

    Returns:
        The backend name.

    Raises:
        As :func:`gdn2_forward`.
    """
    features = _features(locals())
    args = (q, k, v, w, b, g)
    return _prepare(args, scale, h0, config, backend, trainable, features)[2].name


__all__ = ["gdn2_forward", "gdn2_forward_trainable", "which_backend"]
