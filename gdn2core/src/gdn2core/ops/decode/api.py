"""The decode op: a few new tokens per sequence against a pool of recurrent states.

Serving runs in two phases: a prefill over the prompt (the chunked forward, with
``return_chunk_states=True`` for prefix caching) and then decode steps of ``S`` new tokens per
sequence (``S = 1``, or up to a chunk to verify speculated tokens) against the state each sequence
left behind. The states live in a pool ``(P, HV, dk, dv)``; ``state_indices`` names each
sequence's slot (continuous batching), and the op returns the pool with those slots advanced and
every other slot unchanged, bit for bit. The contract is the decode section of
``docs/operator.md``.

The core validates the call (:class:`~gdn2core.ops.decode.spec.DecodeSpec`), resolves grouped value
heads (q, k and H-headed b, g are repeated to the HV value heads: tiny token arrays, while the
pool, the traffic that bounds a decode step, is untouched), broadcasts scalar gates (one value
per head and token, as KDA's and GDN's beta and GDN's decay) to their channels, turns the indices
into the slots a backend receives (:func:`~gdn2core.ops.decode.spec.sanitize_slots`) and runs the
backend's :meth:`~gdn2core.plugin.Backend.decode`. The fused activations of the chunked op (gate,
q/k L2 norm, b/w sigmoids; the same keywords as :func:`gdn2core.gdn2_forward`) are applied by the
core in XLA before the backend's decode
(:func:`gdn2core.features.activations.apply_activations`, the path of the chunked op for
backends that do not fuse them), unless the backend declares ``Capabilities.decode_activations``:
then its decode gets the raw inputs, the resolved spec's ``activations`` and the gate's
parameters per value head (``extras``, :func:`decode_extras`), and applies them itself
(pallas_tpu: in VMEM, which saves the step the small XLA ops of the activations; TPU compiler
estimate: ``gdn2 bench --decode --tpu v5e --no-timing --gate softplus``, docs/results.md).

Scalar gates reach the decode backends broadcast, unlike the chunked op's: a decode step's gate
bytes are small beside its pool slots, and the pallas_tpu decode kernel reading them as
``(N, HV, S)`` columns and broadcasting them in VMEM was estimated slower than this (TPU
compiler's static estimate, v5e, N = 8, S = 1, HV = 32, d = 128, bfloat16 tokens and pool, 16
heads a grid step, GDN's three scalar gates: kernel 23.65 against 23.06 us, the step's XLA ops 8.76 against 8.69 us, the gates'
relayout costing as much as their broadcast; N = 64: kernel 164.6 against 159.9 us).
"""

from __future__ import annotations

import dataclasses
from typing import Unpack

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from gdn2core.backend import Backend
from gdn2core.checks import is_float32_decay, state_dtype
from gdn2core.config import DEFAULT_CONFIG, KernelConfig
from gdn2core.features.activations import apply_activations, check_gate_params
from gdn2core.features.scalar_gates import broadcast_gates
from gdn2core.ops.decode.spec import DecodeSpec, backend_decay, expand_heads, sanitize_slots
from gdn2core.options import NO_ACTIVATIONS, Activations, FeatureArgs, Features, OpExtras
from gdn2core.platform import call_platform
from gdn2core.selection import AUTO, resolve_decode_backend

DecodeOut = (
    tuple[Float[Array, "N S HV dv"], Float[Array, "P HV dk dv"]]
    | tuple[Float[Array, "N S HV dv"], Float[Array, "P HV dk dv"], Float[Array, "N S HV dk dv"]]
)


def _resolve(
    q, k, v, w, b, g, state, state_indices, scale, return_token_states, config, backend, features
):
    """Validate a call and choose its backend: ``(spec, resolved spec, config, activations,
    backend)``."""
    spec = DecodeSpec.from_inputs(
        q, k, v, w, b, g, state, state_indices, scale, return_token_states
    )
    activations = features.activations
    check_gate_params(
        activations, features.extras.A_log, features.extras.dt_bias, spec.gate_heads, spec.dk
    )
    if config is None:
        config = DEFAULT_CONFIG
    elif not isinstance(config, KernelConfig):
        raise TypeError(f"config: expected a KernelConfig or None, got {type(config).__name__}")
    resolved = spec.resolved()
    chosen = resolve_decode_backend(resolved, config, backend, platform=call_platform(q))
    return spec, resolved, config, activations, chosen


