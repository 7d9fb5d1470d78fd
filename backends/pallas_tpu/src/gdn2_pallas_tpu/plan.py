"""The static plan of one call of the kernels: blocking, precision, residual dtype, VMEM.

Blocking. A grid step processes ``hb`` heads times ``nc`` consecutive chunks of ``C`` tokens:
``U = hb * nc`` units, whose chunk-parallel work (decay levels, scores, WY inverse, products) runs
batched, so that the dependency chains of the units interleave on the MXU instead of waiting on
each other; only the state pass is sequential (``nc`` steps of one ``[K, V]`` update per head).
Measured by the TPU compiler's static cycle estimate (``gdn2 tpu-report``, v5e, bf16, B=8 T=4096
H=6 d=128): one unit per step costs about 4x the cycles of ``hb=6, nc=4`` per chunk. So:

- ``hb``: the largest divisor of H not above ``MAX_HEADS_PER_STEP`` (8); the layout of the token
  arrays follows from H (:class:`Layout`). On a chip with two TensorCores per device (v5p,
  :func:`tensor_cores`) the compiler splits the "parallel" grid points ``(batch row, head
  group)`` between the cores (merging the two axes: a ``(3, 2, n)`` grid splits 3:3), so ``hb``
  is the largest such divisor that gives both cores as many points: B=1 H=6 takes ``hb = 3``
  where one core would otherwise run every step while the other idles (forward at B=1 T=2048
  H=6 on v5p, static estimate: docs/results.md). Token-major blocks keep 8 heads (B=1 H=8 stays
  on one core: a smaller block would need the head-major copy of every input);
- ``nc``: up to ``rows / (hb C)`` chunks (``rows``: :func:`max_step_rows`, twice as many on v6e's
  256-deep MXU as on v5e's), preferring a divisor of the number of chunks
  (no padding), reduced until the VMEM byte model fits the budget. A training plan (the training
  forward and the backward) takes at least ``dv / C`` chunks (``nc C >= dv`` tokens a step) and
  at least ``dk dv / C^2`` (``nc C^2 >= dk dv``): the state it saves for the backward at every
  step, ``dk x dv`` per head, is then at most ``dk`` values per token and head (as much as the
  token's key) and at most ``C`` (as much as the chunk matrices ``T | A_qk`` saved beside it, ``C
  x C`` per chunk). At ``dk = dv = 128``, ``C = 64`` that is 4 chunks: 16 heads (8-head steps,
  which plan 2) take 4, the train step's temp HBM at B=1 T=32768 H=16 on v5e 192 -> 128 MiB in
  bfloat16 and 384 -> 256 MiB in float32, its kernels about 0.5% slower (static estimate at
  T=2048, docs/results.md); 256-wide value heads (grouped value heads with b, g on the key heads
  run as ``G dv`` wide heads) ask for 8 and get the 4 that fit the VMEM: the train step's temp
  HBM at B=1 T=32768 H=16 HV=32 d=128 bf16 on v5e 322 -> 194 MiB against 2 chunks, its kernels
  0.9% slower (docs/results.md). The cap on the backward's program below wins over that floor.
  The ``cu_seqlens`` row (:func:`varlen_plan`) keeps the planned ``nc`` in training but for the
  cap (no floor: its chunk table is checked against SMEM for both plans).

Training steps. The backward kernel's program (one grid step, every branch of it) grows with the
units it batches, and on a TPU v5e the long programs ran 2.2x to 2.4x as long as the compiler's
static estimate of them (or as the same work at a shorter blocking) while the short ones ran
within 4% of theirs (docs/results.md, "A fourth run on a TPU v5e" and "A fifth run": B=8 T=4096
H=6 float32 inputs, 24 units a step, backward 6.68 ms, 3.16 ms at 12 units; B=1 T=16384 H=16
bfloat16, 8 heads x 4 chunks, 6.41 ms, 2.81 ms at 8 x 2; B=1 T=12288 H=16 bfloat16, 8 x 3, 4.92
ms, 2.11 at 8 x 2; B=1 T=16384 H=16 float32, 8 x 2, 10.94 ms, 4.64 at 8 x 1; B=1 T=32768 H=16
with 32 value heads, 8 x 2, 17.33 ms, 7.84 at 8 x 1). By ``python -m gdn2_tools.llo_utilization
--mode train --kernel gdn2_bwd`` (B=1 T=1024) every slow program was at least 69,237 bundles
(the 256-wide value heads at 8 x 2) and every fast one at most 62,881 (the float32 training
forward at 24 units; the backward 62,551 in bfloat16 at 6 x 4, 57,265 in float32 at 6 x 2). The
estimate cannot see what makes a long program slow (we suspect the fetch of instructions that no
longer fit the core's instruction memory; no public document says), so a training plan takes at
most :func:`max_train_step_rows`: the rows whose program :func:`backward_bundles` (bundles per
unit by the precision of the products and the layout, measured, scaled by ``dk + dv`` above
256) keeps within :data:`MAX_BACKWARD_BUNDLES`: 24 units of C = 64 at 6 heads in bfloat16, 12
in float32, 16 at 16 heads (token-major steps of 8 heads x 2 chunks) in bfloat16, 8 (8 x 1) in
float32 or with 256-wide value heads; on every target (v6e's twice-as-long steps too: their programs
would be longer still). Token-major steps keep their 8 heads, so a step of one chunk can be over
the bound by the model: float32 with 256-wide value heads, 66,240, where the compiler's schedule
has 60,817 bundles (B=1 T=1024 H=16 dv=256; 60,490 with 32 value heads of 128), within the
longest measured fast program (tests/pallas_tpu/test_program_length.py), and it ran at its
estimate on a TPU v5e (docs/results.md, "A sixth run").

Where the cap leaves one chunk a step (16 heads with float32 inputs or 256-wide value heads), the
backward loops over its step's heads instead (:func:`training_blocking`; kernels_bwd._head_loop):
the step takes 2 chunks, and its program holds one iteration's code, a head-major step of ``hb / 2``
heads x 2 chunks (as many units as the unlooped step of one chunk), and the staging of the step's
tiles (:func:`looped_backward_bundles`; 40,821 bundles in float32, 33,304 with 256-wide value heads,
against 43,469 and 35,173 unlooped at one chunk). The training forward does not loop, so it must fit
the bound at 2 chunks by its own model (:func:`forward_bundles`): float32 with 256-wide value heads
does not (72,720 bundles by the model at 8 x 2; it did not finish in the chip driver's 130 s) and
keeps 1 chunk. On a TPU v5e (docs/results.md, "A sixth run", the prototype, and "A seventh run",
this code) the loop of 2 iterations made the train step 3.7% (32 value heads, bfloat16) and 4.7%
(float32) faster than 1 chunk a step, its forward running 16% and 9% faster at 2 chunks, and halved
the saved states: at B=1 T=32768 H=16 the float32 train step saves 383 MiB (639 at one chunk) and
the one with 32 value heads 319 (575). A step of 2 chunks that the cap already allows does not loop
to take 4: for 16 heads in bfloat16 it cost 4% of the train step for 191.5 -> 127.5 MiB of
residuals. A ``cu_seqlens`` row does not loop (its per-sequence state DMAs are the step's). Fewer
chunks a step save more states (module docstring above: the floor); a model that recomputes its
layers in the backward (``jax.checkpoint``) holds one layer's at a time.

The sequence is padded at the end with zero tokens (``k = 0, g = 0`` leave the state unchanged) to
a whole number of steps, ``t_pad = ceil(T / (nc C)) nc C``.

VMEM byte model (one grid step; an upper-bound estimate, checked against the compiler in
tests/pallas_tpu): double-buffered input blocks, the output staging buffers, the residual blocks,
and the live float32 intermediates of the batched chunk math (``[U, C, K]``-sized arrays,
``[U, C, C]`` matrices, ``[hb, K, V]`` states). At the train shape (bf16, d=128, C=64, hb=6,
nc=4) it is about 36 MiB forward and 56 MiB backward: VMEM is 128 MiB per core on v5e and v6e.

VMEM limit. The kernels' scoped VMEM limit (``vmem_limit_bytes``, :func:`vmem_limit`) is
:data:`VMEM_LIMIT_SHARE` of the chip's VMEM, not all of it, and the byte model is planned against
that limit: the rest is headroom for what shares the VMEM with the kernel's scoped allocations
(Mosaic's internal scratch, the fusions XLA places around the call).

Interpret mode. ``Plan.interpret`` is None for the compiled kernels, else the
:class:`~gdn2_pallas_tpu.config.InterpretMode` of the config (race detection, simulated cores,
the seed of the parallel grid axes' order), which ``blocks.interpret_params`` hands to
``pallas_call``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Final

import jax
import jax.numpy as jnp

from gdn2_pallas_tpu import state_writes
from gdn2_pallas_tpu.config import InterpretMode, PallasTpuConfig
from gdn2_pallas_tpu.matmul import DEFAULT_MXU_DEPTH, MatmulPrecision
from gdn2core.plugin import L2NORM_EPS, KernelConfig, OpSpec, SegmentMode

F32_BYTES: Final = 4
#: Lanes and (float32) sublanes of a vector register: the TPU tile.
NUM_LANES: Final = 128
NUM_SUBLANES: Final = 8
#: Heads per grid step at most.
MAX_HEADS_PER_STEP: Final = 8
#: Rows (tokens x heads) of a grid step at most on a 128-deep MXU (v5e): 24 units of C = 64 (4
#: chunks of 6 heads), the measured best at the train shape; more adds VMEM but no speed.
MAX_STEP_ROWS: Final = 24 * 64
#: The same on a 256-deep MXU (v6e), where twice the rows were faster (static estimate, v6e,
#: bf16, B=1 T=1024 H=6: the train kernels 113,698 -> 107,560 cycles at C = 64, 104,466 ->
#: 98,269 at C = 128; docs/algorithm.md section 10).
MAX_STEP_ROWS_DEEP_MXU: Final = 48 * 64
#: The largest exponent a factor of merged levels may reach (:attr:`Plan.merged_block`): exp(64)
#: is 6e27, which leaves float32 (3e38) ten orders of magnitude for the sums of such products
#: in the score backward before the small factor brings them back.
MERGED_EXPONENT: Final = 64.0
#: The blocks whose levels a grid step merges when its own log decays allow it
#: (:attr:`Plan.runtime_merged_blocks`), largest first: 16 rows when every 8 consecutive log
#: decays of a chunk (on each channel) sum to at least ``-MERGED_EXPONENT``, 8 rows when every 4
#: do (checked on a bound over the step's heads: chunk_math.window_maxima, mergeable).
RUNTIME_MERGED_BLOCKS: Final = (16, 8)
#: Length of the backward kernel's program (its grid step, every branch of it) in the TPU
#: compiler's schedule, in bundles per unit of 64 rows with ``dk + dv = 256``, by whether the
#: backward's products are single bfloat16 passes and by the layout (:func:`backward_bundles`):
#: ``python -m gdn2_tools.llo_utilization --mode train --kernel gdn2_bwd -B 1 -T 1024`` (1536
#: for 3 chunks a step), v5e, the largest per unit of the blockings measured (module docstring,
#: "Training steps").
BACKWARD_BUNDLES_PER_UNIT: Final = {
    (True, "head-major"): 2_610,  # H=6: 62,551 bundles at 6 heads x 4 chunks
    (True, "token-major"): 3_280,  # H=16: 51,435 / 77,159 / 104,708 at 8 x 2 / 3 / 4
    (False, "head-major"): 4_780,  # H=6 float32: 57,265 at 6 x 2, 113,228 at 6 x 4
    (False, "token-major"): 5_520,  # H=16 float32: 88,296 at 8 x 2
}
#: Length of the training forward's program (``gdn2_fwd_train``) in bundles per unit of 64 rows
#: with ``dk + dv = 256`` (scaled as :func:`backward_bundles`), by whether its products are single
#: bfloat16 passes and by the layout: the largest per unit measured (``python -m
#: gdn2_tools.llo_utilization --mode train --kernel gdn2_fwd_train -B 1 -T 1024``, or the program
#: ``gdn2 tpu-report --estimate`` prints): bfloat16 50,860 at 16 heads, 8 x 4 (1,589), 32,064 at
#: 8 x 2 with 256-wide value heads (1,336 scaled); float32 62,881 at 6 heads x 4 chunks (2,621),
#: 48,479 at 8 x 2 (3,030), 33,321 at 8 x 1 with 256-wide value heads (2,777 scaled). A head-major
#: bfloat16 forward was not measured: the token-major figure stands for it. On a TPU v5e the
#: float32 forward of 16 heads ran 2.4x slower at 8 x 4 than at 8 x 2 (the model: 96,960 and
#: 48,480 bundles; docs/results.md, "A sixth run").
FORWARD_BUNDLES_PER_UNIT: Final = {
    (True, "head-major"): 1_590,
    (True, "token-major"): 1_590,
    (False, "head-major"): 2_621,
    (False, "token-major"): 3_030,
}
#: Bundles per unit of a looped backward step (:func:`looped_backward_bundles`) beyond its loop's
#: body (one iteration: a head-major step of ``loop_heads`` heads by
#: :data:`BACKWARD_BUNDLES_PER_UNIT`): the loads into the head-major stages and the stores after
#: the loop, by whether the products are single bfloat16 passes. ``llo_utilization --mode train
#: --kernel gdn2_bwd -B 1 -T 1024 -H 16``: bfloat16, 8 heads x 4 chunks, 50,572 bundles with 4
#: heads an iteration and 34,930 with 2 (275 and 439 per unit beyond the body), 8 x 2 with
#: 256-wide value heads and 4 an iteration 33,304 (83 scaled); float32, 8 x 2 with 4 an iteration
#: 40,821 (161). The largest of each, rounded up.
LOOP_STAGING_BUNDLES_PER_UNIT: Final = {True: 440, False: 170}
#: The longest backward program a training plan may have (:func:`max_train_step_rows`): on a TPU
#: v5e every kernel whose program was at most 62,881 bundles ran within 1.04x its static
#: estimate, every one of 69,237 or more at 2.2x to 2.4x (module docstring, "Training steps").
MAX_BACKWARD_BUNDLES: Final = 63_000
#: Chunks per grid step at most (the sequential state pass is nc steps long).
MAX_CHUNKS_PER_STEP: Final = 8
#: Chunk lengths the level scheme takes: powers of two (levels), sublane aligned, MXU sized.
SUPPORTED_CHUNKS: Final = (16, 32, 64, 128)
SUPPORTED_HEAD_SIZES: Final = (64, 128, 256)
SUPPORTED_DTYPES: Final = ("float32", "bfloat16")
#: VMEM planned for when the target chip is unknown (traced for an unknown device): the smallest
#: per-core VMEM of the generations we target (v5p, v7x: 64 MiB; v5e, v6e: 128 MiB).
DEFAULT_VMEM_CAPACITY: Final = 64 * 2**20
#: Share of the per-core VMEM a kernel's scoped VMEM limit asks for (``vmem_limit_bytes``): 112
#: of 128 MiB on v5e and v6e, 56 of 64 MiB on v5p and v7x. Not the whole capacity: Mosaic's
#: internal scratch and the fusions XLA places around the call share the VMEM with the kernel's
#: scoped allocations, and a limit of all of it would leave them none.
VMEM_LIMIT_SHARE: Final = 0.875
#: Share of the capacity the byte model may plan for: the limit itself (the model is an upper
#: bound: the compiler needed 16/32 MiB for the bf16 forward/backward at the train blocking where
#: it says 32/48 MiB; tests/pallas_tpu/test_plan.py compiles with the limit at the model's total).
VMEM_PLAN_SHARE: Final = VMEM_LIMIT_SHARE


def vmem_limit(capacity: int) -> int:
    """The scoped VMEM limit of the forward and backward kernels on a chip of ``capacity``
    bytes of VMEM per core: :data:`VMEM_LIMIT_SHARE` of it (the byte model's budget too)."""
    return int(VMEM_LIMIT_SHARE * capacity)


def _tpu_info(like: jax.Array | None = None):
    """``pltpu.get_tpu_info()`` of the TPU this program is built for, else None.

    The chip is the default device's, or that of an enclosing ``jax.sharding.use_abstract_mesh``,
    or, for an argument traced with a TPU sharding (a deviceless compile on a CPU host), the device
    kind in ``like``'s sharding.
    """
    from jax.experimental.pallas import tpu as pltpu

    try:
        return pltpu.get_tpu_info()
    except Exception:  # not on a TPU host and no abstract TPU mesh around the call
        pass
    mesh = (
        getattr(getattr(jax.typeof(like), "sharding", None), "mesh", None)
        if like is not None
        else None
    )
    device = getattr(mesh, "abstract_device", None)
    if device is not None and getattr(device, "platform", None) == "tpu":
        try:
            with jax.sharding.use_abstract_mesh(mesh):
                return pltpu.get_tpu_info()
        except Exception:  # an unknown TPU kind
            pass
    return None


def vmem_capacity_bytes(like: jax.Array | None = None) -> int:
    """Per-core VMEM of the TPU this program is built for (:func:`_tpu_info`), else
    ``DEFAULT_VMEM_CAPACITY``."""
    info = _tpu_info(like)
    return DEFAULT_VMEM_CAPACITY if info is None else int(info.vmem_capacity_bytes)


def mxu_contraction_depth(like: jax.Array | None = None) -> int:
    """The MXU's contraction depth (``mxu_column_size``) of the TPU this program is built for
    (:func:`_tpu_info`): 128 on v5e, 256 on v6e; off a TPU ``matmul.DEFAULT_MXU_DEPTH`` (128)."""
    info = _tpu_info(like)
    return DEFAULT_MXU_DEPTH if info is None else int(info.mxu_column_size)


def tensor_cores(like: jax.Array | None = None) -> int:
    """TensorCores per device of the TPU this program is built for (:func:`_tpu_info`): 2 on
    v5p (megacore: the compiler splits the "parallel" grid axes between them), 1 on v5e, v6e and
    off a TPU."""
    info = _tpu_info(like)
    return 1 if info is None else max(1, int(info.num_cores))


def planned_cores(config: PallasTpuConfig, cores: int | None) -> int:
    """The TensorCores a plan blocks for: interpret mode's simulated cores, else ``cores``, else
    :func:`tensor_cores` of the target."""
    if config.interpret:
        return config.interpret_cores
    return tensor_cores() if cores is None else cores


def heads_per_step(heads: int, rows: int, cores: int, token_major: bool) -> int:
    """Heads per grid step: the largest divisor of ``heads`` not above ``MAX_HEADS_PER_STEP``
    that gives every core the same number of ``(batch row, head group)`` grid points (``rows``
    batch rows, ``cores`` TensorCores), else the largest divisor. Token-major blocks hold 8
    heads, so their ``hb`` stays 8."""
    divisors = [d for d in range(1, min(heads, MAX_HEADS_PER_STEP) + 1) if heads % d == 0]
    if token_major:
        divisors = [d for d in divisors if d % NUM_SUBLANES == 0] or divisors
    even = [d for d in divisors if (rows * (heads // d)) % cores == 0]
    return max(even or divisors)


class Layout(enum.Enum):
    """How the kernels read the token arrays (blocks.py has the details).

    ``HEAD_MAJOR``: ``(B, H, T, d)``, a swap of the public ``(B, T, H, d)``. For H not a multiple
    of 8, XLA already stores the public array that way (a (H, d) tile would pad H to 8 sublanes),
    so the swap is a bitcast. One DMA per head of a step; outputs by manual per-head DMAs.
    ``TOKEN_MAJOR``: the public ``(B, T, H, d)`` itself, in blocks of ``(nc C, 8, d)``: 8 heads
    per DMA and per step, swapped to head-major in VMEM. For H a multiple of 8, where XLA keeps
    the public layout and a swap would be a copy of every input and gradient through HBM.
    """

    HEAD_MAJOR = "head-major"
    TOKEN_MAJOR = "token-major"


def layout_for(heads: int) -> Layout:
    """TOKEN_MAJOR where XLA keeps the public layout: H a multiple of 8 (float32 and bfloat16)."""
    return Layout.TOKEN_MAJOR if heads % NUM_SUBLANES == 0 else Layout.HEAD_MAJOR


@dataclasses.dataclass(frozen=True, slots=True)
class Precisions:
    """The MXU precision of each group of products (matmul.py)."""

    scores: MatmulPrecision  # F4: A_kk, A_qk by levels
    inverse: MatmulPrecision  # F5: the WY inverse by levels
    wy: MatmulPrecision  # F6: Y | U = T [Ē | Z] (forward and backward)
    state: MatmulPrecision  # F7-F9 and the reverse state pass
    grads: MatmulPrecision  # B1-B5: the chunk-parallel gradient products
    score_grads: MatmulPrecision  # B7: rho and kappa by levels

    @classmethod
    def uniform(cls, precision: MatmulPrecision) -> Precisions:
        return cls(*(precision,) * 6)

    def __str__(self) -> str:
        """``"bf16"`` when every stage uses one precision, else ``"scores=bf16x3 inverse=..."``."""
        values = {f.name: getattr(self, f.name).value for f in dataclasses.fields(self)}
        if len(set(values.values())) == 1:
            return f"{next(iter(values.values()))} (every stage)"
        return " ".join(f"{k}={v}" for k, v in values.items())

    def for_interpret(self) -> Precisions:
        """The same rounding, spelled out for TPU interpret mode (matmul.py)."""
        return Precisions(
            *(getattr(self, f.name).for_interpret() for f in dataclasses.fields(self))
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """Static description of one call (hashable: a ``custom_vjp`` non-diff argument)."""

    batch: int
    seq_len: int  # T of the caller
    heads: int
    dk: int
    dv: int
    dtype: str  # "float32" or "bfloat16"
    scale: float
    wy_eps: float
    C: int  # chunk length
    layout: Layout
    hb: int  # heads per grid step
    nc: int  # chunks per grid step
    precisions: Precisions
    vmem_limit_bytes: int
    interpret: InterpretMode | None  # None: compiled; else how interpret mode runs (config.py)
    segments: bool = False  # packed sequences (segment_ids): resets inside chunks
    activations: object = None  # gdn2core Activations applied in the kernels, or None
    l2norm_eps: float = L2NORM_EPS
    n_seqs: int = 0  # cu_seqlens: the number of packed sequences (varlen.py); 0 otherwise
    pool_groups: int = 0  # pooled requests (pooled.py): the pool's value heads per head; 0: none
    pool_checkpoints: bool = False  # pooled requests that store checkpoints (pooled.py)
    token_rows: int = 0  # pooled, token-major: the flat tokens the kernel reads (flat_tokens.py)
    chunk_states: bool = False  # the forward also writes the state entering every chunk
    scalar_gates: tuple[str, ...] = ()  # of "w", "b", "g": read as (hb, nc C) blocks, one value
    #   per head and token (blocks.scalar_spec); not with pooled requests
    key_groups: int = 1  # heads per key head of q, k (grouped_keys.py): they keep heads /
    #   key_groups heads and each step reads its own from one token block (blocks.TokenIO)
    uniform_gate: bool = False  # the fused gate's dt_bias is one per head (OpSpec.uniform_gate)
    value_groups: int = 1  # value heads per head of v, w, o (grouped_values.py):
    #   read and written as the caller's (B, t_pad, value_groups H, dv / value_groups)
    float32_decay: bool = False  # g (and dg) float32 beside bfloat16 inputs (OpSpec.float32_decay)
    saved_state_dtype: str = "float32"  # the train forward's saved step-entry states
    #   (saved_state_dtype_for; the backward rebuilds the chunks' states from them in float32)
    mxu_depth: int = DEFAULT_MXU_DEPTH  # the target's MXU contraction depth: float32 products
    #   at most half as deep take two passes, not three (matmul.py, mxu_contraction_depth)
    loop_heads: int = 0  # heads per iteration of the backward step's loop over its heads (0: no
    #   loop; training_blocking, kernels_bwd._head_loop)

    def scalar(self, name: str) -> bool:
        """Whether the kernels read gate ``name`` (and write its gradient) as a scalar gate."""
        return name in self.scalar_gates

    def input_dtype(self, name: str):
        """The dtype of input ``name`` of ``(q, k, v, w, b, g)`` as the caller gave it (and of its
        gradient): the plan's, or float32 for ``g`` with ``float32_decay``."""
        return jnp.float32 if name == "g" and self.float32_decay else jnp.dtype(self.dtype)

    @property
    def varlen(self) -> bool:
        """Per-sequence states at chunk boundaries (``cu_seqlens``, varlen.py)."""
        return self.n_seqs > 0

    @property
    def pooled(self) -> bool:
        """The sequences are a ragged call's requests, their states slots of a pool (pooled.py)."""
        return self.pool_groups > 0

    @property
    def flat_tokens(self) -> bool:
        """The pooled forward reads its chunks from the flat tokens (flat_tokens.py), not from
        a row XLA moved them into."""
        return self.token_rows > 0

    @property
    def fused(self) -> bool:
        """Whether the kernels activate their raw inputs (activations.py)."""
        return self.activations is not None and self.activations.any

    @property
    def gate(self) -> bool:
        """Whether the kernels take the gate parameters (``exp(A_log)``, ``dt_bias``)."""
        return self.fused and self.activations.gate != "none"

    @property
    def decay_in_bf16(self) -> bool:
        """Whether the kernels' ``g`` (clamped at ``G_FLOOR``, a bfloat16 number) holds bfloat16
        numbers: bfloat16 inputs, ``g`` on the channels in that dtype, not computed by a fused
        gate."""
        return (
            jnp.dtype(self.dtype) == jnp.bfloat16
            and not self.float32_decay
            and not self.scalar("g")
            and not self.fused
        )

    @property
    def scalar_decay(self) -> bool:
        """The decay ``g`` is one value per head and token, the same on every channel, so each
        pair of a chunk has one factor (chunk_math.PairDecay) and needs no levels. With the fused
        gate only when its ``dt_bias`` is one per head (``uniform_gate``): one per channel makes
        the activated ``g`` differ by channel."""
        return self.scalar("g") and (not self.gate or self.uniform_gate)

    @property
    def merged_block(self) -> int:
        """Rows of the blocks whose decay levels merge into one product (1: none).

        With the bounded gate (``lower_bound``: every log decay lies in ``[lower_bound, 0)``),
        the factors of a pair relative to its block's middle row have exponents of at most
        ``block / 2 * |lower_bound|``; the largest power-of-two block, up to ``C``, that keeps
        them within :data:`MERGED_EXPONENT` needs no levels inside it (chunk_math.py). Packed
        sequences by ``segment_ids`` keep the levels (a block's middle row may lie in another
        sequence than a pair of it)."""
        act = self.activations
        if not self.fused or act.gate != "lower_bound" or self.segments:
            return 1
        block = self.C
        while block > 1 and block // 2 * abs(act.lower_bound) > MERGED_EXPONENT:
            block //= 2
        return block if block >= 4 else 1  # 2 rows: level 0 alone, nothing merges

    @property
    def runtime_merged_blocks(self) -> tuple[int, ...]:
        """The blocks whose levels a grid step merges when the step's log decays allow it
        (chunk_math.by_decay_bound: one copy of the step per block, and one with the levels; a
        bound on the step's largest sum of ``|g|`` over ``block / 2`` consecutive rows picks the
        copy; under the softplus gate, a bound on the activated ``g``, activations.py), largest
        first; ``()`` where a call has one blocking: a bounded gate (:attr:`merged_block`, fixed
        by its bound, or too weak a bound to merge), packed sequences by ``segment_ids`` (a
        block's middle row may lie in another sequence), a scalar decay (no levels) and a ragged
        call's pooled forward."""
        fixed = self.merged_block > 1 or self.segments or self.scalar_decay or self.pooled
        if fixed or (self.gate and self.activations.gate != "softplus"):
            return ()
        return tuple(block for block in RUNTIME_MERGED_BLOCKS if block <= self.C)

    @property
    def units(self) -> int:
        return self.hb * self.nc

    @property
    def step_len(self) -> int:
        """Tokens per grid step per head."""
        return self.nc * self.C

    @property
    def n_steps(self) -> int:
        return max(1, math.ceil(self.seq_len / self.step_len))

    @property
    def saved_states(self) -> int:
        """Step-entry states the training forward saves: every step's but step 0's (``h0``,
        which the backward reads itself)."""
        return self.n_steps - 1

    @property
    def t_pad(self) -> int:
        return self.n_steps * self.step_len

    @property
    def head_groups(self) -> int:
        return self.heads // self.hb

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    @property
    def lane_pack(self) -> int:
        """Units side by side in the lanes of a saved ``[C, C]`` matrix: a ``C < 128`` matrix alone
        would be padded to 128 lanes in HBM (twice the bytes at C = 64)."""
        pack = lanes_packed(self.C)
        return pack if self.units % pack == 0 else 1

    @property
    def residual_block(self) -> tuple[int, int, int]:
        """The packed ``T``/``A_qk`` block of a step: ``(U / pack, C, pack C)``."""
        return (self.units // self.lane_pack, self.C, self.lane_pack * self.C)

    @property
    def residual_dtype(self):
        """dtype of the saved ``T`` and ``A_qk``: bfloat16 when every product that reads them
        rounds them to bfloat16 anyway, else float32."""
        p = self.precisions
        readers = (p.wy, p.state, p.grads)
        return jnp.bfloat16 if all(x is MatmulPrecision.BF16 for x in readers) else jnp.float32

    def grid(self) -> tuple[int, int, int]:
        """(batch, head group, step): the step axis is last, sequential ("arbitrary")."""
        return (self.batch, self.head_groups, self.n_steps)


def lanes_packed(C: int) -> int:
    """``[C, C]`` matrices side by side in 128 lanes (:attr:`Plan.lane_pack`)."""
    return max(1, NUM_LANES // C)


def precisions_for(dtype: str) -> Precisions:
    """bfloat16 inputs: one bf16 pass everywhere; float32 inputs: bf16x3 (docs/algorithm.md
    measures both)."""
    if dtype == "bfloat16":
        return Precisions.uniform(MatmulPrecision.BF16)
    return Precisions.uniform(MatmulPrecision.BF16X3)


def saved_state_dtype_for(precisions: Precisions) -> str:
    """dtype of the state the training forward saves at every grid step for the backward:
    bfloat16 when the state's products round it to bfloat16 (bfloat16 inputs), as fla saves its
    chunk states in the inputs' dtype; float32 otherwise. The backward rebuilds the chunks'
    states from it in float32 (docs/algorithm.md section 10, "Saved states")."""
    return "bfloat16" if precisions.state is MatmulPrecision.BF16 else "float32"


def gate_savings(plan: Plan) -> int:
    """Bytes per token and head that the gates take less than ``d`` values of the input dtype
    each: a scalar gate is one float32 (4 bytes instead of ``d`` values); a float32 ``g`` beside
    bfloat16 inputs (``plan.float32_decay``, on its channels) takes ``(4 - 2) dk`` more. Its
    gradient likewise."""
    K, V, s = plan.dk, plan.dv, plan.itemsize
    saved = sum({"w": V, "b": K, "g": K}[n] * s - F32_BYTES for n in plan.scalar_gates)
    if plan.float32_decay and not plan.scalar("g"):
        saved -= (F32_BYTES - s) * K
    return saved


def vmem_bytes(plan: Plan, backward: bool) -> dict[str, int]:
    """The VMEM byte model of one grid step (module docstring)."""
    U, hb, C, K, V, s = plan.units, plan.hb, plan.C, plan.dk, plan.dv, plan.itemsize
    rs = jnp.dtype(plan.residual_dtype).itemsize
    n_in = (4 * K + 3 * V) if backward else (4 * K + 2 * V)  # q k b g (+dO) v w per token
    n_out = (4 * K + 2 * V) if backward else V  # gradients / o per token
    gates = gate_savings(plan)  # the scalar gates' bytes (and their gradients'), a float32 g's
    in_bytes, out_bytes = n_in * s - gates, n_out * s - (gates if backward else 0)
    blocks = 2 * hb * plan.step_len * in_bytes  # double-buffered input tiles
    blocks += hb * plan.step_len * out_bytes  # output staging (manual DMA)
    blocks += 2 * U * C * max(C, NUM_LANES // plan.lane_pack) * rs  # T|A_qk, lane-packed
    blocks += 2 * (3 if backward else 2) * hb * K * V * F32_BYTES  # states in/out (and h0)
    if plan.segments:  # the (nc C, 1) float32 start flags, lanes padded to 128, double-buffered
        blocks += 2 * plan.step_len * NUM_LANES * F32_BYTES
    if plan.gate:  # (hb, 2, K) float32 gate parameters (and their gradient), rows padded to 8
        blocks += (4 if backward else 2) * hb * NUM_SUBLANES * K * F32_BYTES
    if plan.chunk_states and not backward:  # the [nc, hb, K, V] f32 chunk states, double-buffered
        blocks += 2 * U * K * V * F32_BYTES
    scratch = hb * K * V * F32_BYTES  # the carried state (or dS)
    if plan.varlen:  # the per-sequence states' read staging (the backward: and a spare state),
        # and the writes' staging buffers (state_writes.py; f32 counted for a pool of any dtype)
        scratch += (2 if backward else 1) * hb * K * V * F32_BYTES
        scratch += state_writes.vmem_bytes((hb, K, V), F32_BYTES)
    if backward and plan.loop_heads:  # the looped step's head-major inputs (a scalar gate's
        # broadcast to d in float32) and its float32 gradients (kernels_bwd._head_loop)
        staged = sum({"w": V, "b": K, "g": K}[n] * (F32_BYTES - s) for n in plan.scalar_gates)
        staged += (F32_BYTES - s) * K if plan.float32_decay and not plan.scalar("g") else 0
        scratch += hb * plan.step_len * (n_in * s + staged + n_out * F32_BYTES)
        U = plan.loop_heads * plan.nc  # one iteration's units are live at a time
    lcn = math.log2(C)
    if backward:  # ~30 [C, K] + ~10 [C, V] + ~12 [C, C] live per unit, 2 states per unit
        live = F32_BYTES * U * (30 * C * K + 10 * C * V + 12 * C * C + 2 * K * V)
    else:  # ~16 [C, K] + ~6 [C, V] + ~8 [C, C] per unit, plus the levels' factors
        live = F32_BYTES * U * ((16 + lcn) * C * K + 6 * C * V + 8 * C * C)
    live = int(live)
    return {"blocks": blocks, "scratch": scratch, "live": live, "total": blocks + scratch + live}


def max_step_rows(mxu_depth: int, n_seqs: int = 0) -> int:
    """Rows (tokens x heads) a grid step may take on an MXU ``mxu_depth`` deep: twice
    :data:`MAX_STEP_ROWS` on a 256-deep one (:data:`MAX_STEP_ROWS_DEEP_MXU`), but in a
    ``cu_seqlens`` or pooled call (``n_seqs``), whose every sequence may leave up to one step's
    worth of padding."""
    deep = mxu_depth >= 2 * DEFAULT_MXU_DEPTH and not n_seqs
    return MAX_STEP_ROWS_DEEP_MXU if deep else MAX_STEP_ROWS


def _model_units(rows: int, dk: int, dv: int) -> float:
    """Units of 64 rows with ``dk + dv = 256`` that the program models count a step of ``rows``
    as: wider heads scaled by ``(dk + dv) / 256``, narrower ones as 128-wide (:func:`backward_bundles`)."""
    return rows / 64 * max(1.0, (dk + dv) / 256)


def _single_pass(precisions: Precisions) -> bool:
    """Whether every product is one bfloat16 pass (the program models' precision key)."""
    return precisions == Precisions.uniform(MatmulPrecision.BF16)


def backward_bundles(rows: int, layout: Layout, dk: int, dv: int,
                     precisions: Precisions) -> float:  # fmt: skip
    """The model of the backward kernel's program length, in bundles, for a grid step of
    ``rows`` (tokens x heads): :data:`BACKWARD_BUNDLES_PER_UNIT` per 64 rows, scaled by
    ``(dk + dv) / 256`` where that is more than 1 (a 256-wide value head's unit measured 0.88x of
    that: 69,237 bundles at 8 x 2 with ``dv = 256``, token-major; narrower heads are counted as
    128-wide ones: none was measured, and a unit's ``C x C`` work does not shrink with them)."""
    per_unit = BACKWARD_BUNDLES_PER_UNIT[(_single_pass(precisions), layout.value)]
    return _model_units(rows, dk, dv) * per_unit


def max_train_step_rows(layout: Layout, dk: int, dv: int, precisions: Precisions) -> int:
    """Rows a training plan's grid step may take (on every target): the most, in units of 64,
    whose backward program :func:`backward_bundles` keeps within :data:`MAX_BACKWARD_BUNDLES`
    (the module docstring, "Training steps"); at least 64."""
    unit = backward_bundles(64, layout, dk, dv, precisions)
    return 64 * max(1, int(MAX_BACKWARD_BUNDLES // unit))


def forward_bundles(rows: int, layout: Layout, dk: int, dv: int,
                    precisions: Precisions) -> float:  # fmt: skip
    """The model of the training forward's program length, in bundles, for a grid step of
    ``rows``: :data:`FORWARD_BUNDLES_PER_UNIT` per 64 rows, scaled as :func:`backward_bundles`."""
    per_unit = FORWARD_BUNDLES_PER_UNIT[(_single_pass(precisions), layout.value)]
    return _model_units(rows, dk, dv) * per_unit


def looped_backward_bundles(hb: int, loop_heads: int, nc: int, C: int, dk: int, dv: int,
                            precisions: Precisions) -> float:  # fmt: skip
    """The model of a looped backward step's program (``hb`` heads x ``nc`` chunks in iterations
    of ``loop_heads`` heads; kernels_bwd._head_loop): one iteration's head-major step by
    :func:`backward_bundles`, and :data:`LOOP_STAGING_BUNDLES_PER_UNIT` per unit of the step."""
    body = backward_bundles(loop_heads * nc * C, Layout.HEAD_MAJOR, dk, dv, precisions)
    staging = LOOP_STAGING_BUNDLES_PER_UNIT[_single_pass(precisions)]
    return body + _model_units(hb * nc * C, dk, dv) * staging


def training_blocking(nc: int, n_chunks: int, hb: int, spec: OpSpec, C: int,
                      precisions: Precisions, layout: Layout,
                      floor: bool = True) -> tuple[int, int]:  # fmt: skip
    """Chunks a step of a training plan takes, from the planned ``nc``, and the heads of an
    iteration of the backward step's loop over its heads (0: no loop). With ``floor``, at least
    ``dv / C`` and ``dk dv / C^2`` chunks (the smallest divisor of ``n_chunks`` from there, else
    padded; the saved states' bytes, module docstring); then at most :func:`max_train_step_rows`
    rows (a divisor of ``n_chunks`` where one is at least half of that, else padded), which wins
    over the floor. Where that cap leaves one chunk a step and the floor asks for more, the
    backward loops over its heads (``hb / 2`` an iteration, with ``floor``: not for a
    ``cu_seqlens`` row) and the step takes 2 chunks, if the training forward's program
    (:func:`forward_bundles`) and the looped backward's (:func:`looped_backward_bundles`) stay
    within :data:`MAX_BACKWARD_BUNDLES` (module docstring, "Training steps")."""
    cap = min(MAX_CHUNKS_PER_STEP, n_chunks)
    if floor:
        nc_min = min(cap, max(-(-spec.dv // C), -(-spec.dk * spec.dv // (C * C))))
        if nc < nc_min:
            nc = next((d for d in range(nc_min, cap + 1) if n_chunks % d == 0), nc_min)
    nc_code = max(1, max_train_step_rows(layout, spec.dk, spec.dv, precisions) // (hb * C))
    if nc <= nc_code:
        return nc, 0
    hs = hb // 2
    forward = forward_bundles(hb * 2 * C, layout, spec.dk, spec.dv, precisions)
    backward = looped_backward_bundles(hb, hs, 2, C, spec.dk, spec.dv, precisions)
    whole_rows = (hs * 2) % lanes_packed(C) == 0  # an iteration's packed T | A_qk rows
    looped = floor and nc_code == 1 and hb % 2 == 0 and whole_rows
    looped = looped and max(forward, backward) <= MAX_BACKWARD_BUNDLES
    if looped:
        return 2, hs
    nc = max(d for d in range(1, nc_code + 1) if n_chunks % d == 0)
    if nc < nc_code // 2:
        nc = nc_code
    return nc, 0


def make_plan(
    spec: OpSpec,
    config: KernelConfig,
    vmem_capacity: int | None = None,
    precisions: Precisions | None = None,
    segments: bool = False,
    activations: object = None,
    n_seqs: int = 0,
    chunk_states: bool = False,
    scalar_gates: tuple[str, ...] = (),
    training: bool = False,
    cores: int | None = None,
    mxu_depth: int | None = None,
) -> Plan:
    """The plan of one call (see the module docstring for the choices); ``n_seqs``: the
    sequences of a ``cu_seqlens`` call (0 otherwise; :func:`varlen_plan` gives the row);
    ``chunk_states``: an inference forward that also writes every chunk's entry state;
    ``scalar_gates``: the gates read as one value per head and token (``spec.scalar_gates``);
    ``training``: the plan of the training forward and the backward (at least ``dv / C`` and
    ``dk dv / C^2`` chunks a step, so that the saved step states stay small); ``cores``: the
    TensorCores that share the parallel grid axes (None: :func:`tensor_cores` of the target;
    interpret mode: the simulated cores); ``mxu_depth``: the MXU's contraction depth (None:
    :func:`mxu_contraction_depth` of the target).

    Raises:
        TypeError: ``config`` is another backend's config class (:class:`PallasTpuConfig`).
    """
    config = PallasTpuConfig.from_config(config)
    capacity = vmem_capacity_bytes() if vmem_capacity is None else vmem_capacity
    precs = precisions_for(spec.dtype) if precisions is None else precisions
    budget = vmem_limit(capacity)  # the byte model is planned against the limit itself
    C = int(config.bt)
    layout = layout_for(spec.heads)
    cores = planned_cores(config, cores)
    mxu_depth = mxu_contraction_depth() if mxu_depth is None else mxu_depth
    rows = 1 if n_seqs else spec.batch  # a cu_seqlens or pooled call is one row
    hb = heads_per_step(spec.heads, rows, cores, layout is Layout.TOKEN_MAJOR)
    n_chunks = max(1, math.ceil(spec.seq_len / C))
    # nc divides the chunks when it can: a partial last step would pad every token array (a copy
    # through HBM), and T a multiple of C then needs no padding at all.
    step_rows = max_step_rows(mxu_depth, n_seqs)
    nc_max = max(1, min(MAX_CHUNKS_PER_STEP, step_rows // (hb * C), n_chunks))
    nc = max(d for d in range(1, nc_max + 1) if n_chunks % d == 0)
    if nc < nc_max // 2:  # e.g. a prime number of chunks: pad rather than lose the batching
        nc = nc_max
    loop_heads = 0
    if training:  # the saved states' floor (not for a cu_seqlens row), the program's cap
        nc, loop_heads = training_blocking(nc, n_chunks, hb, spec, C, precs, layout, not n_seqs)
    while True:
        plan = Plan(
            batch=spec.batch,
            seq_len=spec.seq_len,
            heads=spec.heads,
            dk=spec.dk,
            dv=spec.dv,
            dtype=spec.dtype,
            scale=float(spec.scale),
            wy_eps=float(config.wy_eps),
            C=C,
            layout=layout,
            hb=hb,
            nc=nc,
            precisions=precs.for_interpret() if config.interpret else precs,
            vmem_limit_bytes=budget,
            interpret=config.interpret_mode(),
            segments=segments,
            activations=activations,
            n_seqs=n_seqs,
            chunk_states=chunk_states,
            mxu_depth=mxu_depth,
            scalar_gates=tuple(scalar_gates),
            uniform_gate=spec.uniform_gate,
            float32_decay=spec.float32_decay,
            saved_state_dtype=saved_state_dtype_for(precs),
            loop_heads=loop_heads,
        )
        need = max(vmem_bytes(plan, False)["total"], vmem_bytes(plan, True)["total"])
        if need <= budget or (nc == 1 and hb == 1):
            return plan
        loop_heads = 0  # the step's heads unlooped (a smaller step needs no loop)
        if nc > 1:
            nc //= 2
        else:  # fewer heads per step: the token-major blocks need 8
            hb = max(d for d in range(1, hb) if spec.heads % d == 0)
            layout = Layout.HEAD_MAJOR


def check_plan(spec: OpSpec, config: KernelConfig) -> str | None:
    """``None`` when the kernels can run this call, else the reason (the first: a config class
    this backend does not read, a chunk length the level scheme does not take, a ``cu_seqlens``
    chunk table too long for SMEM (varlen.py), no VMEM fit)."""
    refusal = PallasTpuConfig.refusal(config)
    if refusal:
        return refusal
    config = PallasTpuConfig.from_config(config)
    if config.bt not in SUPPORTED_CHUNKS:
        return f"bt={config.bt} is not one of {SUPPORTED_CHUNKS} (powers of two, sublane aligned)"
    act = spec.activations if spec.activations.any else None
    if spec.segments == SegmentMode.CU_SEQLENS:
        from gdn2_pallas_tpu import varlen

        trained = varlen_plan(spec, config, vmem_capacity_bytes(), act, training=True)
        plan = varlen_plan(spec, config, vmem_capacity_bytes(), act)
        for row in (plan, trained):  # a trainable call's row has its own steps
            refusal = varlen.table_refusal(spec.n_seqs, spec.seq_len, row.C, row.t_pad)
            if refusal:
                return refusal
    else:
        segments = spec.segments == SegmentMode.IDS
        plan = make_plan(spec, config, segments=segments, activations=act)
    budget = plan.vmem_limit_bytes
    for name, backward in (("forward", False), ("backward", True)):
        used = vmem_bytes(plan, backward)["total"]
        if used > budget:
            return (
                f"{name} kernel needs ~{used / 2**20:.1f} MiB of VMEM per grid step at bt={config.bt}, "
                f"dk={spec.dk}, dv={spec.dv} even with one head and one chunk per step (its VMEM "
                f"limit: {budget / 2**20:.0f} MiB, {VMEM_LIMIT_SHARE:.1%} of the chip's); use a "
                "smaller bt"
            )
    return None


def varlen_plan(spec: OpSpec, config: KernelConfig, vmem_capacity: int, activations=None,
                cores: int | None = None, mxu_depth: int | None = None,
                training: bool = False) -> Plan:  # fmt: skip
    """The plan of a ``cu_seqlens`` call: the chunk-aligned row of ``spec.n_seqs`` sequences
    (varlen.py), one batch row; ``training``: a trainable call's (the program's cap on a step's
    rows, :func:`training_blocking`, without the saved states' floor)."""
    from gdn2_pallas_tpu import varlen

    plan = make_plan(spec, config, vmem_capacity, activations=activations, n_seqs=spec.n_seqs,
                     scalar_gates=spec.scalar_gates, training=training, cores=cores,
                     mxu_depth=mxu_depth)  # fmt: skip
    t_pad = varlen.padded_length(spec.seq_len, spec.n_seqs, plan.C, plan.step_len)
    return dataclasses.replace(plan, batch=1, seq_len=t_pad, n_seqs=spec.n_seqs)


def pooled_plan(spec: OpSpec, config: KernelConfig, vmem_capacity: int, activations, stores: bool,
                pool_groups: int, cores: int | None = None,
                mxu_depth: int | None = None) -> Plan:  # fmt: skip
    """The plan of a pooled call: the chunk-aligned row of ``spec.n_seqs`` requests (pooled.py),
    one batch row; ``stores``: with checkpoints (a filler before each request). Token-major
    calls read the flat tokens (``token_rows``: ``T``, at least one grid step; flat_tokens.py)."""
    from gdn2_pallas_tpu import varlen

    plan = make_plan(spec, config, vmem_capacity, activations=activations, n_seqs=spec.n_seqs,
                     scalar_gates=spec.scalar_gates, cores=cores, mxu_depth=mxu_depth)  # fmt: skip
    flat = plan.layout is Layout.TOKEN_MAJOR
    wasted = spec.n_seqs * (2 if stores else 1)  # chunks the requests may waste (pooled.py)
    wasted += 2 if flat else 0  # and the zero chunks' (flat_tokens.py, section Output)
    t_pad = varlen.padded_length(spec.seq_len, wasted, plan.C, plan.step_len)
    return dataclasses.replace(
        plan, batch=1, seq_len=t_pad, n_seqs=spec.n_seqs, pool_groups=pool_groups,
        pool_checkpoints=stores, token_rows=max(spec.seq_len, plan.step_len) if flat else 0,
    )  # fmt: skip
