"""The pallas_tpu backend: fused Pallas TPU kernels (one forward, one backward ``pallas_call``).

- Capabilities: head sizes 64/128/256 (dk and dv independently), float32/bfloat16, trainable;
  platform ``tpu`` (so ``backend="auto"`` picks it only on a TPU host), and ``interpret``: a named
  call elsewhere runs with ``KernelConfig(interpret=True)`` (TPU interpret mode). The core refuses
  an eager call off a TPU without it; a traced call cannot know its target platform yet (a CPU host
  may lower for TPU) and is guarded when it is lowered (``vjp.py``).
- ``supports()``: blockings whose tiles are sublane aligned and whose VMEM byte model fits
  (config.py); ``hybrid_forward`` needs gdn2-jax-ref (the ``hybrid`` extra).
- ``config.clip`` is not read: the kernels never form a positive exponent (chunk_math.py).
"""

from __future__ import annotations

import jax

from gdn2_pallas_tpu.config import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_SIZES,
    check_vmem,
    make_plan,
)
from gdn2core.plugin import (
    YES,
    Backend,
    Capabilities,
    KernelConfig,
    OpSpec,
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
    )

    def supports(self, spec: OpSpec, config: KernelConfig) -> Verdict:
        """Sublane-aligned chunks, a VMEM fit, and gdn2-jax-ref for ``hybrid_forward``."""
        if config.bt % 8 != 0:
            return Verdict(
                False, f"bt={config.bt} must be a multiple of 8 (TPU sublane tile of a chunk)"
            )
        if config.hybrid_forward:
            try:
                import gdn2_jax_ref  # noqa: F401
            except ImportError as err:
                return Verdict(
                    False, f"hybrid_forward needs gdn2-jax-ref (the 'hybrid' extra): {err}"
                )
        reason = check_vmem(spec, config)
        if reason:
            return Verdict(False, reason)
        return YES

    def forward(
        self, q, k, v, w, b, g, h0, *, spec: OpSpec, config: KernelConfig
    ) -> tuple[jax.Array, jax.Array]:
        """The inference forward kernel (see :class:`gdn2core.plugin.Backend`)."""
        if config.hybrid_forward:  # no kernel runs in the inference forward of this mode
            from gdn2_pallas_tpu.hybrid import jax_ref_forward

            return jax_ref_forward(q, k, v, w, b, g, h0, spec=spec, config=config)
        _check_platform(q, config)
        from gdn2_pallas_tpu.vjp import gdn2_pallas_forward

        o, h_final = gdn2_pallas_forward(q, k, v, w, b, g, h0, make_plan(spec, config))
        return probe("pallas_tpu o", o), probe("pallas_tpu h_final", h_final)

    def forward_trainable(
        self, q, k, v, w, b, g, h0, *, spec: OpSpec, config: KernelConfig
    ) -> tuple[jax.Array, jax.Array]:
        """Forward and backward kernels under one ``jax.custom_vjp``."""
        _check_platform(q, config)
        plan = make_plan(spec, config)
        if config.hybrid_forward:
            from gdn2_pallas_tpu.hybrid import gdn2_hybrid_trainable

            return gdn2_hybrid_trainable(q, k, v, w, b, g, h0, plan, spec, config)
        from gdn2_pallas_tpu.vjp import gdn2_pallas_trainable

        o, h_final = gdn2_pallas_trainable(q, k, v, w, b, g, h0, plan)
        return probe("pallas_tpu o", o), probe("pallas_tpu h_final", h_final)
