"""How the kernels see HBM: layouts, index maps, BlockSpecs, and the output DMAs.

Layouts. Token arrays enter the kernels as ``(B, H, t_pad, d)`` (``jnp.swapaxes`` of the public
``(B, T, H, d)``; for the H of the train shape XLA stores the public array with H major to T, so
the swap is a bitcast, not a copy). A grid step ``(batch, head_group, step)`` reads, for each of
its ``hb`` heads, one contiguous ``(nc C, d)`` tile (one BlockSpec per head: a single head-strided
block would be one strided DMA, which the TPU compiler's profiler does not price). Outputs are
written the same way, head by head, by manual DMAs from a VMEM staging buffer (several BlockSpecs
cannot share one output).

Residuals of the training forward are laid out per grid step, so that each step reads one
contiguous block: ``T`` and ``A_qk`` packed into one ``[C, C]`` matrix per unit, ``128 / C`` units side
by side in the lanes (:func:`pack_lanes`), as ``(B, H / hb, n_steps, U / pack, C, pack C)``; the
entry states of the steps as ``(B, H / hb, n_steps, hb, K, V)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2_pallas_tpu.plan import Plan

F32 = jnp.float32


def forward_step(step):
    """The forward visits the steps in order."""
    return step


def reverse_step(n_steps: int):
    """The backward visits the steps last to first."""

    def step_of(step):
        return n_steps - 1 - step

    return step_of


def _token_index(batch, head_group, step, *, head: int, hb: int, step_of: Callable):
    """Tile of head ``head_group * hb + head``, tokens of step ``step_of(step)``."""
    return (batch, head_group * hb + head, step_of(step), 0)


def _state_index(batch, head_group, step):
    """The ``hb`` consecutive heads' ``[K, V]`` states of a head group (contiguous)."""
    return (batch, head_group, 0, 0)


def _residual_index(batch, head_group, step, *, step_of: Callable):
    """A step's residual block: one contiguous ``(U, ...)`` block per grid step."""
    return (batch, head_group, step_of(step), 0, 0, 0)


def token_specs(plan: Plan, d: int, step_of: Callable) -> list[pl.BlockSpec]:
    """One ``(nc C, d)`` BlockSpec per head of a step."""
    return [
        pl.BlockSpec(
            (None, None, plan.step_len, d),
            functools.partial(_token_index, head=j, hb=plan.hb, step_of=step_of),
        )
        for j in range(plan.hb)
    ]


def state_spec(plan: Plan) -> pl.BlockSpec:
    """``(hb, K, V)`` tile of a ``(B, H, K, V)`` float32 state array."""
    return pl.BlockSpec((None, plan.hb, plan.dk, plan.dv), _state_index)


def residual_spec(plan: Plan, tail: tuple[int, int, int], step_of: Callable) -> pl.BlockSpec:
    """One step's block of a ``(B, H / hb, n_steps, *tail)`` residual."""
    return pl.BlockSpec(
        (None, None, None, *tail), functools.partial(_residual_index, step_of=step_of)
    )


def pack_lanes(x: jax.Array, plan: Plan) -> jax.Array:
    """[U, C, C] -> [U / pack, C, pack C]: ``pack`` consecutive units side by side in the lanes."""
    pack = plan.lane_pack
    if pack == 1:
        return x
    U, C, _ = x.shape
    groups = x.reshape(U // pack, pack, C, C)
    return jnp.concatenate([groups[:, i] for i in range(pack)], axis=2)


def unpack_lanes(x: jax.Array, plan: Plan) -> jax.Array:
    """Inverse of :func:`pack_lanes`."""
    pack, C = plan.lane_pack, plan.C
    if pack == 1:
        return x
    parts = [x[:, :, i * C : (i + 1) * C] for i in range(pack)]  # pack x [U / pack, C, C]
    return jnp.stack(parts, axis=1).reshape(plan.units, C, C)


def hbm_spec() -> pl.BlockSpec:
    """An output left in HBM, written by :func:`write_heads`."""
    return pl.BlockSpec(memory_space=pl.ANY)


def load_units(head_refs: Sequence, d: int, plan: Plan) -> jax.Array:
    """The ``hb`` head tiles of a step as float32 units ``[U, C, d]`` (unit = head * nc + chunk)."""
    x = jnp.stack([ref[...] for ref in head_refs])  # [hb, nc C, d]
    return x.astype(F32).reshape(plan.units, plan.C, d)


def per_head(x: jax.Array, plan: Plan) -> jax.Array:
    """Units ``[U, C, d]`` back to ``[hb, nc C, d]``."""
    return x.reshape(plan.hb, plan.step_len, x.shape[-1])


def chunk_of(x: jax.Array, j: int, plan: Plan) -> jax.Array:
    """Chunk ``j`` of the step for every head: ``[U, ...]`` -> ``[hb, ...]``."""
    return x.reshape(plan.hb, plan.nc, *x.shape[1:])[:, j]


def stack_chunks(xs: Sequence[jax.Array], plan: Plan) -> jax.Array:
    """Inverse of :func:`chunk_of` over ``j = 0..nc-1``: ``nc x [hb, ...]`` -> ``[U, ...]``."""
    return jnp.stack(xs, axis=1).reshape(plan.units, *xs[0].shape[1:])


def write_heads(x, stage, hbm, sems, plan: Plan, batch, head_group, step) -> list:
    """Stage ``x`` [hb, nc C, d] in VMEM and start one DMA per head into HBM rows
    ``step * nc C ...`` of ``hbm`` [B, H, t_pad, d]. Returns the copies (to ``wait()`` on)."""
    stage[...] = x.astype(stage.dtype)
    rows = pl.ds(step * plan.step_len, plan.step_len)
    copies = []
    for j in range(plan.hb):
        copy = pltpu.make_async_copy(
            stage.at[j], hbm.at[batch, head_group * plan.hb + j, rows], sems.at[j]
        )
        copy.start()
        copies.append(copy)
    return copies


def to_kernel(x: jax.Array, plan: Plan) -> jax.Array:
    """(B, T, H, d) -> (B, H, t_pad, d), zero padded at the end."""
    x = jnp.swapaxes(x, 1, 2)
    pad = plan.t_pad - plan.seq_len
    return jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) if pad else x


def from_kernel(y: jax.Array, plan: Plan) -> jax.Array:
    """(B, H, t_pad, d) -> (B, T, H, d), padding dropped."""
    if plan.t_pad != plan.seq_len:
        y = y[:, :, : plan.seq_len]
    return jnp.swapaxes(y, 1, 2)


def interpret_params(plan: Plan):
    return pltpu.InterpretParams() if plan.interpret else False
