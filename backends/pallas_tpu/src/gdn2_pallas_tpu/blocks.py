"""How the kernels see HBM: layouts, index maps, BlockSpecs, loads and stores of token tiles.

A grid step ``(batch, head_group, step)`` works on ``nc`` chunks (``nc C`` tokens) of ``hb`` heads.
Its token tiles come in one of two layouts (:class:`~gdn2_pallas_tpu.plan.Layout`):

- ``HEAD_MAJOR``: the kernels read ``(B, H, t_pad, d)`` (``jnp.swapaxes`` of the public array; a
  bitcast for H not a multiple of 8, see plan.py), one contiguous ``(nc C, d)`` tile per head: one
  BlockSpec per head, since a single head-strided block would be one strided DMA, which the TPU
  compiler's profiler does not price. Outputs are written the same way, head by head, by manual
  DMAs from a VMEM staging buffer (several BlockSpecs cannot share one output), which run behind
  the next grid step's compute (:meth:`TokenIO.store`).
- ``TOKEN_MAJOR``: the kernels read the public ``(B, t_pad, H, d)`` in ``(nc C, hb, d)`` blocks
  (``hb = 8`` heads of every token, one DMA) and swap them to head-major in VMEM; outputs are
  ordinary blocks of the same shape.

The index maps ignore the scalar-prefetch refs that follow the grid indices (a kernel with a
prefetched chunk table passes them to every index map).

Either way the kernel body sees units ``[U, C, d]`` (``U = hb nc``, unit ``= head * nc + chunk``).

Grouped keys (``plan.key_groups = G > 1``, TOKEN_MAJOR only): q and k keep their ``H / G`` key
heads, ``(B, t_pad, H / G, d)``; head ``j`` (a value head) reads key head ``j // G``. The ``hb``
heads of step ``head_group`` read ``hb / G`` key heads, part ``head_group % G`` of the ``(nc C, hb,
d)`` key block ``head_group // G`` (:meth:`TokenIO.key_specs`): one DMA of ``hb`` key heads, as
for any token block, of which the step keeps its part and repeats each head ``G`` times in VMEM
(:meth:`TokenIO.load_keys`). The kernels then read the same bytes as from keys repeated in HBM,
without XLA writing (and reading back) that ``G`` times larger copy. The backward sums dq and dk
over each group in VMEM and writes the step's ``hb / G`` key heads side by side in the lanes, one
``(nc C, hb / G * d)`` block of a ``(B, t_pad, H / G * d)`` array (:func:`key_grad_spec`,
:func:`store_key_grad`): a block of ``hb / G < 8`` heads of the ``(B, t_pad, H / G, d)`` array
itself would not be a whole number of tiles. vjp.py reshapes it to the caller's q (a copy in
XLA, of the summed gradient only); an XLA sum of per-head gradients ``(B, T, H, d)`` over the
groups, as the tiled layout puts the group axis in the sublanes, estimates 5x slower.

Grouped values (``plan.value_groups = G > 1``, TOKEN_MAJOR only): with b, g on the key heads a
kernel head's ``dv`` value channels are ``G`` value heads of the caller side by side. v, w, o (and
dO, dv, dw) stay in the caller's ``(B, t_pad, G H, dv / G)``: a step reads its ``hb G`` value
heads as ``G`` ``(nc C, hb, dv / G)`` blocks and joins each head's ``G`` value heads in its lanes
in VMEM (:func:`join_groups`); a store splits them (:func:`split_groups`) into a VMEM stage and
writes the ``G`` blocks by DMAs (one BlockSpec of ``hb G`` heads would be one DMA, but the TPU
compiler's static profile classifies it remote and prices the whole kernel at 0). The core's
``(B, T, H, dv)`` view of them is a relayout copy on a TPU (the tiles hold 8 consecutive heads),
which the backend's reshape back to the caller's layout cancels in XLA (:meth:`TokenIO.values`).

Scalar gates (one value per head and token, ``plan.scalar_gates``) come as ``(B, H / hb, n_steps,
hb, nc C)`` float32, one dense ``(hb, nc C)`` block per step, tokens in the lanes
(:func:`scalar_spec`); the kernels broadcast them over the channels in VMEM
(:func:`load_scalar`) and write their gradients summed over the channels (:func:`store_scalar`).

Residuals of the training forward are laid out per grid step, so that each step reads one
contiguous block: ``T`` and ``A_qk`` packed into one ``[C, C]`` matrix per unit, ``128 / C``
units side by side in the lanes (:func:`pack_lanes`), as ``(B, H / hb, n_steps, U / pack, C,
pack C)``; the entry states of the steps as ``(B, H / hb, n_steps, hb, K, V)``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdn2_pallas_tpu.chunk_math import iota
from gdn2_pallas_tpu.matmul import MatmulPrecision, mm_nt, mm_tn, split_bf16_exact
from gdn2_pallas_tpu.plan import Layout, Plan

F32 = jnp.float32
#: Index-map block index 0, as int32: a Python 0 is an int64 under ``jax_enable_x64``, which the
#: index maps' lowering rejects.
I0 = np.int32(0)


def forward_step(step):
    """The forward visits the steps in order."""
    return step


def reverse_step(n_steps: int):
    """The backward visits the steps last to first."""

    def step_of(step):
        return n_steps - 1 - step

    return step_of


def _head_tile_index(batch, head_group, step, *_, head: int, hb: int, step_of: Callable):
    """HEAD_MAJOR: the tile of head ``head_group * hb + head``, tokens of step ``step_of(step)``."""
    return (batch, head_group * hb + head, step_of(step), I0)


def _token_block_index(batch, head_group, step, *_, step_of: Callable, part=0, groups=1):
    """TOKEN_MAJOR: the ``(nc C, hb, d)`` block of step ``step_of(step)``, heads of the group
    (grouped values: block ``part`` of the group's ``groups``)."""
    return (batch, step_of(step), head_group * groups + part, I0)


def _key_block_index(batch, head_group, step, *_, step_of: Callable, groups: int):
    """Grouped keys: the ``(nc C, hb, d)`` key block holding the key heads of ``head_group``."""
    return (batch, step_of(step), jax.lax.div(head_group, np.int32(groups)), I0)


def key_part(x: jax.Array, plan: Plan, head_group) -> jax.Array:
    """Grouped keys: ``x`` ``[hb, L, d]``, the ``hb`` key heads of the step's key block ->
    ``[hb, L, d]``, the key head of each of the step's heads (its part ``head_group % G`` of the
    block, each key head repeated for its ``G`` heads; module docstring)."""
    G = plan.key_groups
    n = plan.hb // G  # key heads of this step
    part = jax.lax.rem(head_group, np.int32(G))
    mine = x[:n]  # [n, L, d]
    for i in range(1, G):
        mine = jnp.where(part == i, x[i * n : (i + 1) * n], mine)
    return jnp.stack([mine[j // G] for j in range(plan.hb)])  # [hb, L, d]


def _key_grad_index(batch, head_group, step, *_, step_of: Callable):
    """Grouped keys: the step's ``hb / G`` key heads' lanes of a ``(B, t_pad, H / G * d)`` gradient."""
    return (batch, step_of(step), head_group)


def key_grad_spec(plan: Plan, step_of: Callable, d: int) -> pl.BlockSpec:
    """dq or dk under grouped keys: ``(nc C, hb / G * d)`` (module docstring)."""
    index = functools.partial(_key_grad_index, step_of=step_of)
    return pl.BlockSpec((None, plan.step_len, plan.hb // plan.key_groups * d), index)


def store_key_grad(x: jax.Array, ref, plan: Plan) -> None:
    """Units ``x`` [U, C, d] of the step's heads, summed over each key head's ``G`` heads (in
    float32), written as the ``(nc C, hb / G * d)`` block of :func:`key_grad_spec`."""
    G, d = plan.key_groups, x.shape[-1]
    n = plan.hb // G  # key heads of the step
    heads = x.reshape(n, G, plan.step_len, d)  # [n, G, nc C, d]
    sums = heads[:, 0]
    for i in range(1, G):
        sums = sums + heads[:, i]  # [n, nc C, d]
    ref[...] = jnp.concatenate([sums[j] for j in range(n)], axis=1).astype(ref.dtype)


def _state_index(batch, head_group, step, *_):
    """The ``hb`` consecutive heads' ``[K, V]`` states of a head group (contiguous)."""
    return (batch, head_group, I0, I0)


def _residual_index(batch, head_group, step, *_, step_of: Callable):
    """A step's residual block: one contiguous block per grid step."""
    return (batch, head_group, step_of(step), I0, I0, I0)


def join_groups(x: jax.Array, groups: int) -> jax.Array:
    """``[hb G, n, d]`` -> ``[hb, n, G d]``: a kernel head's ``G`` value heads side by side in
    its value columns (a split of the major axis and a lane concatenation)."""
    if groups == 1:
        return x
    x = x.reshape(x.shape[0] // groups, groups, *x.shape[1:])  # [hb, G, n, d]
    return jnp.concatenate([x[:, i] for i in range(groups)], axis=2)


def split_groups(x: jax.Array, groups: int) -> jax.Array:
    """Inverse of :func:`join_groups`: ``[hb, n, G d]`` -> ``[hb G, n, d]``."""
    if groups == 1:
        return x
    hb, n, width = x.shape
    d = width // groups
    parts = [x[:, :, i * d : (i + 1) * d] for i in range(groups)]  # G x [hb, n, d]
    return jnp.stack(parts, axis=1).reshape(hb * groups, n, d)


def join_blocks(blocks: Sequence[jax.Array], groups: int) -> jax.Array:
    """``G`` token blocks ``[n, hb, d]`` of consecutive value heads (the caller's ``(T, HV,
    d)``) -> the kernel heads' rows ``[hb, n, G d]``."""
    x = jnp.concatenate(list(blocks), axis=1)  # [n, hb G, d]
    return join_groups(jnp.swapaxes(x, 0, 1), groups)  # [hb, n, G d]


def split_blocks(x: jax.Array, groups: int) -> jax.Array:
    """Inverse of :func:`join_blocks`: ``[hb, n, G d]`` -> ``G`` blocks ``[G, n, hb, d]``."""
    hb = x.shape[0]
    x = jnp.swapaxes(split_groups(x, groups), 0, 1)  # [n, hb G, d]
    return jnp.stack([x[:, m * hb : (m + 1) * hb] for m in range(groups)])


@dataclasses.dataclass(frozen=True)
class StagedWrite:
    """One staged output of a grid step: its VMEM ``stage``, the ``value`` to stage (``[hb, nc C,
    d]`` or ``[G, nc C, hb, d / G]``) and the ``copies`` (DMAs) that write the stage to HBM."""

    stage: object
    value: jax.Array
    copies: tuple


def write_staged(writes: Sequence[StagedWrite]) -> None:
    """Stage and start the DMAs of ``writes``, which run behind the next grid step's compute.

    That step waits for them, all at once, before it restages (the DMAs of the step before have
    the same sizes and semaphores, so this step's descriptors wait for them), and the last step
    of a head group waits for its own at once. The step axis is the grid's innermost and
    "arbitrary", so the grid step before a step > 0 is the step before it of the same head
    group, on the same core. One conditional region for all the waits of a step (not one per
    output): such a region is a boundary the compiler does not schedule compute across (v5e
    static estimate, GDN backward at B1 T1024 H6, four staged gradients: 92,061 cycles with two
    regions per output, 84,517 with these two; 83,903 when every step waited for its own DMAs
    at its end, unconditionally)."""
    grid_step = pl.program_id(2)
    copies = [c for w in writes for c in w.copies]

    @pl.when(grid_step > 0)
    def _():
        for copy in copies:  # the previous step's DMAs out of these buffers
            copy.wait()

    for w in writes:
        w.stage[...] = w.value.astype(w.stage.dtype)
    for copy in copies:
        copy.start()

    @pl.when(grid_step == pl.num_programs(2) - 1)
    def _():
        for copy in copies:
            copy.wait()


class TokenIO:
    """The token tiles of one kernel: BlockSpecs, output staging, loads and stores, for ``plan``'s
    layout. ``step_of`` maps the grid's step index to the step of the sequence. ``groups``: the
    arrays are the caller's grouped values, ``groups`` value heads per kernel head (module
    docstring; :meth:`values`)."""

    def __init__(self, plan: Plan, step_of: Callable, groups: int = 1):
        self.plan, self.step_of, self.groups = plan, step_of, groups
        self.head_major = plan.layout is Layout.HEAD_MAJOR
        assert groups == 1 or not self.head_major, "grouped values need the TOKEN_MAJOR layout"

    def values(self) -> TokenIO:
        """The tiles of v, w, o, dO, dv, dw: in the caller's grouped layout with
        ``plan.value_groups``, else these."""
        return TokenIO(self.plan, self.step_of, self.plan.value_groups)

    def in_specs(self, d: int) -> list[pl.BlockSpec]:
        """One BlockSpec per head (HEAD_MAJOR), one block (TOKEN_MAJOR) or ``G`` (grouped
        values), all reading the same array (refs.py passes it once per spec)."""
        plan = self.plan
        if self.head_major:
            return [
                pl.BlockSpec(
                    (None, None, plan.step_len, d),
                    functools.partial(_head_tile_index, head=j, hb=plan.hb, step_of=self.step_of),
                )
                for j in range(plan.hb)
            ]
        G = self.groups  # G blocks [nc C, hb, d / G]: the step's hb G value heads
        return [
            pl.BlockSpec(
                (None, plan.step_len, plan.hb, d // G),
                functools.partial(_token_block_index, step_of=self.step_of, part=m, groups=G),
            )
            for m in range(G)
        ]

    @property
    def staged(self) -> bool:
        """Whether outputs are staged in VMEM and written by manual DMAs (:meth:`store`): one per
        head (HEAD_MAJOR), or one per ``(nc C, hb, d / G)`` block of grouped values (one block of
        ``hb G`` heads is a DMA the TPU compiler's static profile classifies remote and prices
        at 0, the whole kernel with it)."""
        return self.head_major or self.groups > 1

    @property
    def _copies(self) -> int:
        """DMAs per staged output and step."""
        return self.plan.hb if self.head_major else self.groups

    def key_specs(self, d: int) -> list[pl.BlockSpec]:
        """q and k: :meth:`in_specs`, or with grouped keys the key block of the step's key heads
        (module docstring)."""
        plan = self.plan
        if plan.key_groups == 1:
            return self.in_specs(d)
        index = functools.partial(_key_block_index, step_of=self.step_of, groups=plan.key_groups)
        return [pl.BlockSpec((None, plan.step_len, plan.hb, d), index)]

    def out_spec(self, d: int) -> pl.BlockSpec:
        if self.staged:
            return pl.BlockSpec(memory_space=pl.ANY)  # written by manual DMAs
        return self.in_specs(d)[0]

    def out_stage(self, d: int, dtype):
        """VMEM staging of an output of width ``d`` for its DMAs, else None: ``[hb, nc C, d]``
        (HEAD_MAJOR) or ``[G, nc C, hb, d / G]`` (grouped values)."""
        plan = self.plan
        if self.head_major:
            return pltpu.VMEM((plan.hb, plan.step_len, d), dtype)
        if self.groups > 1:
            return pltpu.VMEM((self.groups, plan.step_len, plan.hb, d // self.groups), dtype)
        return None

    def out_sems(self, n_outputs: int):
        """DMA semaphores ``(n_outputs, DMAs per step)`` of the staged outputs, else None."""
        if not self.staged:
            return None
        return pltpu.SemaphoreType.DMA((n_outputs, self._copies))

    def load(self, refs: Sequence, d: int) -> jax.Array:
        """The step's tiles as float32 units ``[U, C, d]``."""
        plan = self.plan
        if self.head_major:
            x = jnp.stack([ref[...] for ref in refs])  # [hb, nc C, d]
        else:
            x = join_blocks([ref[...] for ref in refs], self.groups)  # [hb, nc C, d]
        return x.astype(F32).reshape(plan.units, plan.C, d)

    def load_keys(self, refs: Sequence, d: int, head_group) -> jax.Array:
        """q or k as float32 units ``[U, C, d]``: :meth:`load`, or with grouped keys the step's
        part of its key block, each key head repeated for its ``G`` heads (module docstring)."""
        plan, G = self.plan, self.plan.key_groups
        if G == 1:
            return self.load(refs, d)
        x = jnp.swapaxes(refs[0][...], 0, 1)  # [hb, nc C, d]: hb key heads
        return key_part(x, plan, head_group).astype(F32).reshape(plan.units, plan.C, d)

    def store(self, x: jax.Array, out, stage, sems, batch, head_group, step) -> None:
        """Write units ``x`` [U, C, d] to the output: an ordinary block store, or
        (:attr:`staged`) staged in VMEM and written by DMAs (:func:`write_staged`)."""
        if self.staged:
            write_staged([self.staged_write(x, out, stage, sems, batch, head_group, step)])
            return
        plan = self.plan
        x = x.reshape(plan.hb, plan.step_len, x.shape[-1])  # [hb, nc C, d]
        out[...] = jnp.swapaxes(x, 0, 1).astype(out.dtype)  # [nc C, hb, d]

    def staged_write(self, x: jax.Array, out, stage, sems, batch, head_group, step) -> StagedWrite:
        """The staged write of units ``x`` [U, C, d] (:attr:`staged` outputs): its staging
        buffer, the values for it and its DMAs, for :func:`write_staged`."""
        plan = self.plan
        x = x.reshape(plan.hb, plan.step_len, x.shape[-1])  # [hb, nc C, d]
        rows = pl.ds(step * plan.step_len, plan.step_len)
        if self.head_major:  # one DMA per head
            heads = [head_group * plan.hb + j for j in range(plan.hb)]
            dsts = [out.at[batch, h, rows] for h in heads]  # [nc C, d]
        else:  # grouped values: block m holds the step's value heads m hb ... (m + 1) hb - 1
            G = self.groups
            x = split_blocks(x, G)  # [G, nc C, hb, d / G]
            heads = [pl.ds((head_group * G + m) * plan.hb, plan.hb) for m in range(G)]
            dsts = [out.at[batch, rows, h] for h in heads]  # [nc C, hb, d / G]
        copies = [
            pltpu.make_async_copy(stage.at[i], dst, sems.at[i])
            for i, dst in zip(map(jnp.int32, range(len(dsts))), dsts, strict=True)
        ]  # int32 indices also under jax_enable_x64
        return StagedWrite(stage, x, tuple(copies))

    def to_kernel(self, x: jax.Array) -> jax.Array:
        """Public (B, T, H, d) -> this layout, zero padded at the end to ``t_pad`` tokens; grouped
        values back in the caller's ``(B, T, G H, d / G)`` (a reshape that cancels the core's)."""
        pad = self.plan.t_pad - self.plan.seq_len
        if self.groups > 1:
            B, T, H, d = x.shape
            x = x.reshape(B, T, H * self.groups, d // self.groups)  # [B, T, HV, dv]
        if self.head_major:
            x = jnp.swapaxes(x, 1, 2)  # [B, H, T, d]
            return jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) if pad else x
        return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else x

    def from_kernel(self, y: jax.Array) -> jax.Array:
        """This layout -> public (B, T, H, d), padding dropped."""
        T = self.plan.seq_len
        if self.head_major:
            return jnp.swapaxes(y[:, :, :T] if self.plan.t_pad != T else y, 1, 2)
        y = y[:, :T] if self.plan.t_pad != T else y
        if self.groups > 1:  # [B, T, HV, dv] -> the core's view [B, T, H, G dv]
            B, _, HV, dv = y.shape
            y = y.reshape(B, T, HV // self.groups, dv * self.groups)
        return y


def _starts_index(batch, head_group, step, *_, step_of: Callable):
    """The step's tokens of the ``(B, t_pad, 1)`` sequence-start flags (the same for every head)."""
    return (batch, step_of(step), I0)


def starts_spec(plan: Plan, step_of: Callable) -> pl.BlockSpec:
    """``(nc C, 1)`` float32 sequence-start flags of a step."""
    return pl.BlockSpec((None, plan.step_len, 1), functools.partial(_starts_index, step_of=step_of))


def load_starts(ref, plan: Plan) -> jax.Array:
    """The step's start flags as units ``[U, C, 1]`` (every head of a chunk shares them)."""
    x = ref[...].astype(F32).reshape(1, plan.nc, plan.C, 1)
    return jnp.broadcast_to(x, (plan.hb, plan.nc, plan.C, 1)).reshape(plan.units, plan.C, 1)


def sequence_starts(segment_ids: jax.Array, plan: Plan) -> jax.Array:
    """(B, T) segment ids -> (B, t_pad, 1) float32: 1.0 where a new sequence starts (the id
    changes from the previous token; not at token 0, where h0 enters), 0.0 elsewhere and in the
    padding."""
    ids = segment_ids.astype(jnp.int32)
    starts = jnp.concatenate(
        [jnp.zeros_like(ids[:, :1], dtype=bool), ids[:, 1:] != ids[:, :-1]], axis=1
    )
    starts = starts.astype(F32)
    pad = plan.t_pad - plan.seq_len
    if pad:
        starts = jnp.pad(starts, ((0, 0), (0, pad)))
    return starts[:, :, None]


def _scalar_index(batch, head_group, step, *_, step_of: Callable):
    """A step's ``(hb, nc C)`` block of a scalar gate (one contiguous block per grid step)."""
    return (batch, head_group, step_of(step), I0, I0)


def scalar_spec(plan: Plan, step_of: Callable) -> pl.BlockSpec:
    """``(hb, nc C)`` float32 block of a scalar gate ``(B, H / hb, n_steps, hb, nc C)``: the
    tokens in the lanes, dense in HBM (a ``(nc C, 1)`` column per head would be padded to 128
    lanes there, 128x the bytes)."""
    block = (None, None, None, plan.hb, plan.step_len)
    return pl.BlockSpec(block, functools.partial(_scalar_index, step_of=step_of))


def scalar_to_kernel(x: jax.Array, plan: Plan) -> jax.Array:
    """A scalar gate ``(B, T, H)`` -> ``(B, H / hb, n_steps, hb, nc C)`` float32, zero padded at
    the end to ``t_pad`` tokens (one small transpose in XLA: 4 bytes per head and token)."""
    pad = plan.t_pad - plan.seq_len
    x = jnp.pad(x.astype(F32), ((0, 0), (0, pad), (0, 0))) if pad else x.astype(F32)
    x = x.reshape(plan.batch, plan.n_steps, plan.step_len, plan.head_groups, plan.hb)
    return jnp.transpose(x, (0, 3, 1, 4, 2))  # [B, H / hb, n_steps, hb, nc C]


def scalar_from_kernel(y: jax.Array, plan: Plan, dtype) -> jax.Array:
    """Inverse of :func:`scalar_to_kernel`: ``(B, T, H)`` in ``dtype``, padding dropped."""
    y = jnp.transpose(y, (0, 2, 4, 1, 3))  # [B, n_steps, nc C, H / hb, hb]
    y = y.reshape(plan.batch, plan.t_pad, plan.heads)
    return (y[:, : plan.seq_len] if plan.t_pad != plan.seq_len else y).astype(dtype)


def load_scalar(ref, plan: Plan, d: int, dtype) -> jax.Array:
    """A scalar gate's block as units ``[U, C, d]``: each token's value on all ``d`` channels;
    ``dtype``: the gate's dtype as the caller gave it (``Plan.input_dtype``).

    One bfloat16 MXU pass moves the tokens from the lanes to the rows and broadcasts them over
    the channels at once: ``rows^T @ sel`` with ``sel`` [hb, hb d] one on head j's d lanes. It
    is exact: each output is one value times 1. A bfloat16 gate is its own rows; a float32 one
    (a float32 g beside bfloat16 inputs, or float32 inputs) goes in as its three bfloat16 parts
    (matmul.split_bf16_exact), stacked on the contracted axis against three copies of ``sel``,
    so each output sums them back in the float32 accumulator, exactly (still one pass: the
    contraction of 3 hb is within one MXU tile). Static cycle estimates, v5e, GDN train step
    at B8 T4096 H6 with a float32 g (``gdn2 tpu-report --estimate --gates gdn --g-dtype
    float32``): 3.071 ms, against 3.062 ms with g in bfloat16; with the float32 product at
    ``Precision.HIGHEST`` (six passes) about 11% slower (a one-off tpu_static driver: 3.280
    against 2.967 ms), and float32 inputs 6.222 -> 5.358 ms with the parts. At B1 T1024 H6
    (bfloat16): backward 122,516 cycles against 131,999 for a transpose and lane broadcasts
    (the full-gate kernel: 120,478)."""
    hb = plan.hb
    rows = ref[...].astype(F32)[None]  # [1, hb, nc C]
    lane, head = iota((1, hb, hb * d), 2), iota((1, hb, hb * d), 1)
    sel = ((lane >= head * d) & (lane < head * d + d)).astype(F32)  # [1, hb, hb d]
    if jnp.dtype(dtype).itemsize == 4:  # hi, mid, lo against sel three times
        parts = [x.astype(F32) for x in split_bf16_exact(rows)]  # 3 x [1, hb, nc C]
        rows = jnp.concatenate(parts, axis=1)  # [1, 3 hb, nc C] bf16 values
        sel = jnp.concatenate([sel] * 3, axis=1)  # [1, 3 hb, hb d]
    cols = mm_tn(rows, sel, MatmulPrecision.BF16)[0]  # [nc C, hb d]
    units = jnp.stack([cols[:, j * d : (j + 1) * d] for j in range(hb)])  # [hb, nc C, d]
    return units.reshape(plan.units, plan.C, d)


def row_sums(x: jax.Array) -> jax.Array:
    """``[U, 1, K]`` float32: the sums of the rows of ``x`` [U, K, V] float32 (over V), at float32
    precision in one bfloat16 MXU pass: ``x`` enters as its three exact bfloat16 parts
    (matmul.split_bf16_exact) stacked on the rows, against a row of ones, and the three partial
    sums are added back (each product of a part and 1 is exact in the float32 accumulator)."""
    U, K, V = x.shape
    parts = jnp.concatenate([p.astype(F32) for p in split_bf16_exact(x)], axis=1)  # [U, 3K, V]
    ones = jnp.ones((U, 1, V), F32)
    sums = mm_nt(ones, parts, MatmulPrecision.BF16)  # [U, 1, 3K]
    return sums[:, :, :K] + sums[:, :, K : 2 * K] + sums[:, :, 2 * K :]


def load_gate(refs: Sequence, io: TokenIO, d: int, name: str) -> jax.Array:
    """Gate ``name``'s tiles as float32 units ``[U, C, d]``: a scalar gate's one block broadcast
    to the ``d`` channels, else :meth:`TokenIO.load`."""
    plan = io.plan
    if plan.scalar(name):
        return load_scalar(refs[0], plan, d, plan.input_dtype(name))
    return io.load(refs, d)


def store_scalar(x: jax.Array, ref, plan: Plan) -> None:
    """The gradient of a scalar gate: units ``x`` [U, C, d] summed over the channels (in float32),
    written as the step's ``(hb, nc C)`` block: lane sums, then one transpose. (Row sums on the
    MXU, ``ones @ x^T`` per head, estimate slower: 132,704 cycles at full float32 precision,
    124,288 in one bfloat16 pass, against 122,516; see :func:`load_scalar`.)"""
    sums = jnp.sum(x, axis=2, keepdims=True).reshape(plan.hb, plan.step_len, 1)  # [hb, nc C, 1]
    cols = jnp.concatenate([sums[j] for j in range(plan.hb)], axis=1)  # [nc C, hb]
    ref[...] = jnp.transpose(cols).astype(ref.dtype)  # [hb, nc C]


def _head_group_index(batch, head_group, step, *_):
    """The ``hb`` heads of a head group of an ``(H, ...)`` per-head parameter array."""
    return (head_group, I0, I0)


def gate_params_spec(plan: Plan) -> pl.BlockSpec:
    """``(hb, 2, K)`` gate parameters (``exp(A_log)``, ``dt_bias``) of the step's heads."""
    return pl.BlockSpec((plan.hb, 2, plan.dk), _head_group_index)


def load_gate_params(ref, plan: Plan) -> jax.Array:
    """The gate parameters as units ``[U, 2, K]`` (every chunk of a head shares them)."""
    x = ref[...].astype(F32)[:, None]  # [hb, 1, 2, K]
    shape = (plan.hb, plan.nc, 2, plan.dk)
    return jnp.broadcast_to(x, shape).reshape(plan.units, 2, plan.dk)


def per_head_sums(x: jax.Array, plan: Plan) -> jax.Array:
    """Units ``[U, 2, K]`` summed over the chunks of each head: ``[hb, 2, K]``."""
    return jnp.sum(x.reshape(plan.hb, plan.nc, *x.shape[1:]), axis=1)


def hbm_any() -> pl.BlockSpec:
    """An array left in HBM, read or written by manual DMAs."""
    return pl.BlockSpec(memory_space=pl.ANY)


def state_spec(plan: Plan) -> pl.BlockSpec:
    """``(hb, K, V)`` tile of a ``(B, H, K, V)`` float32 state array."""
    return pl.BlockSpec((None, plan.hb, plan.dk, plan.dv), _state_index)


def _chunk_states_index(batch, head_group, step, *_):
    """A step's ``nc`` chunks of its head group's ``hb`` heads."""
    return (batch, step, head_group, I0, I0)


def chunk_states_spec(plan: Plan) -> pl.BlockSpec:
    """``(nc, hb, K, V)`` block of the ``(B, n_steps nc, H, K, V)`` float32 chunk-entry states,
    the layout of fla's ``chunk_fwd_h`` (a chunk's heads contiguous: one DMA per chunk); with
    grouped values ``(nc, hb G, K, V / G)`` of the caller's ``(B, n_steps nc, G H, K, V / G)``."""
    G = plan.value_groups
    return pl.BlockSpec((None, plan.nc, plan.hb * G, plan.dk, plan.dv // G), _chunk_states_index)


def residual_spec(plan: Plan, tail: tuple[int, int, int], step_of: Callable) -> pl.BlockSpec:
    """One step's block of a ``(B, H / hb, n_steps, *tail)`` residual."""
    return pl.BlockSpec(
        (None, None, None, *tail), functools.partial(_residual_index, step_of=step_of)
    )


def _saved_state_index(batch, head_group, step, *_, step_of: Callable):
    """The saved state entering step ``s >= 1`` is block ``s - 1``; step 0 maps to block 0 too
    (its entry state is ``h0``, not saved), so steps 0 and 1 share a block."""
    return (batch, head_group, jnp.maximum(step_of(step) - 1, 0), I0, I0, I0)


def saved_state_spec(plan: Plan, step_of: Callable) -> pl.BlockSpec:
    """The ``[hb, K, V]`` block of the ``(B, H / hb, n_steps - 1, hb, K, V)`` saved step-entry
    states (:attr:`Plan.saved_states`)."""
    tail = (plan.hb, plan.dk, plan.dv)
    return pl.BlockSpec(
        (None, None, None, *tail), functools.partial(_saved_state_index, step_of=step_of)
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


def chunk_of(x: jax.Array, j: int, plan: Plan) -> jax.Array:
    """Chunk ``j`` of the step for every head: ``[U, ...]`` -> ``[hb, ...]``."""
    return x.reshape(plan.hb, plan.nc, *x.shape[1:])[:, j]


def stack_chunks(xs: Sequence[jax.Array], plan: Plan) -> jax.Array:
    """Inverse of :func:`chunk_of` over ``j = 0..nc-1``: ``nc x [hb, ...]`` -> ``[U, ...]``."""
    return jnp.stack(xs, axis=1).reshape(plan.units, *xs[0].shape[1:])


def interpret_params(plan) -> pltpu.InterpretParams | bool:
    """The ``interpret`` argument of a ``pallas_call`` of ``plan`` (a :class:`Plan` or a
    ``DecodePlan``): ``False`` for the compiled kernels, else ``pltpu.InterpretParams`` with the
    plan's interpret mode (config.py): race detection (``on_race="raise"``, the interpreter's
    default: a race makes the call raise), the simulated cores, the seed of the order of the
    "parallel" grid axes."""
    mode = plan.interpret
    if mode is None:
        return False
    return pltpu.InterpretParams(
        detect_races=mode.detect_races,
        num_cores_or_threads=mode.cores,
        random_seed=mode.seed,
    )
