"""The pallas_tpu backend: fused Pallas TPU kernels (one forward, one backward ``pallas_call``).

- Capabilities: head sizes 64/128/256 (dk and dv independently), float32/bfloat16, trainable;
  platform ``tpu`` (so ``backend="auto"`` picks it only on a TPU host), and ``interpret``: a named
  call elsewhere runs with ``KernelConfig(interpret=True)`` (TPU interpret mode). The core refuses
  an eager call off a TPU without it; a traced call cannot know its target platform yet (a CPU host
  may lower for TPU) and is guarded when it is lowered (``vjp.py``).
- ``supports()``: chunk lengths of the level scheme (plan.py) whose VMEM byte model fits, and
  for ``cu_seqlens`` a chunk table that fits its share of SMEM (varlen.py).
- Model features (the core's contract, docs/backends.md): packed sequences by ``segment_ids``
  (resets inside the kernels' chunks) and by ``cu_seqlens`` (varlen.py), and the gate
  activations and q/k L2 norm applied inside the kernels (activations.py).
- ``decode``: the decode kernel (kernels_decode.py) for S up to 128 tokens per call, a float32 or
  bfloat16 pool (``supports_decode``: decode_plan.py).
- Scalar gates (``Capabilities.scalar_gates``, KDA's and GDN's beta and decay): the forward and
  backward kernels read a ``(B, T, H)`` gate as ``(hb, nc C)`` float32 blocks, tokens in the lanes,
  and broadcast it over the channels in VMEM; its gradient leaves summed over them (blocks.py).
  The ``cu_seqlens`` row moves them to its chunk-aligned positions as they are (varlen.py).
- Grouped keys (``Capabilities.grouped_keys``): with b, g on the value heads of a grouped call,
  q and k come with their own heads and the kernels read each value head's key head themselves
  where the blocking allows, else they are repeated here (grouped_keys.py).
- ``forward_chunk_states``: the inference forward kernel, also writing the state entering every
  chunk (``return_chunk_states``, prefix caching) as a blocked output of the kernel.
- ``forward_pooled``: the ragged op's requests after its decodes on the forward kernel, which
  reads their starts from and writes their final and checkpoint states to the pool's slots in
  place (pooled.py); ``supports_pooled`` takes a float32 or bfloat16 pool and a checkpoint
  period that is a multiple of ``bt``.
- Config: :class:`~gdn2_pallas_tpu.config.PallasTpuConfig`, the core fields (``bt``,
  ``wy_eps``, ``interpret``; the level scheme has no sub-chunks and never forms a positive
  exponent, chunk_math.py) and the knobs of interpret mode (race detection, simulated cores, the
  seed of the parallel grid axes' order), refused without ``interpret=True``. The plans read it
  through ``PallasTpuConfig.from_config``; another backend's config class (e.g. a
  ``JaxRefConfig``) is refused by ``supports()`` and ``supports_decode()``: ``config: expected a
  KernelConfig or PallasTpuConfig, got JaxRefConfig``.
"""

from __future__ import annotations

import jax

from gdn2_pallas_tpu import grouped_keys, grouped_values
from gdn2_pallas_tpu.config import PallasTpuConfig
from gdn2_pallas_tpu.decode_plan import check_decode_plan, make_decode_plan
from gdn2_pallas_tpu.plan import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_SIZES,
    check_plan,
    make_plan,
    mxu_contraction_depth,
    pooled_plan,
    tensor_cores,
    varlen_plan,
    vmem_capacity_bytes,
)
from gdn2core.plugin import (
    YES,
    Backend,
    Capabilities,
    DecodeSpec,
    KernelConfig,
    OpExtras,
    OpSpec,
    PoolRequests,
    SegmentMode,
    Verdict,
    is_tpu_available,
    probe,
)


def _check_platform(q, config: KernelConfig) -> None:
    """Fail early, with the fix, for an eager (non-traced) call off a TPU without interpret mode.

    Traced calls cannot know their target platform yet (a CPU host may be lowering for TPU); they
    are guarded at lowering/run time by ``vjp._on_tpu_only``."""
    if config.interpret or isinstance(q, jax.core.Tracer) or is_tpu_available():
        return
    from gdn2_pallas_tpu.vjp import CPU_MESSAGE

    raise RuntimeError(CPU_MESSAGE)


