"""The public functions: validate, pick the backend, run it (per shard on a multi-device mesh)."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn2core.config import DEFAULT_CONFIG, KernelConfig
from gdn2core.platform import call_platform
from gdn2core.reference import state_dtype
from gdn2core.selection import AUTO, resolve_backend
from gdn2core.sharding.plan import AxesArg, resolve_plan
from gdn2core.sharding.run import sharded_call
from gdn2core.spec import OpSpec
from gdn2core.verdict import verdict

Out = tuple[Float[Array, "B T H dv"], Float[Array, "B H dk dv"]]


def _prepare(q, k, v, w, b, g, scale, h0, config, backend, trainable, chunk_states=False):
    spec = OpSpec.from_inputs(q, k, v, w, b, g, scale, h0)
    if config is None:
        config = DEFAULT_CONFIG
    elif not isinstance(config, KernelConfig):
        raise TypeError(f"config: expected a KernelConfig or None, got {type(config).__name__}")
    if not isinstance(chunk_states, bool):
        raise TypeError(f"return_chunk_states: expected a bool, got {type(chunk_states).__name__}")
    chosen = resolve_backend(
        spec, config, backend, trainable=trainable, platform=call_platform(q),
        chunk_states=chunk_states,
    )  # fmt: skip
    acc = state_dtype(q.dtype)
    h0 = jnp.zeros((spec.batch, spec.heads, spec.dk, spec.dv), acc) if h0 is None else h0
    return spec, config, chosen, h0.astype(acc)


def _run(method, chosen, spec, config, trainable, q, k, v, w, b, g, h0, sharding):
    """The backend call, per shard when the inputs (or the keywords) ask for a mesh."""
    plan = resolve_plan(spec, q, **sharding)
    if plan is None:
        return method(q, k, v, w, b, g, h0, spec=spec, config=config)

    def supports(local: OpSpec):
        return verdict(chosen, local, config, trainable=trainable, auto=False, platform=None)

    return sharded_call(
        method, plan, q, k, v, w, b, g, h0,
        spec=spec, config=config, supports=supports, check_vma=chosen.shard_map_check_vma,
    )  # fmt: skip


def gdn2_forward(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T H dv"],
    w: Float[Array, "B T H dv"],
    b: Float[Array, "B T H dk"],
    g: Float[Array, "B T H dk"],
    scale: float | None = None,
    h0: Float[Array, "B H dk dv"] | None = None,
    config: KernelConfig | None = None,
    backend: str = AUTO,
    *,
    mesh=None,
    batch_axes: AxesArg = None,
    head_axes: AxesArg = None,
    context_axis: str | None = None,
    return_chunk_states: bool = False,
) -> Out | tuple[Float[Array, "B T H dv"], Float[Array, "B H dk dv"], Float[Array, "B NC H dk dv"]]:
    """The GDN-2 operator, forward only (inference). The contract is ``docs/operator.md``.

    Args:
        q, k, b, g: query, key, erase gate and log decay, ``(B, T, H, dk)``.
        v, w: value and write gate, ``(B, T, H, dv)``. All six share one floating dtype
            (float32, bfloat16 or float64).
        scale: query scale, a real number; None for ``dk ** -0.5``.
        h0: initial state ``(B, H, dk, dv)``, float32 (float32 or float64 for float64 inputs);
            None for zeros.
        config: blocking and numerics of chunked backends; None for ``DEFAULT_CONFIG``.
        backend: a name from :func:`list_backends`, or ``"auto"``: the ``GDN2_BACKEND``
            environment variable when set, else the highest-priority backend that would run the
            call here. A named backend never falls back to another one.
        mesh, batch_axes, head_axes, context_axis: multi-device execution (see
            :mod:`gdn2core.sharding`): with the inputs on a multi-device mesh, or ``mesh=`` given,
            the backend runs once per device on its shard: batch over ``batch_axes``, heads over
            ``head_axes`` (default: read from the inputs' ``NamedSharding``) and, opt-in, time
            over ``context_axis`` (context parallelism; ``T`` must divide evenly).
        return_chunk_states: also return the state at every chunk boundary (prefix caching,
            resuming a prompt): the state entering each chunk of ``config.bt`` tokens. Single
            device only; backends declare it (``Capabilities.chunk_states``).

    Returns:
        ``(o, h_final)``: o ``(B, T, H, dv)`` in v's dtype, h_final ``(B, H, dk, dv)`` in the
        state dtype (float32; float64 for float64 inputs). With ``return_chunk_states``,
        ``(o, h_final, chunk_states)``: chunk_states ``(B, ceil(T / bt), H, dk, dv)`` in the
        state dtype, entry ``i`` the state after the first ``i * bt`` tokens (entry 0 is h0; the
        state after all T tokens is h_final).

    Raises:
        ValueError, TypeError: bad shapes, dtypes, scale or config (the message names the
            argument, the expected and the actual value).
        BackendNotFoundError: the named backend is not installed, or no backend can run the call.
        BackendUnsupportedError: the named backend cannot run this call here (with its reason).
    """
    spec, config, chosen, h0 = _prepare(
        q, k, v, w, b, g, scale, h0, config, backend, False, return_chunk_states
    )
    sharding = dict(
        mesh=mesh, batch_axes=batch_axes, head_axes=head_axes, context_axis=context_axis
    )
    if return_chunk_states:
        if resolve_plan(spec, q, **sharding) is not None:
            raise ValueError(
                "return_chunk_states: expected a single-device call, got a multi-device mesh "
                "(chunk states are not gathered across shards)"
            )
        return chosen.forward_chunk_states(q, k, v, w, b, g, h0, spec=spec, config=config)
    return _run(chosen.forward, chosen, spec, config, False, q, k, v, w, b, g, h0, sharding)


def gdn2_forward_trainable(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T H dv"],
    w: Float[Array, "B T H dv"],
    b: Float[Array, "B T H dk"],
    g: Float[Array, "B T H dk"],
    scale: float | None = None,
    h0: Float[Array, "B H dk dv"] | None = None,
    config: KernelConfig | None = None,
    backend: str = AUTO,
    *,
    mesh=None,
    batch_axes: AxesArg = None,
    head_axes: AxesArg = None,
    context_axis: str | None = None,
) -> Out:
    """The GDN-2 operator, differentiable in q, k, v, w, b, g and h0.

    Gradients take cotangents on both o and h_final; they flow through the per-shard calls and
    the (small) context-parallel collectives. ``backend="auto"`` passes over forward-only
    backends; naming one raises :class:`BackendUnsupportedError`.

    Args:
        q, k, v, w, b, g, scale, h0, config, backend, mesh, batch_axes, head_axes, context_axis:
            as for :func:`gdn2_forward`.

    Returns:
        ``(o, h_final)`` as for :func:`gdn2_forward`.

    Raises:
        As :func:`gdn2_forward`.
    """
    spec, config, chosen, h0 = _prepare(q, k, v, w, b, g, scale, h0, config, backend, True)
    sharding = dict(
        mesh=mesh, batch_axes=batch_axes, head_axes=head_axes, context_axis=context_axis
    )
    return _run(
        chosen.forward_trainable, chosen, spec, config, True, q, k, v, w, b, g, h0, sharding
    )


def which_backend(
    q, k, v, w, b, g, scale=None, h0=None, config=None, backend: str = AUTO, trainable=True
) -> str:
    """The name of the backend a call with these arguments would run (nothing is computed).

    Args:
        q, k, v, w, b, g, scale, h0, config, backend: as for :func:`gdn2_forward`.
        trainable: judge a :func:`gdn2_forward_trainable` call (True) or a
            :func:`gdn2_forward` call (False).

    Returns:
        The backend name.

    Raises:
        As :func:`gdn2_forward`.
    """
    *_, chosen, _ = _prepare(q, k, v, w, b, g, scale, h0, config, backend, trainable)
    return chosen.name


__all__ = ["gdn2_forward", "gdn2_forward_trainable", "which_backend"]
