"""HBM layouts the kernels index, the BlockSpecs over them, and per-head tile access.

Two layouts (``plan.layout``), chosen from H:

- ``"bhtd"`` (H not a multiple of 8, e.g. H = 6 at the train shape): the kernels read
  ``jnp.swapaxes(x, 1, 2)``, a (B, H, T, d) array, one (C, d) tile of one head per grid step:
  block (None, None, C, d) at (b, h, n, 0). On TPU this swap is a layout change, not necessarily a
  copy: for such H, XLA already stores a (B, T, H, d) array with H major to T (layout {3,1,2,0},
  so that H is not padded to the 8-row sublane tile), i.e. physically (B, H, T, d), and the swap
  is a bitcast (temp HBM 0 for the forward at the train shape).
- ``"bthd"`` (H a multiple of 8): XLA keeps (B, T, H, d) row-major, so the kernels read it in
  place: a (C, 8, d) tile of 8 heads per grid step, block (None, C, 8, d) at (b, n, h8, 0), and a
  loop over the 8 heads inside the kernel. (One head, (None, C, None, d), breaks Mosaic's (8, 128)
  rule on the last two block dims.) float32 heads are read with a dynamic sublane index; bfloat16
  tiles (16-row packing) are converted to float32 VMEM scratch first.

States are (B, H, K, V) float32 with (Hb, K, V) tiles (Hb = 1 or 8). The sequence is padded at
the end to ``plan.t_pad`` with zeros only when T is not a whole number of superchunks (k = 0,
g = 0 tokens leave the state unchanged, OPERATOR.md); padded outputs are dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gdn2_pallas_tpu.config import Plan

F32 = jnp.float32


def to_kernel(x: jax.Array, plan: Plan) -> jax.Array:
    """(B, T, H, d) -> kernel layout, zero padded at the end to t_pad tokens."""
    pad = plan.t_pad - x.shape[1]
    if plan.layout == "bhtd":
        x = jnp.swapaxes(x, 1, 2)  # [B, H, T, d]
        return jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) if pad else x
    return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else x  # [B, T, H, d]


def from_kernel(y: jax.Array, plan: Plan) -> jax.Array:
    """Kernel layout -> (B, T, H, d), padding dropped."""
    T = plan.seq_len
    if plan.layout == "bhtd":
        y = y[:, :, :T] if plan.t_pad != T else y
        return jnp.swapaxes(y, 1, 2)
    return y[:, :T] if plan.t_pad != T else y


def token_spec(plan: Plan, d: int, rows: int, block_of) -> pl.BlockSpec:
    """BlockSpec of a (rows, d) / (rows, Hb, d) tile; ``block_of(i)`` maps the chunk grid index
    to the tile's index along T (in units of ``rows``)."""
    if plan.layout == "bhtd":
        return pl.BlockSpec((None, None, rows, d), lambda b, h, i: (b, h, block_of(i), 0))
    return pl.BlockSpec((None, rows, plan.hb, d), lambda b, h, i: (b, block_of(i), h, 0))


def state_spec(plan: Plan) -> pl.BlockSpec:
    """(Hb, K, V) tile of a (B, H, K, V) float32 state array."""
    return pl.BlockSpec((None, plan.hb, plan.dk, plan.dv), lambda b, h, i: (b, h, 0, 0))


def staging_shapes(plan: Plan, dims) -> list:
    """float32 VMEM scratch for the bfloat16 (C, Hb, d) tiles of the "bthd" layout, else none."""
    from jax.experimental.pallas import tpu as pltpu

    if not plan.staged:
        return []
    return [pltpu.VMEM((plan.C, plan.hb, d), F32) for d in dims]


class Tile:
    """Per-head float32 (C, d) access to one tile ref (see the module docstring)."""

    def __init__(self, plan: Plan, ref, stage=None, rows=None):
        self.plan, self.ref, self.stage, self.rows = plan, ref, stage, rows

    def load_stage(self):
        """Convert the (bfloat16) tile into the float32 stage (once per grid step)."""
        if self.stage is not None:
            src = self.ref[...] if self.rows is None else self.ref[self.rows, :, :]
            self.stage[...] = src.astype(F32)

    def read(self, h):
        if self.plan.layout == "bhtd":
            x = self.ref[...] if self.rows is None else self.ref[self.rows, :]
        elif self.stage is not None:
            x = self.stage[:, h, :]
        else:
            x = self.ref[:, h, :] if self.rows is None else self.ref[self.rows, h, :]
        return x.astype(F32)

    def write(self, h, x):
        if self.plan.layout == "bhtd":
            self.ref[...] = x.astype(self.ref.dtype)
        elif self.stage is not None:
            self.stage[:, h, :] = x
        else:
            self.ref[:, h, :] = x.astype(self.ref.dtype)

    def flush(self):
        """Convert the float32 stage back into the (bfloat16) output tile."""
        if self.stage is not None:
            self.ref[...] = self.stage[...].astype(self.ref.dtype)


def for_each_head(plan: Plan, body) -> None:
    """``body(h)`` for the Hb heads of a grid step (a static call when Hb == 1)."""
    if plan.hb == 1:
        body(0)
        return

    def step(h, carry):
        body(h)
        return carry

    jax.lax.fori_loop(0, plan.hb, step, 0)