class PallasTpuBackend(Backend):
    name = "pallas_tpu"
    priority = 200
    capabilities = Capabilities(
        dtypes=SUPPORTED_DTYPES,
        dk=SUPPORTED_HEAD_SIZES,
        dv=SUPPORTED_HEAD_SIZES,
        trainable=True,
        platforms=("tpu",),
        interpret=True,
        segments=True,
        varlen=True,
        continued=True,
        fused_activations=True,
        decode=True,
        decode_activations=True,
        grouped_decode=True,
        chunk_states=True,
        pooled=True,
        scalar_gates=True,
        grouped_keys=True,
        float32_decay=True,
    )

    def supports(self, spec: OpSpec, config: KernelConfig) -> Verdict:
        """A config this backend reads, a chunk length of the level scheme, a VMEM fit, and a
        cu_seqlens chunk table that fits SMEM."""
        reason = check_plan(spec, config)
        return Verdict(False, reason) if reason else YES

    def forward(
        self, q, k, v, w, b, g, h0, *, spec: OpSpec, config: KernelConfig, extras=None
    ) -> tuple[jax.Array, jax.Array]:
        """The inference forward kernel (see :class:`gdn2core.plugin.Backend`)."""
        return self._call(q, k, v, w, b, g, h0, spec, config, extras, trainable=False)

    def forward_trainable(
        self, q, k, v, w, b, g, h0, *, spec: OpSpec, config: KernelConfig, extras=None
    ) -> tuple[jax.Array, jax.Array]:
        """Forward and backward kernels under one ``jax.custom_vjp``."""
        return self._call(q, k, v, w, b, g, h0, spec, config, extras, trainable=True)

    def forward_chunk_states(
        self, q, k, v, w, b, g, h0, *, spec: OpSpec, config: KernelConfig, extras=None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The inference forward kernel, which also writes every chunk's entry state (see
        :meth:`gdn2core.plugin.Backend.forward_chunk_states`; the core never packs these calls)."""
        config = PallasTpuConfig.from_config(config)
        _check_platform(q, config)
        from gdn2_pallas_tpu import vjp

        extras = OpExtras() if extras is None else extras
        act = spec.activations if spec.activations.any else None
        groups, spec = spec.key_groups, grouped_keys.plain_spec(spec)
        plan = make_plan(spec, config, vmem_capacity_bytes(q), activations=act, chunk_states=True,
                         scalar_gates=spec.scalar_gates, cores=tensor_cores(q),
                         mxu_depth=mxu_contraction_depth(q))  # fmt: skip
        plan, q, k = grouped_keys.read_grouped(plan, q, k, groups)
        plan = grouped_values.read_grouped(plan, spec.value_groups)
        ex = vjp.Extras(A_log=extras.A_log, dt_bias=extras.dt_bias)
        o, h_final, chunks = vjp.gdn2_pallas_chunk_states(q, k, v, w, b, g, h0, plan, ex)
        dtype = h0.dtype
        return (probe("pallas_tpu o", o), probe("pallas_tpu h_final", h_final).astype(dtype),
                chunks.astype(dtype))  # fmt: skip

    def _call(self, q, k, v, w, b, g, h0, spec, config, extras, trainable):
        config = PallasTpuConfig.from_config(config)
        _check_platform(q, config)
        from gdn2_pallas_tpu import vjp

        extras = OpExtras() if extras is None else extras
        act = spec.activations if spec.activations.any else None
        capacity, cores, depth = vmem_capacity_bytes(q), tensor_cores(q), mxu_contraction_depth(q)
        groups, spec = spec.key_groups, grouped_keys.plain_spec(spec)
        if groups > 1 and spec.segments == SegmentMode.CU_SEQLENS:  # the core never does this
            raise ValueError(f"key_groups={groups}: expected 1 with cu_seqlens")
        if spec.segments == SegmentMode.CU_SEQLENS:  # the chunk-aligned row (varlen.py)
            plan = varlen_plan(spec, config, capacity, act, cores, depth, trainable)
            if trainable and extras.continues is not None:
                raise ValueError(
                    "extras.continues: continued sequences are forward only (the ragged op), "
                    "got a trainable call"
                )
            o, h_final = vjp.gdn2_pallas_varlen(
                q, k, v, w, b, g, h0, extras.cu_seqlens, plan, trainable,
                extras.A_log, extras.dt_bias, extras.continues,
            )  # fmt: skip
        else:
            segments = spec.segments == SegmentMode.IDS
            plan = make_plan(spec, config, capacity, segments=segments, activations=act,
                             scalar_gates=spec.scalar_gates, training=trainable, cores=cores,
                             mxu_depth=depth)  # fmt: skip
            plan, q, k = grouped_keys.read_grouped(plan, q, k, groups)
            plan = grouped_values.read_grouped(plan, spec.value_groups)
            ex = vjp.Extras(
                segment_ids=extras.segment_ids if segments else None,
                A_log=extras.A_log,
                dt_bias=extras.dt_bias,
            )
            if trainable:
                o, h_final, _ = vjp.gdn2_pallas_trainable(q, k, v, w, b, g, h0, ex, plan)
            else:
                o, h_final, _ = vjp.gdn2_pallas_forward(q, k, v, w, b, g, h0, plan, ex)
        return probe("pallas_tpu o", o), probe("pallas_tpu h_final", h_final)

    def supports_pooled(
        self, spec: OpSpec, config: KernelConfig, requests: PoolRequests, pool_dtype: str
    ) -> Verdict:
        """A float32 or bfloat16 pool (staged in its dtype, the states float32), a checkpoint period that is a
        multiple of the chunk (a checkpoint is then a chunk's end, pooled.py), and a chunk table
        that fits SMEM."""
        from gdn2_pallas_tpu import pooled, varlen

        if pool_dtype not in ("float32", "bfloat16"):
            return Verdict(False, f"pool: expected a float32 or bfloat16 pool, got {pool_dtype}")
        config = PallasTpuConfig.from_config(config)
        act = spec.activations if spec.activations.any else None
        plan = pooled_plan(spec, config, vmem_capacity_bytes(), act, requests.stores, 1)
        every = requests.stored_every
        if requests.stores and every % plan.C:
            return Verdict(False, f"checkpoint_every={every} is not a multiple of bt={plan.C}")
        reason = varlen.table_refusal(spec.n_seqs, spec.seq_len, plan.C, plan.t_pad, pooled.ROWS)
        return Verdict(False, reason) if reason else YES

    def forward_pooled(
        self, q, k, v, w, b, g, pool, *, spec: OpSpec, config: KernelConfig, extras: OpExtras,
        requests: PoolRequests,
    ) -> tuple[jax.Array, jax.Array]:  # fmt: skip
        """The forward kernel over a ragged call's packed requests, reading and writing their
        slots of the pool in place (pooled.py; see :meth:`gdn2core.plugin.Backend.forward_pooled`)."""
        config = PallasTpuConfig.from_config(config)
        _check_platform(q, config)
        from gdn2_pallas_tpu import vjp

        act = spec.activations if spec.activations.any else None
        key_groups, spec = spec.key_groups, grouped_keys.plain_spec(spec)
        groups = pool.shape[1] // spec.heads
        plan = pooled_plan(spec, config, vmem_capacity_bytes(q), act, requests.stores, groups,
                           tensor_cores(q), mxu_contraction_depth(q))  # fmt: skip
        plan, q, k = grouped_keys.read_grouped(plan, q, k, key_groups)  # flat tokens: grouped
        o, pool = vjp.gdn2_pallas_pooled(
            q, k, v, w, b, g, pool, extras.cu_seqlens, requests, plan, extras.A_log,
            extras.dt_bias,
        )  # fmt: skip
        return probe("pallas_tpu o", o), pool

    def supports_decode(self, spec: DecodeSpec, config: KernelConfig) -> Verdict:
        """A config this backend reads, head sizes, dtypes, S and the VMEM fit of the decode
        kernel (decode_plan.py)."""
        reason = check_decode_plan(spec, config)
        return Verdict(False, reason) if reason else YES

    def decode(
        self, q, k, v, w, b, g, state, slots, *, spec: DecodeSpec, config: KernelConfig,
        extras: OpExtras | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:  # fmt: skip
        """The decode kernel, in place on the pool (see :meth:`gdn2core.plugin.Backend.decode`);
        with ``spec.activations`` it applies them to the raw inputs in VMEM.

        ``slots`` are sanitised here too (decode_op.py): called directly, with a slot out of
        range or named twice, the call skips those sequences as ``gdn2_decode`` would.

        Raises:
            ValueError, TypeError: ``slots`` not an ``(N,)`` integer array.
        """
        config = PallasTpuConfig.from_config(config)
        _check_platform(q, config)
        from gdn2_pallas_tpu.decode_op import gdn2_pallas_decode

        shape, dtype = tuple(getattr(slots, "shape", ())), getattr(slots, "dtype", None)
        if dtype is None or not jax.numpy.issubdtype(dtype, jax.numpy.integer):
            raise TypeError(f"slots: expected an integer array of shape (N,), got {dtype}")
        if shape != (spec.n_seqs,):
            raise ValueError(f"slots: expected shape (N,) = ({spec.n_seqs},), got {shape}")
        plan = make_decode_plan(spec, config, vmem_capacity_bytes(q), tensor_cores(q))
        extras = OpExtras() if extras is None else extras
        return gdn2_pallas_decode(
            q, k, v, w, b, g, state, slots, plan, extras.A_log, extras.dt_bias
        )