def gdn2_decode(
    q: Float[Array, "N S H dk"],
    k: Float[Array, "N S H dk"],
    v: Float[Array, "N S HV dv"],
    w: Float[Array, "N S HV dv"] | Float[Array, "N S HV"],
    b: Float[Array, "N S Hg dk"] | Float[Array, "N S Hg"],
    g: Float[Array, "N S Hg dk"] | Float[Array, "N S Hg"],
    state: Float[Array, "P HV dk dv"],
    *,
    state_indices: Int[Array, " N"] | None = None,
    scale: float | None = None,
    return_token_states: bool = False,
    config: KernelConfig | None = None,
    backend: str = AUTO,
    **features: Unpack[FeatureArgs],
) -> DecodeOut:
    """``S`` new tokens of each of ``N`` sequences against a state pool (inference only).

    Each sequence ``n`` starts from the state in its slot ``state_indices[n]``, runs the GDN-2
    recurrence over its ``S`` tokens (exactly as :func:`gdn2_forward` would over the same tokens
    with that state as ``h0``), and leaves the state after its last token in the same slot.

    Args:
        q, k: ``(N, S, H, dk)``: query and key of the new tokens.
        v, w: ``(N, S, HV, dv)``: value and write gate; ``HV`` a multiple of ``H`` (grouped value
            heads: value head ``j`` reads key head ``j // (HV / H)``).
        b, g: ``(N, S, H, dk)`` or ``(N, S, HV, dk)``: erase gate and log decay. Scalar gates
            (KDA's and GDN's beta, GDN's decay) may come without their channel axis, w
            ``(N, S, HV)`` and b, g ``(N, S, H or HV)``: the same value on every channel; the
            core broadcasts them to their channels before the backend (docs/operator.md,
            decode). The six share one
            floating dtype (float32, bfloat16 or float64), but g may be float32 beside bfloat16
            inputs (fla's layers compute the log decay in float32): kept so by a backend with
            ``Capabilities.float32_decay``, else rounded to bfloat16 by the core first.
        state: the pool ``(P, HV, dk, dv)``, float32 or bfloat16 (bfloat16 halves the memory a
            serving batch needs; float64 too for float64 inputs). The arithmetic is float32
            (float64 for float64 inputs) from the slot's value to the last token; the result is
            rounded to the pool's dtype once per call.
        state_indices: ``(N,)`` integers, the slot of each sequence, each in ``[0, P)`` and no slot
            twice; None: sequence ``n`` uses slot ``n`` and ``P`` must equal ``N``. Concrete
            indices are checked here. Under ``jax.jit`` they cannot be: a sequence whose index is
            out of range, or whose slot another sequence of the call also names, is skipped:
            nothing is read or written for it (every slot it does not own keeps its value) and its
            outputs are NaN.
        scale: query scale, a real number; None for ``dk ** -0.5``.
        return_token_states: also return the state after each of the ``S`` tokens (for a
            speculative decoder to roll back to the last accepted token).
        config: read by backends with kernel options (``interpret``); None for the default.
        backend: a backend name, or ``"auto"``: the ``GDN2_BACKEND`` environment variable when set,
            else the highest-priority backend with a decode op that would run the call here. A
            named backend never falls back to another one.
        **features: the fused activations, as for :func:`gdn2_forward`
            (``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``, ``A_log``, ``dt_bias``,
            ``lower_bound``, ``use_bw_sigmoid_in_kernel``, ``allow_neg_eigval``;
            ``A_log (Hg,)``, ``dt_bias (Hg, dk)``, ``Hg`` the heads of b and g). The core
            applies them in XLA before the backend's decode, in the state dtype, q, k, w, b
            rounded to the input dtype and the activated g kept in the state dtype (as the
            chunked op does for backends that do not fuse them, and as a fused gate keeps it),
            so a model calls the chunked op and the decode op with the same raw inputs.

    Returns:
        ``(o, new_state)``, or ``(o, new_state, token_states)`` with ``return_token_states``:
        o ``(N, S, HV, dv)`` in v's dtype; the pool ``(P, HV, dk, dv)`` in its dtype, the named
        slots advanced and every other slot bit for bit as given; token_states
        ``(N, S, HV, dk, dv)`` in the pool's dtype (the last equals the slot written back).

        In place: the Pallas kernel writes the named slots of the pool it is given
        (``input_output_aliases``). Donate the pool to the enclosing ``jax.jit``
        (``donate_argnums``) and XLA updates it without a copy; without donation XLA first copies
        the pool, so that the caller's array stays valid::

            step = jax.jit(
                lambda q, k, v, w, b, g, pool, idx: gdn2_decode(
                    q, k, v, w, b, g, pool, state_indices=idx
                ),
                donate_argnums=(6,),
            )
            o, pool = step(q, k, v, w, b, g, pool, idx)  # the old pool array is consumed

    Raises:
        ValueError, TypeError: bad shapes, dtypes, scale, config, or (concrete) indices out of
            range or repeated; the message names the argument, the expected and the actual value.
        BackendNotFoundError: the named backend is not installed, or no backend can run the call.
        BackendUnsupportedError: the named backend cannot run this call here (no decode op, or
            its reason).
    """
    parsed = Features.parse(features, op="gdn2_decode", packed=False)
    spec, _, config, activations, chosen = _resolve(
        q, k, v, w, b, g, state, state_indices, scale, return_token_states, config, backend,
        parsed,
    )  # fmt: skip
    _, w, b, g = broadcast_gates(spec, w, b, g)  # scalar gates to their channels (module docstring)
    extras = parsed.extras
    fused = activations.any and chosen.capabilities.decode_activations
    if activations.any and not fused:  # an activated g is float32 beside bfloat16 inputs
        q, k, w, b, g = apply_activations(activations, q, k, w, b, g, extras.A_log, extras.dt_bias)
    slots = sanitize_slots(state_indices, spec.n_seqs, spec.pool_size)
    o, new_state, token_states = backend_decode(
        chosen, spec, (q, k, v, w, b, g), state, slots, config,
        activations if fused else NO_ACTIVATIONS, extras,
    )  # fmt: skip
    if return_token_states:
        return o, new_state, token_states
    return o, new_state


