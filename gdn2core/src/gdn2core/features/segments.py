"""Packed sequences: validating ``segment_ids`` / ``cu_seqlens`` and the token layouts they imply.

- ``segment_ids`` ``(B, T)``, any integer dtype (an array, or a nested list of integers): a sequence starts at token 0 and wherever the id
  differs from the previous token's. The state is reset to zero at every start except token 0,
  where ``h0`` enters; ``h_final`` is the state after the last token of the row.
- ``cu_seqlens`` ``(N + 1,)``, integer (an array or a list), B = 1 (fla's convention): sequence ``n`` is tokens
  ``cu_seqlens[n]:cu_seqlens[n + 1]`` (possibly empty); every sequence starts from ``h0[n]`` and
  ``h_final[n]`` is its last state (``h0[n]`` for an empty one).

The values of ``cu_seqlens`` (starting at 0, non-decreasing, ending at T) are checked when they are
concrete. Under ``jax.jit`` they are traced and cannot be checked: tokens outside
``[cu_seqlens[0], cu_seqlens[N])`` then get unspecified outputs, and decreasing offsets give
unspecified results (nothing raises).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gdn2core.indexing import count_at_most
from gdn2core.options import SegmentMode, as_index_array


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def check_segments(
    segment_ids: Any, cu_seqlens: Any, batch: int, seq_len: int
) -> tuple[SegmentMode, int]:
    """Validate the packed-sequence arguments of a call.

    Args:
        segment_ids: None or a ``(B, T)`` integer array (a nested list or tuple of integers is
            taken as ``jnp.asarray`` of it).
        cu_seqlens: None or an ``(N + 1,)`` integer array or list (B must be 1).
        batch, seq_len: B and T of the call.

    Returns:
        ``(mode, n_seqs)``: ``n_seqs`` is N with cu_seqlens, else B.

    Raises:
        TypeError: a non-array or a non-integer dtype.
        ValueError: a wrong shape, B > 1 with cu_seqlens, both given, or (when concrete) offsets
            not starting at 0, decreasing, or not ending at T.
    """
    segment_ids = as_index_array("segment_ids", segment_ids)
    cu_seqlens = as_index_array("cu_seqlens", cu_seqlens)
    if segment_ids is not None and cu_seqlens is not None:
        raise ValueError(
            "segment_ids, cu_seqlens: expected at most one of them, got both (segment_ids marks "
            "sequences in every row, cu_seqlens in one row)"
        )
    if segment_ids is not None:
        _expect_integer_array("segment_ids", segment_ids)
        shape = tuple(int(s) for s in segment_ids.shape)
        if shape != (batch, seq_len):
            raise ValueError(
                f"segment_ids: expected shape (B, T) = {(batch, seq_len)}, got {shape}"
            )
        return SegmentMode.IDS, batch
    if cu_seqlens is not None:
        _expect_integer_array("cu_seqlens", cu_seqlens)
        shape = tuple(int(s) for s in cu_seqlens.shape)
        if len(shape) != 1 or shape[0] < 2:
            raise ValueError(
                f"cu_seqlens: expected shape (N + 1,) with N >= 1 sequences, got {shape}"
            )
        if batch != 1:
            raise ValueError(
                f"cu_seqlens: expected B = 1 (the sequences are packed into one row), got B={batch}"
            )
        if not _is_traced(cu_seqlens):
            _check_offsets(np.asarray(cu_seqlens), seq_len)
        return SegmentMode.CU_SEQLENS, shape[0] - 1
    return SegmentMode.NONE, batch


def _expect_integer_array(name: str, x: Any) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(
            f"{name}: expected an integer array or a list of integers, got {type(x).__name__}"
        )
    dt = jnp.dtype(x.dtype)
    if not jnp.issubdtype(dt, jnp.integer):
        raise TypeError(f"{name}: expected an integer dtype, got {dt.name}")


def _check_offsets(cu: np.ndarray, seq_len: int) -> None:
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[0] = 0, got {int(cu[0])}")
    steps = np.diff(cu.astype(np.int64))
    if np.any(steps < 0):
        i = int(np.argmax(steps < 0))
        raise ValueError(
            f"cu_seqlens: expected non-decreasing offsets, got cu_seqlens[{i}] = {int(cu[i])} > "
            f"cu_seqlens[{i + 1}] = {int(cu[i + 1])}"
        )
    if int(cu[-1]) != seq_len:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[-1] = T = {seq_len}, got {int(cu[-1])}")


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """Where sequences start.

    Args:
        segment_ids: ``(B, T)`` integer ids.

    Returns:
        ``(B, T)`` bool: True at token 0 and wherever the id differs from the previous token's.
    """
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]  # [B, T-1]
    first = jnp.ones((segment_ids.shape[0], min(1, segment_ids.shape[1])), bool)
    return jnp.concatenate([first, changed], axis=1)


def as_int32_ids(segment_ids: jax.Array) -> jax.Array:
    """``segment_ids`` as int32 with the same starts (what a backend receives).

    Ids of 32 bits or fewer are cast (a bijection, so equal and different neighbours stay so);
    wider ids are renumbered by counting starts (a cast could make different ids equal).

    Args:
        segment_ids: ``(B, T)`` integer ids.

    Returns:
        ``(B, T)`` int32 ids with the same sequence starts.
    """
    if jnp.dtype(segment_ids.dtype).itemsize <= 4:
        return segment_ids.astype(jnp.int32)
    return jnp.cumsum(segment_starts(segment_ids), axis=1, dtype=jnp.int32)


def varlen_layout(cu_seqlens: jax.Array, seq_len: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token of a ``cu_seqlens`` call: its sequence and whether it starts or ends it.

    Args:
        cu_seqlens: ``(N + 1,)`` offsets.
        seq_len: T.

    Returns:
        ``(seq, start, end)``, each ``(T,)``: ``seq[t]`` the index n of the sequence holding t
        (empty sequences hold no token), ``start[t]`` whether ``t == cu_seqlens[n]``, ``end[t]``
        whether ``t == cu_seqlens[n + 1] - 1``.
    """
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)  # a NumPy array cannot be indexed by a tracer
    t = jnp.arange(seq_len, dtype=jnp.int32)  # [T]
    seq = count_at_most(cu[1:], t)  # [T]
    n = cu.shape[0] - 1
    safe = jnp.minimum(seq, n - 1)
    return seq, t == cu[safe], t == cu[safe + 1] - 1


def shard_boundary_starts(segment_ids: jax.Array, shards: int) -> jax.Array:
    """Whether each of ``shards`` equal time shards starts a new sequence at its first token
    (for context parallelism: such a shard ignores the state that comes in).

    Args:
        segment_ids: ``(B, T)`` ids, ``T % shards == 0``.
        shards: the number of time shards P.

    Returns:
        ``(B, P)`` bool; column 0 is False (``h0`` enters the first shard).
    """
    bsz, seq = segment_ids.shape
    tl = seq // shards
    first = segment_ids[:, tl::tl]  # [B, P-1] first token of shards 1..P-1
    before = segment_ids[:, tl - 1 : seq - 1 : tl]  # [B, P-1] last token of shards 0..P-2
    return jnp.concatenate([jnp.zeros((bsz, 1), bool), first != before], axis=1)
