"""The typed spec of a ragged serving call, and the slots it reads and writes.

The contract is the ragged section of ``docs/operator.md``: ``T`` flat tokens of ``N`` requests
(request ``i`` owns tokens ``cu_seqlens[i]:cu_seqlens[i + 1]``, tokens past ``cu_seqlens[N]`` are
padding); q, k ``(T, H, dk)``; v, w ``(T, HV, dv)``; b, g ``(T, H or HV, dk)`` (scalar gates,
one value per head and token: w ``(T, HV)``, b, g ``(T, H or HV)``); a state pool
``(P, HV, dk, dv)``; per request a slot (``state_indices``), whether it starts from that slot
(``has_initial_state``), and optionally the slots that receive its prefix checkpoints
(``checkpoint_slots`` with ``checkpoint_every`` and ``context_lens``) and its draft states
(``draft_slots``).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gdn2core.checks import check_scale, check_token_dtypes, expect_shape
from gdn2core.ops.decode.spec import POOL_DTYPES, sanitize_slots
from gdn2core.options import as_index_array

_AXES = {
    "q": "(T, H, dk)",
    "k": "(T, H, dk)",
    "v": "(T, HV, dv)",
    "w": "(T, HV, dv)",
    "b": "(T, H or HV, dk)",
    "g": "(T, H or HV, dk)",
}
#: The gates that may come as one value per head and token (rank 2, no channel axis).
_SCALAR_AXES = {"w": "(T, HV)", "b": "(T, H or HV)", "g": "(T, H or HV)"}


@dataclasses.dataclass(frozen=True, slots=True)
class RaggedSpec:
    """Static description of one ragged call; hashable (a jit static)."""

    tokens: int  # T, the flat tokens (padding included)
    n_requests: int  # N
    heads: int  # HV: value heads
    key_heads: int  # H
    gate_heads: int  # heads of b and g (H or HV)
    dk: int
    dv: int
    dtype: str  # common dtype of q, k, v, w, b (and of g, but for a float32 decay)
    scale: float
    pool_size: int  # P
    state_dtype: str  # the pool's dtype
    checkpoint_every: int | None  # absolute positions that get a checkpoint: its multiples
    checkpoint_cols: int  # M, columns of checkpoint_slots (0: none)
    draft_cols: int  # S, columns of draft_slots (0: none)
    num_decodes: int = 0  # D: the first D requests are decodes, on the decode op
    decode_len: int = 1  # the most tokens of a decode request
    float32_decay: bool = False  # g float32 beside bfloat16 inputs (checks.check_decay_dtype)
    scalar_gates: tuple[str, ...] = ()  # of "w", "b", "g": given (T, heads), one per channel

    @property
    def checkpoint_bound(self) -> int:
        """The most checkpoints one call can store, whatever the metadata: request ``i`` meets at
        most ``L_i // every + 1`` multiples of ``every``, and at most ``M``."""
        if not self.checkpoint_cols:
            return 0
        per_tokens = self.tokens // self.checkpoint_every + self.n_requests
        return min(self.n_requests * self.checkpoint_cols, per_tokens)

    @property
    def draft_bound(self) -> int:
        """The most draft states one call can store: ``S`` per request, one per token at most."""
        return min(self.n_requests * self.draft_cols, self.tokens)

    @classmethod
    def from_inputs(
        cls,
        q: Any,
        k: Any,
        v: Any,
        w: Any,
        b: Any,
        g: Any,
        pool: Any,
        *,
        cu_seqlens: Any,
        state_indices: Any,
        has_initial_state: Any = None,
        scale: float | None = None,
        checkpoint_every: Any = None,
        context_lens: Any = None,
        checkpoint_slots: Any = None,
        draft_slots: Any = None,
        num_decodes: Any = 0,
        decode_len: Any = 1,
    ) -> RaggedSpec:
        """Validate the inputs of :func:`gdn2core.gdn2_ragged` and derive the spec.

        Concrete metadata is checked here in full (:func:`check_metadata`); traced metadata only
        for shapes and dtypes (what happens to invalid traced values: :func:`ragged_slots`).

        Raises:
            ValueError: a shape, an offset, a slot out of range or named twice, or more
                checkpoint positions than columns; the message names the argument, the expected
                and the actual value.
            TypeError: a dtype or a type, likewise.
        """
        arrays = {"q": q, "k": k, "v": v, "w": w, "b": b, "g": g}
        for name, x in arrays.items():
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
            if len(x.shape) != 3 and not (name in _SCALAR_AXES and len(x.shape) == 2):
                scalar = f" or rank 2 {_SCALAR_AXES[name]}" if name in _SCALAR_AXES else ""
                raise ValueError(
                    f"{name}: expected rank 3 {_AXES[name]}{scalar} (the flat tokens of every "
                    f"request), got shape {tuple(x.shape)}"
                )
        scalar_gates = tuple(n for n in _SCALAR_AXES if len(arrays[n].shape) == 2)
        t, heads, dk = (int(d) for d in q.shape)
        value_heads, dv = int(v.shape[1]), int(v.shape[2])
        expect_shape("k", k.shape, (t, heads, dk), _AXES["k"])
        expect_shape("v", v.shape, (t, value_heads, dv), _AXES["v"])
        _expect_gate("w", w.shape, (t, value_heads, dv))
        if min(heads, dk, dv, value_heads) < 1:
            raise ValueError(
                f"q/v: H, HV, dk and dv must be positive, got H={heads}, HV={value_heads}, "
                f"dk={dk}, dv={dv}"
            )
        if value_heads % heads:
            raise ValueError(
                f"v: value heads HV={value_heads} must be a multiple of the key heads H={heads} "
                "(grouped value heads)"
            )
        gate_heads = int(b.shape[1])
        if gate_heads not in (heads, value_heads):
            raise ValueError(
                f"b: expected H={heads} or HV={value_heads} heads, got shape {tuple(b.shape)}"
            )
        _expect_gate("b", b.shape, (t, gate_heads, dk))
        _expect_gate("g", g.shape, (t, gate_heads, dk))
        dtype, float32_decay = check_token_dtypes(arrays)

        if not hasattr(pool, "shape") or not hasattr(pool, "dtype"):
            raise TypeError(f"pool: expected an array (the state pool), got {type(pool).__name__}")
        if len(pool.shape) != 4:
            raise ValueError(
                f"pool: expected rank 4 (P, HV, dk, dv), got shape {tuple(pool.shape)}"
            )
        p = int(pool.shape[0])
        expect_shape("pool", pool.shape, (p, value_heads, dk, dv), "(P, HV, dk, dv)")
        pool_dtype = jnp.dtype(pool.dtype).name
        allowed = (*POOL_DTYPES, "float64") if dtype == "float64" else POOL_DTYPES
        if pool_dtype not in allowed:
            raise TypeError(f"pool: expected dtype {' or '.join(allowed)}, got {pool_dtype}")

        cu = _index_array("cu_seqlens", cu_seqlens, None, "(N + 1,)")
        if cu.ndim != 1 or cu.shape[0] < 2:
            raise ValueError(
                f"cu_seqlens: expected shape (N + 1,) with N >= 1 requests, got {tuple(cu.shape)}"
            )
        n = int(cu.shape[0]) - 1
        _index_array("state_indices", state_indices, (n,), "(N,)")
        if has_initial_state is not None:
            flags = as_index_array("has_initial_state", has_initial_state)
            if not hasattr(flags, "dtype") or jnp.dtype(flags.dtype) != jnp.bool_:
                raise TypeError(
                    "has_initial_state: expected a bool array (or list) of shape (N,), got "
                    + (
                        jnp.dtype(flags.dtype).name
                        if hasattr(flags, "dtype")
                        else type(flags).__name__
                    )
                )
            expect_shape("has_initial_state", flags.shape, (n,), "(N,)")

        every, cols = _check_checkpoint_args(checkpoint_every, context_lens, checkpoint_slots, n)
        drafts = 0
        if draft_slots is not None:
            d = _index_array("draft_slots", draft_slots, None, "(N, S)")
            if d.ndim != 2 or d.shape[0] != n or d.shape[1] < 1:
                raise ValueError(
                    f"draft_slots: expected shape (N, S) = ({n}, S) with S >= 1, got "
                    f"{tuple(d.shape)}"
                )
            drafts = int(d.shape[1])
        for name, value, low in (("num_decodes", num_decodes, 0), ("decode_len", decode_len, 1)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: expected an int >= {low} (static), got {value!r}")
        if num_decodes > n:
            raise ValueError(f"num_decodes: expected at most N = {n} requests, got {num_decodes}")
        spec = cls(
            tokens=t,
            n_requests=n,
            heads=value_heads,
            key_heads=heads,
            gate_heads=gate_heads,
            dk=dk,
            dv=dv,
            dtype=dtype,
            scale=check_scale(scale, dk),
            pool_size=p,
            state_dtype=pool_dtype,
            checkpoint_every=every,
            checkpoint_cols=cols,
            draft_cols=drafts,
            num_decodes=int(num_decodes),
            decode_len=int(decode_len),
            float32_decay=float32_decay,
            scalar_gates=scalar_gates,
        )
        check_metadata(spec, cu_seqlens, state_indices, context_lens, checkpoint_slots, draft_slots)
        return spec


def _expect_gate(name: str, actual: Any, expected: tuple[int, ...]) -> None:
    """A gate's shape: ``expected``, or without its channel axis for a scalar gate (rank 2)."""
    if len(actual) == 2:
        expect_shape(name, actual, expected[:2], _SCALAR_AXES[name])
    else:
        expect_shape(name, actual, expected, _AXES[name])


def _index_array(name: str, x: Any, shape: tuple[int, ...] | None, axes: str) -> Any:
    x = as_index_array(name, x)
    if x is None or not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(
            f"{name}: expected an integer array (or list) of shape {axes}, got {type(x).__name__}"
        )
    if not jnp.issubdtype(jnp.dtype(x.dtype), jnp.integer):
        raise TypeError(f"{name}: expected an integer dtype, got {jnp.dtype(x.dtype).name}")
    if shape is not None:
        expect_shape(name, x.shape, shape, axes)
    return x


def _check_checkpoint_args(
    every: Any, context_lens: Any, slots: Any, n: int
) -> tuple[int | None, int]:
    """``(checkpoint_every, M)`` after checking that the three come together."""
    if every is None:
        for name, x in (("context_lens", context_lens), ("checkpoint_slots", slots)):
            if x is not None:
                raise ValueError(
                    f"{name}: given without checkpoint_every (expected both or neither)"
                )
        return None, 0
    if not isinstance(every, numbers.Integral) or isinstance(every, bool) or every < 1:
        raise ValueError(f"checkpoint_every: expected a positive int (static), got {every!r}")
    for name, x in (("context_lens", context_lens), ("checkpoint_slots", slots)):
        if x is None:
            raise ValueError(f"{name}: expected an array with checkpoint_every, got None")
    _index_array("context_lens", context_lens, (n,), "(N,)")
    s = _index_array("checkpoint_slots", slots, None, "(N, M)")
    if s.ndim != 2 or s.shape[0] != n or s.shape[1] < 1:
        raise ValueError(
            f"checkpoint_slots: expected shape (N, M) = ({n}, M) with M >= 1, got {tuple(s.shape)}"
        )
    return int(every), int(s.shape[1])


def _concrete(x: Any) -> np.ndarray | None:
    if x is None:
        return None
    x = as_index_array("", x)
    if isinstance(x, jax.core.Tracer | jax.ShapeDtypeStruct):
        return None
    return np.asarray(x).astype(np.int64)


def check_metadata(spec: RaggedSpec, cu_seqlens, state_indices, context_lens, ckpt, drafts) -> None:
    """The value checks of concrete metadata (each traced argument is left to
    :func:`ragged_slots`).

    Raises:
        ValueError: offsets not starting at 0, decreasing or past T; a slot at or past P; a slot
            named twice among ``state_indices``, ``checkpoint_slots`` and ``draft_slots``; a
            negative context length; a request with more checkpoint positions than columns.
    """
    cu = _concrete(cu_seqlens)
    if cu is not None:
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens: expected cu_seqlens[0] = 0, got {cu[0]}")
        steps = np.diff(cu)
        if np.any(steps < 0):
            i = int(np.argmax(steps < 0))
            raise ValueError(
                f"cu_seqlens: expected non-decreasing offsets, got cu_seqlens[{i}] = {cu[i]} > "
                f"cu_seqlens[{i + 1}] = {cu[i + 1]}"
            )
        if cu[-1] > spec.tokens:
            raise ValueError(
                f"cu_seqlens: expected cu_seqlens[N] <= T = {spec.tokens} (tokens past it are "
                f"padding), got {cu[-1]}"
            )
        lens = np.diff(cu)[: spec.num_decodes]
        if np.any(lens > spec.decode_len):
            i = int(np.argmax(lens > spec.decode_len))
            raise ValueError(
                f"cu_seqlens: request {i} is one of the num_decodes = {spec.num_decodes} decodes, "
                f"expected at most decode_len = {spec.decode_len} tokens, got {lens[i]}"
            )
    named = {}
    for name, arr in (("state_indices", state_indices), ("checkpoint_slots", ckpt),
                      ("draft_slots", drafts)):  # fmt: skip
        a = _concrete(arr)
        if a is None:
            continue
        high = np.argwhere(a >= spec.pool_size)
        if high.size:
            where = tuple(int(i) for i in high[0])
            raise ValueError(
                f"{name}: expected slots in [0, P) = [0, {spec.pool_size}) or negative (none), "
                f"got {name}[{', '.join(map(str, where))}] = {a[where]}"
            )
        for where in np.argwhere(a >= 0):
            where = tuple(int(i) for i in where)
            slot = int(a[where])
            if slot in named:
                first = named[slot]
                raise ValueError(
                    f"{name}: expected each slot named at most once per call (it is written), got "
                    f"slot {slot} at {name}[{', '.join(map(str, where))}] and at {first}"
                )
            named[slot] = f"{name}[{', '.join(map(str, where))}]"
    ctx = _concrete(context_lens)
    if ctx is not None:
        if np.any(ctx < 0):
            i = int(np.argmax(ctx < 0))
            raise ValueError(
                f"context_lens: expected values >= 0, got context_lens[{i}] = {ctx[i]}"
            )
        if cu is not None:
            every = spec.checkpoint_every
            lens = np.diff(cu)
            count = (ctx + lens) // every - ctx // every  # [N] multiples met by each request
            over = np.flatnonzero(count > spec.checkpoint_cols)
            if over.size:
                i = int(over[0])
                raise ValueError(
                    f"checkpoint_slots: request {i} meets {count[i]} checkpoint positions in this "
                    f"call (context {ctx[i]}, {lens[i]} tokens, every {every}), expected at most "
                    f"M = {spec.checkpoint_cols} columns"
                )


class RaggedSlots(NamedTuple):
    """The slots a ragged call reads and writes, after the rules for invalid values."""

    state: jax.Array  # [N] int32: the slot read (if flagged) and written, -1: none
    padded: jax.Array  # [N] bool: a negative index, zero outputs
    skipped: jax.Array  # [N] bool: an invalid index, NaN outputs
    checkpoints: jax.Array  # [N, M] int32, -1: not stored
    drafts: jax.Array  # [N, S] int32, -1: not stored


def ragged_slots(spec: RaggedSpec, state_indices, checkpoint_slots, draft_slots) -> RaggedSlots:
    """The slots of a call, with the rules that hold for traced (unchecked) values.

    Every non-negative entry of ``state_indices``, ``checkpoint_slots`` and ``draft_slots`` names a
    slot the call writes. An entry at or past ``P``, or a slot named by more than one entry, is
    invalid: a request whose state index is invalid is skipped (nothing read or written for it,
    its checkpoints and drafts included; NaN outputs), an invalid checkpoint or draft entry is not
    stored. A negative state index marks a padded request: nothing read or written, zero outputs.
    So no invalid value writes outside the slot it alone names.

    Returns:
        The :class:`RaggedSlots`.
    """
    n, p = spec.n_requests, spec.pool_size
    idx = jnp.asarray(state_indices).astype(jnp.int32)  # [N]
    parts = [idx]
    shapes = []
    for arr, cols in ((checkpoint_slots, spec.checkpoint_cols), (draft_slots, spec.draft_cols)):
        a = (
            jnp.full((n, cols), -1, jnp.int32)
            if arr is None
            else jnp.asarray(arr).astype(jnp.int32)
        )
        parts.append(a.reshape(-1))
        shapes.append(a.shape)
    flat = jnp.concatenate(parts)  # every entry that names a slot
    kept = sanitize_slots(flat, int(flat.shape[0]), p)  # -1: negative, out of range or repeated
    state = kept[:n]
    padded = idx < 0
    skipped = ~padded & (state < 0)
    live = state >= 0  # [N]: requests whose cuts may be stored
    ck = kept[n : n + n * spec.checkpoint_cols].reshape(shapes[0])
    dr = kept[n + n * spec.checkpoint_cols :].reshape(shapes[1])
    ck = jnp.where(live[:, None], ck, -1)
    dr = jnp.where(live[:, None], dr, -1)
    return RaggedSlots(state, padded, skipped, ck, dr)


def checkpoint_cuts(spec: RaggedSpec, cu: jax.Array, context_lens: jax.Array) -> jax.Array:
    """The local token after which each checkpoint of each request falls.

    Checkpoint ``m`` of request ``i`` is the ``m``-th multiple ``a`` of ``checkpoint_every`` with
    ``context_lens[i] < a <= context_lens[i] + L_i``: the state after local token
    ``a - context_lens[i] - 1``.

    Returns:
        ``[N, M]`` int32 local token indices, ``-1`` where the request meets fewer multiples.
    """
    every, cols = spec.checkpoint_every, spec.checkpoint_cols
    ctx = jnp.asarray(context_lens).astype(jnp.int32)  # [N]
    lens = cu[1:] - cu[:-1]  # [N]
    m = jnp.arange(cols, dtype=jnp.int32)  # [M]
    pos = (ctx[:, None] // every + 1 + m[None]) * every  # [N, M] absolute positions
    local = pos - ctx[:, None] - 1  # [N, M]
    return jnp.where(local < lens[:, None], local, -1)
