"""The typed spec of a decode step: shapes, dtypes, the state pool and its slot indices.

The contract is the decode section of ``docs/operator.md``: ``N`` sequences of ``S`` new tokens
each; q, k ``(N, S, H, dk)``; v, w ``(N, S, HV, dv)`` with ``HV`` a multiple of ``H`` (grouped
value heads: value head ``j`` reads key head ``j // (HV / H)``); b, g ``(N, S, H or HV, dk)``
(scalar gates, one value per head and token as KDA's beta and GDN's beta and decay: w ``(N, S,
HV)``, b, g ``(N, S, H or HV)``; ``DecodeSpec.scalar_gates`` names them), one dtype for all six
but a float32 ``g`` beside bfloat16 inputs (kept so for a backend that takes it,
:func:`backend_decay`); the state pool ``(P, HV, dk, dv)`` in float32 or bfloat16 (float64
too for float64 inputs); optional ``state_indices (N,)``, integers (an array, or a list) naming
each sequence's slot of the pool.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import jax
import jax.numpy as jnp
import numpy as np

from gdn2core.checks import check_scale, check_token_dtypes
from gdn2core.options import NO_ACTIVATIONS, Activations, as_index_array

#: Sequences up to which :func:`sanitize_slots` finds repeated slots by comparing every pair (one
#: fused comparison of N^2 elements) instead of sorting (a sort, a gather and a scatter).
PAIRWISE_MAX: Final = 512

#: Pool dtypes for float32 and bfloat16 inputs; float64 inputs may also keep a float64 pool.
POOL_DTYPES: Final[tuple[str, ...]] = ("float32", "bfloat16")

_AXES: Final = {
    "q": "(N, S, H, dk)",
    "k": "(N, S, H, dk)",
    "v": "(N, S, HV, dv)",
    "w": "(N, S, HV, dv)",
    "b": "(N, S, H or HV, dk)",
    "g": "(N, S, H or HV, dk)",
}
#: The gates that may come as one value per head and token (rank 3, no channel axis).
SCALAR_GATE_AXES: Final = {"w": "(N, S, HV)", "b": "(N, S, H or HV)", "g": "(N, S, H or HV)"}


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeSpec:
    """Static description of one decode call; hashable (a jit static, a cache key).

    A backend's ``decode`` receives the resolved spec (:meth:`resolved`): grouped value heads are
    expanded and scalar gates broadcast by the core, so there ``key_heads == gate_heads ==
    heads`` (unless it declares ``Capabilities.grouped_decode``: then they are the call's) and
    ``scalar_gates == ()``.
    """

    n_seqs: int  # N
    tokens: int  # S, new tokens per sequence
    heads: int  # HV: value heads, the heads of the state and of o
    key_heads: int  # H: heads of q and k
    gate_heads: int  # heads of b and g (H or HV)
    dk: int
    dv: int
    dtype: str  # common dtype of q, k, v, w, b (and of g, but for a float32 decay)
    scale: float
    pool_size: int  # P
    state_dtype: str  # dtype of the pool (and of the returned token states)
    token_states: bool  # return the state after each token
    indexed: bool  # state_indices given (else sequence n uses slot n, P == N)
    float32_decay: bool = False  # g float32 beside bfloat16 inputs (checks.check_decay_dtype)
    scalar_gates: tuple[str, ...] = ()  # of "w", "b", "g": given (N, S, heads), one per channel
    #: the fused activations a backend applies itself (Capabilities.decode_activations; set by
    #: gdn2core.ops.decode.api on the spec it hands such a backend, else none)
    activations: Activations = NO_ACTIVATIONS
    #: the slots the backend gets are the core's sanitised ones (:func:`sanitize_slots`; set by
    #: the core on the spec it hands a backend; False: a direct call, whose slots may be anything)
    sanitized_slots: bool = False

    @property
    def group(self) -> int:
        """Value heads per key head, ``HV / H``."""
        return self.heads // self.key_heads

    @property
    def itemsize(self) -> int:
        """Bytes per element of the token inputs."""
        return int(np.dtype(jnp.dtype(self.dtype)).itemsize)

    @property
    def state_itemsize(self) -> int:
        """Bytes per element of the pool."""
        return int(np.dtype(jnp.dtype(self.state_dtype)).itemsize)

    @property
    def pool_bytes_touched(self) -> int:
        """Bytes of the pool one call reads and writes (each named slot once each way): the
        memory traffic that bounds a decode step."""
        return 2 * self.n_seqs * self.heads * self.dk * self.dv * self.state_itemsize

    def resolved(self) -> DecodeSpec:
        """The spec a backend sees: q, k, b and g repeated to the ``HV`` value heads, scalar gates
        broadcast to their channels (``gdn2core.ops.decode.api``)."""
        return dataclasses.replace(
            self, key_heads=self.heads, gate_heads=self.heads, scalar_gates=()
        )

    @classmethod
    def from_inputs(
        cls,
        q: Any,
        k: Any,
        v: Any,
        w: Any,
        b: Any,
        g: Any,
        state: Any,
        state_indices: Any = None,
        scale: float | None = None,
        return_token_states: bool = False,
    ) -> DecodeSpec:
        """Validate the inputs of :func:`gdn2core.gdn2_decode` and derive the spec.

        Concrete ``state_indices`` are checked here (range and repeats, see
        :func:`check_state_indices`); traced ones are handled at run time by
        :func:`gdn2core.ops.decode.api.sanitize_slots`.

        Args:
            q, k, v, w, b, g: the token inputs (arrays or ``ShapeDtypeStruct``).
            state: the state pool.
            state_indices: the slot of each sequence, or None.
            scale: the query scale (None: ``dk ** -0.5``).
            return_token_states: whether the call returns the per-token states.

        Returns:
            The spec (unresolved: ``key_heads`` and ``gate_heads`` as given).

        Raises:
            ValueError: a shape, an index out of range or repeated, or a non-finite scale; the
                message names the argument, the expected and the actual value.
            TypeError: a dtype or a type, likewise.
        """
        arrays = {"q": q, "k": k, "v": v, "w": w, "b": b, "g": g}
        for name, x in arrays.items():
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
            if len(x.shape) != 4 and not (name in SCALAR_GATE_AXES and len(x.shape) == 3):
                scalar = f" or rank 3 {SCALAR_GATE_AXES[name]}" if name in SCALAR_GATE_AXES else ""
                raise ValueError(
                    f"{name}: expected rank 4 {_AXES[name]}{scalar}, got rank {len(x.shape)} "
                    f"shape {tuple(x.shape)}"
                )
        scalar_gates = tuple(n for n in SCALAR_GATE_AXES if len(arrays[n].shape) == 3)
        n, s, heads, dk = (int(d) for d in q.shape)
        value_heads, dv = int(v.shape[2]), int(v.shape[3])
        _expect("k", k.shape, (n, s, heads, dk))
        _expect("v", v.shape, (n, s, value_heads, dv))
        _expect_gate("w", w.shape, (n, s, value_heads, dv))
        if min(n, s, heads, dk, dv, value_heads) < 1:
            raise ValueError(
                f"q/v: N, S, H, HV, dk and dv must be positive, got N={n}, S={s}, H={heads}, "
                f"HV={value_heads}, dk={dk}, dv={dv}"
            )
        if value_heads % heads:
            raise ValueError(
                f"v: value heads HV={value_heads} must be a multiple of the key heads H={heads} "
                "(grouped value heads)"
            )
        gate_heads = int(b.shape[2])
        if gate_heads not in (heads, value_heads):
            raise ValueError(
                f"b: expected H={heads} or HV={value_heads} heads, got shape {tuple(b.shape)}"
            )
        _expect_gate("b", b.shape, (n, s, gate_heads, dk))
        _expect_gate("g", g.shape, (n, s, gate_heads, dk))
        dtype, float32_decay = check_token_dtypes(arrays)

        if not hasattr(state, "shape") or not hasattr(state, "dtype"):
            raise TypeError(
                f"state: expected an array (the state pool), got {type(state).__name__}"
            )
        if len(state.shape) != 4:
            raise ValueError(
                f"state: expected rank 4 (P, HV, dk, dv), got shape {tuple(state.shape)}"
            )
        pool = int(state.shape[0])
        _expect("state", state.shape, (pool, value_heads, dk, dv), "(P, HV, dk, dv)")
        state_dtype = jnp.dtype(state.dtype).name
        allowed = (*POOL_DTYPES, "float64") if dtype == "float64" else POOL_DTYPES
        if state_dtype not in allowed:
            raise TypeError(f"state: expected dtype {' or '.join(allowed)}, got {state_dtype}")

        if state_indices is None:
            if pool != n:
                raise ValueError(
                    f"state: without state_indices the pool holds one slot per sequence, "
                    f"expected P = N = {n}, got P = {pool} (pass state_indices to use a larger "
                    "pool)"
                )
        else:
            check_state_indices(state_indices, n, pool)
        if not isinstance(return_token_states, bool):
            raise TypeError(
                f"return_token_states: expected a bool, got {type(return_token_states).__name__}"
            )
        return cls(
            n_seqs=n,
            tokens=s,
            heads=value_heads,
            key_heads=heads,
            gate_heads=gate_heads,
            dk=dk,
            dv=dv,
            dtype=dtype,
            scale=check_scale(scale, dk),
            pool_size=pool,
            state_dtype=state_dtype,
            token_states=return_token_states,
            indexed=state_indices is not None,
            float32_decay=float32_decay,
            scalar_gates=scalar_gates,
        )


def check_state_indices(state_indices: Any, n_seqs: int, pool_size: int) -> None:
    """Check the slot indices: an integer array of shape ``(N,)`` (or a list or tuple of
    integers, taken as ``jnp.asarray`` of it); when concrete (not traced), every entry in
    ``[0, P)`` and no slot named twice.

    Args:
        state_indices: the ``state_indices`` argument.
        n_seqs: N.
        pool_size: P.

    Raises:
        TypeError: not an integer array.
        ValueError: the wrong shape, an index out of range, or a repeated slot (the message lists
            the offending sequences and slots).
    """
    state_indices = as_index_array("state_indices", state_indices)
    if not hasattr(state_indices, "shape") or not hasattr(state_indices, "dtype"):
        raise TypeError(
            f"state_indices: expected an integer array (or list) of shape (N,) = ({n_seqs},) or "
            f"None, got {type(state_indices).__name__}"
        )
    if not jnp.issubdtype(state_indices.dtype, jnp.integer):
        raise TypeError(
            f"state_indices: expected an integer dtype, got {jnp.dtype(state_indices.dtype).name}"
        )
    _expect("state_indices", state_indices.shape, (n_seqs,), "(N,)")
    if isinstance(state_indices, jax.core.Tracer | jax.ShapeDtypeStruct):
        return
    idx = np.asarray(state_indices).astype(np.int64)
    bad = np.flatnonzero((idx < 0) | (idx >= pool_size))
    if bad.size:
        shown = ", ".join(f"sequence {i}: {idx[i]}" for i in bad[:5])
        raise ValueError(
            f"state_indices: expected slots in [0, P) = [0, {pool_size}), got {shown}"
            + (f" and {bad.size - 5} more" if bad.size > 5 else "")
        )
    slots, counts = np.unique(idx, return_counts=True)
    repeated = slots[counts > 1]
    if repeated.size:
        shown = ", ".join(
            f"slot {s} by sequences {np.flatnonzero(idx == s).tolist()}" for s in repeated[:5]
        )
        raise ValueError(
            f"state_indices: expected each slot named at most once per call, got {shown}"
        )


def _expect(name: str, actual: Any, expected: tuple[int, ...], axes: str | None = None) -> None:
    actual = tuple(int(d) for d in actual)
    if actual != expected:
        raise ValueError(f"{name}: expected shape {axes or _AXES[name]} = {expected}, got {actual}")


def _expect_gate(name: str, actual: Any, expected: tuple[int, ...]) -> None:
    """A gate's shape: ``expected``, or without its channel axis for a scalar gate (rank 3)."""
    if len(actual) == 3:
        _expect(name, actual, expected[:3], SCALAR_GATE_AXES[name])
    else:
        _expect(name, actual, expected)


def sanitize_slots(state_indices: Any, n_seqs: int, pool_size: int) -> jax.Array:
    """The slots a backend receives: ``(N,)`` int32, each a slot in ``[0, P)`` named by exactly
    one sequence, or ``-1``: that sequence is skipped (nothing is read from or written to the
    pool for it, and its outputs are NaN).

    A sequence is skipped when its index is out of range or when another sequence of the call
    names the same slot (every sequence naming that slot is skipped, so the slot keeps its value).
    Concrete indices never get here with such entries (:func:`check_state_indices` raises); this
    is what happens under ``jax.jit``, where the values are not known when the call is traced.

    Args:
        state_indices: ``(N,)`` integers, or None (sequence n uses slot n).
        n_seqs: N.
        pool_size: P.

    Returns:
        The int32 slots.
    """
    if state_indices is None:
        return jnp.arange(n_seqs, dtype=jnp.int32)
    idx = jnp.asarray(state_indices)
    valid = (idx >= 0) & (idx < pool_size)
    idx = jnp.where(valid, idx, -1).astype(jnp.int32)
    if 1 < n_seqs <= PAIRWISE_MAX:  # one fused comparison of every pair
        others = ~jnp.eye(n_seqs, dtype=bool)  # [N, N]
        repeated = jnp.any((idx[:, None] == idx[None, :]) & others, axis=1) & (idx >= 0)
        idx = jnp.where(repeated, -1, idx)
    elif n_seqs > 1:
        order = jnp.argsort(idx)
        ranked = idx[order]  # [N] sorted
        same = ranked[1:] == ranked[:-1]  # [N - 1] equal to the next one
        repeated_sorted = jnp.pad(same, (1, 0)) | jnp.pad(same, (0, 1))  # [N]
        repeated = jnp.zeros((n_seqs,), bool).at[order].set(repeated_sorted)
        idx = jnp.where(repeated, -1, idx)
    return idx


def expand_heads(x: jax.Array, heads: int) -> jax.Array:
    """Repeat the heads of a token input ``(N, S, h, d)`` (or a scalar gate ``(N, S, h)``) to
    ``heads``: head ``j`` of the result is head ``j // (heads / h)`` of ``x`` (grouped value heads;
    a no-op when ``h == heads``).

    Args:
        x: q, k, b or g.
        heads: HV.

    Returns:
        ``(N, S, HV, d)`` (a scalar gate ``(N, S, HV)``).
    """
    group = heads // x.shape[2]
    return x if group == 1 else jnp.repeat(x, group, axis=2)


def backend_decay(
    spec: DecodeSpec, g: jax.Array, takes_float32: bool
) -> tuple[DecodeSpec, jax.Array]:
    """The spec and ``g`` a backend's decode receives: a float32 ``g`` beside bfloat16 inputs as
    it is when the backend takes it (``Capabilities.float32_decay``), else cast to the inputs'
    dtype (the backend then sees a call of one dtype).

    Args:
        spec: the resolved spec.
        g: the log decay as the backend would receive it.
        takes_float32: the backend's ``capabilities.float32_decay``.

    Returns:
        ``(spec, g)``.
    """
    if spec.float32_decay and not takes_float32:
        return dataclasses.replace(spec, float32_decay=False), g.astype(spec.dtype)
    return spec, g
