"""Blocking of the time axis: chunks of C tokens, processed in groups of G chunks.

The public layout is ``(B, T, H, d)``. A sequence is padded at the end with zero tokens to
``n_groups * G * C`` tokens: k = 0 and g = 0 leave the state unchanged (docs/operator.md, "padding"),
and the padded outputs and gradients are dropped again.

The chunk-parallel work runs on one group at a time, vectorised over the group's G chunks in the
layout ``[G, B, H, C, d]`` (chunk axis leading, so the per-chunk state pass scans over axis 0).
Groups keep every full-size intermediate at about ``GROUP_BYTES`` instead of the size of the whole
sequence, which bounds the memory of forward + backward and keeps the working set in cache.
A group is read from the public layout with a dynamic slice and written back with a dynamic update
slice, so the inputs are never copied into another layout as a whole.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

#: Target size of one ``[G, B, H, C, max(dk, dv)]`` intermediate of a group.
GROUP_BYTES: Final = 1 << 19


@dataclasses.dataclass(frozen=True, slots=True)
class Blocking:
    """How T tokens are cut: ``n_groups`` groups of ``group`` chunks of ``bt`` tokens."""

    seq_len: int  # T
    bt: int  # C
    group: int  # G
    n_groups: int

    @classmethod
    def plan(cls, seq_len: int, bt: int, row_bytes: int, group_bytes: int | None = None):
        """``row_bytes``: bytes of one token row of a group intermediate, B * H * d * itemsize;
        ``group_bytes`` defaults to the module's ``GROUP_BYTES`` (read at call time)."""
        group_bytes = GROUP_BYTES if group_bytes is None else group_bytes
        n_chunks = max(1, -(-seq_len // bt))  # N = ceil(T / C)
        g_max = max(1, group_bytes // max(1, row_bytes * bt))
        n_groups = -(-n_chunks // g_max)
        group = -(-n_chunks // n_groups)  # G <= g_max, padding < n_groups chunks
        return cls(seq_len=seq_len, bt=bt, group=group, n_groups=n_groups)

    @property
    def n_chunks(self) -> int:
        return self.group * self.n_groups

    @property
    def padded_len(self) -> int:
        return self.n_chunks * self.bt

    @property
    def group_len(self) -> int:
        return self.group * self.bt


def pad_time(x: Float[Array, "B T H d"], blk: Blocking) -> Float[Array, "B Tp H d"]:
    """Zero-pad the time axis to ``blk.padded_len`` (a no-op when it already fits)."""
    extra = blk.padded_len - x.shape[1]
    if extra == 0:
        return x
    return jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, 0)))  # [B, Tp, H, d]


def load_group(x: Float[Array, "B Tp H d"], i, blk: Blocking, dtype) -> Float[Array, "G B H C d"]:
    """Group ``i`` of a padded ``(B, Tp, H, d)`` array, cast to ``dtype``, in chunk layout."""
    bsz, _, heads, d = x.shape
    xs = lax.dynamic_slice_in_dim(x, i * blk.group_len, blk.group_len, axis=1)  # [B, G*C, H, d]
    xs = xs.astype(dtype).reshape(bsz, blk.group, blk.bt, heads, d)  # [B, G, C, H, d]
    return jnp.transpose(xs, (1, 0, 3, 2, 4))  # [G, B, H, C, d]


def store_group(
    buf: Float[Array, "B Tp H d"], x: Float[Array, "G B H C d"], i, blk: Blocking
) -> Float[Array, "B Tp H d"]:
    """Write group ``i`` (chunk layout) into the padded public-layout buffer ``buf``."""
    G, bsz, heads, C, d = x.shape
    xs = jnp.transpose(x, (1, 0, 3, 2, 4)).reshape(bsz, G * C, heads, d)  # [B, G*C, H, d]
    return lax.dynamic_update_slice_in_dim(buf, xs.astype(buf.dtype), i * blk.group_len, axis=1)


@dataclasses.dataclass(frozen=True)
class PlainRows:
    """Group I/O of one sequence per row: :func:`pad_time`, :func:`load_group` and
    :func:`store_group` (the cu_seqlens counterpart is ``gdn2_jax_ref.varlen.VarlenRows``)."""

    blk: Blocking

    def pad(self, x: Float[Array, "B T H d"]) -> Float[Array, "B Tp H d"]:
        return pad_time(x, self.blk)

    def load(self, x: Float[Array, "B Tp H d"], i, dtype) -> Float[Array, "G B H C d"]:
        return load_group(x, i, self.blk, dtype)

    def store(self, buf: Float[Array, "B Tp H d"], x: Float[Array, "G B H C d"], i):
        return store_group(buf, x, i, self.blk)


def to_chunks(x: Float[Array, "B T H d"], bt: int, dtype) -> Float[Array, "N B H C d"]:
    """The whole sequence in chunk layout (zero-padded to a multiple of ``bt``); for tests."""
    blk = Blocking(seq_len=x.shape[1], bt=bt, group=max(1, -(-x.shape[1] // bt)), n_groups=1)
    return load_group(pad_time(x, blk), 0, blk, dtype)


def from_chunks(x: Float[Array, "N B H C d"], seq_len: int, dtype) -> Float[Array, "B T H d"]:
    """Inverse of :func:`to_chunks`: back to ``(B, T, H, d)``, padded tokens dropped."""
    n, bsz, heads, bt, d = x.shape
    x = jnp.transpose(x, (1, 0, 3, 2, 4)).reshape(bsz, n * bt, heads, d)  # [B, N*C, H, d]
    return x[:, :seq_len].astype(dtype)