def backend_decode(
    chosen: Backend, spec: DecodeSpec, x, state, slots, config: KernelConfig,
    activations: Activations, extras: OpExtras,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:  # fmt: skip
    """Run a validated decode call on ``chosen`` (``gdn2_decode``, and the ragged op's decodes).

    Args:
        chosen: the backend.
        spec: the call's spec, with its own key and gate heads (not resolved).
        x: ``(q, k, v, w, b, g)``, the gates broadcast to their channels; activated by the core,
            or raw when ``activations.any``.
        state: the pool.
        slots: ``(N,)`` int32 slots sanitised by the core (:func:`sanitize_slots`).
        config: the kernel config.
        activations: those the backend applies itself (``Capabilities.decode_activations``),
            else :data:`NO_ACTIVATIONS`.
        extras: the fused gate's parameters (``A_log``, ``dt_bias`` on the gate heads).

    Returns:
        The backend's ``(o, new_state, token_states | None)``. q, k, b and g are repeated to the
        value heads unless it reads them grouped (``Capabilities.grouped_decode``); a float32 g
        beside bfloat16 inputs reaches it as it is only with ``Capabilities.float32_decay``.
    """
    q, k, v, w, b, g = x
    caps = chosen.capabilities
    resolved = dataclasses.replace(
        spec.resolved(), float32_decay=is_float32_decay(g.dtype, q.dtype), sanitized_slots=True
    )
    if caps.grouped_decode:
        resolved = dataclasses.replace(
            resolved, key_heads=spec.key_heads, gate_heads=spec.gate_heads
        )
    else:
        q, k, b, g = (expand_heads(a, spec.heads) for a in (q, k, b, g))
    resolved, g = backend_decay(resolved, g, caps.float32_decay)
    more = {}  # the gate's parameters, for a backend that applies the activations itself
    if activations.any:
        resolved = dataclasses.replace(resolved, activations=activations)
        more["extras"] = decode_extras(extras, spec.heads, state_dtype(q.dtype))
    return chosen.decode(q, k, v, w, b, g, state, slots, spec=resolved, config=config, **more)


def decode_extras(extras: OpExtras, heads: int, dtype) -> OpExtras:
    """The fused gate's ``A_log`` ``(HV,)`` and ``dt_bias`` ``(HV, dk)`` in ``dtype`` (the state
    dtype), repeated from the gate heads to the ``HV`` heads as b and g are (None when absent)."""

    def per_head(x):
        return None if x is None else jnp.repeat(x, heads // x.shape[0], axis=0).astype(dtype)

    return OpExtras(A_log=per_head(extras.A_log), dt_bias=per_head(extras.dt_bias))


def which_decode_backend(
    q,
    k,
    v,
    w,
    b,
    g,
    state,
    *,
    state_indices=None,
    scale=None,
    return_token_states: bool = False,
    config=None,
    backend: str = AUTO,
    **features: Unpack[FeatureArgs],
) -> str:
    """The name of the backend a :func:`gdn2_decode` call with these arguments would run.

    Args:
        q, k, v, w, b, g, state, state_indices, scale, return_token_states, config, backend,
            **features: as for :func:`gdn2_decode`.

    Returns:
        The backend name.

    Raises:
        As :func:`gdn2_decode`.
    """
    parsed = Features.parse(features, op="which_decode_backend", packed=False)
    *_, chosen = _resolve(
        q, k, v, w, b, g, state, state_indices, scale, return_token_states, config, backend,
        parsed,
    )  # fmt: skip
    return chosen.name


def init_state_pool(
    slots: int, value_heads: int, dk: int, dv: int, dtype=jax.numpy.float32
) -> Float[Array, "P HV dk dv"]:
    """An all-zero state pool (zeros: the state of a sequence that has seen no token).

    Args:
        slots: P.
        value_heads: HV.
        dk, dv: the head sizes.
        dtype: float32 or bfloat16.

    Returns:
        ``(P, HV, dk, dv)`` zeros.
    """
    return jax.numpy.zeros((slots, value_heads, dk, dv), dtype)


__all__ = ["gdn2_decode", "init_state_pool", "which_decode_backend"]
