"""The pallas_tpu backend: fused Pallas TPU kernels (one forward, one backward ``pallas_call``).

- Capabilities: head sizes 64/128/256 (dk and dv independently), float32/bfloat16, trainable;
  platform ``tpu`` (so ``backend="auto"`` picks it only on a TPU host), and ``interpret``: a named
  call elsewhere runs with ``KernelConfig(interpret=True)`` (TPU interpret mode). The core refuses
  an eager call off a TPU without it; a traced call cannot know its target platform yet (a CPU host
  may lower for TPU) and is guarded when it is lowered (``vjp.py``).
- ``supports()``: chunk lengths of the level scheme (plan.py) whose VMEM byte model fits.
- ``config.bc``, ``config.mb`` and ``config.clip`` are not read: the level scheme has no
  sub-chunks and never forms a positive exponent (chunk_math.py).
"""

from __future__ import annotations

import jax

from gdn2_pallas_tpu.plan import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_SIZES,
    check_plan,
    make_plan,
    vmem_capacity_bytes,
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
        """A chunk length of the level scheme, and a VMEM fit."""
        reason = check_plan(spec, config)
        return Verdict(False, reason) if reason else YES

    def forward(
        self, q, k, v, w, b, g, h0, *, spec: OpSpec, config: KernelConfig
    ) -> tuple[jax.Array, jax.Array]:
        """The inference forward kernel (see :class:`gdn2core.plugin.Backend`)."""
        _check_platform(q, config)
        from gdn2_pallas_tpu.vjp import gdn2_pallas_forward

        plan = make_plan(spec, config, vmem_capacity_bytes(q))
        o, h_final, _ = gdn2_pallas_forward(q, k, v, w, b, g, h0, plan)
        return probe("pallas_tpu o", o), probe("pallas_tpu h_final", h_final)

    def forward_trainable(
        self, q, k, v, w, b, g, h0, *, spec: OpSpec, config: KernelConfig
    ) -> tuple[jax.Array, jax.Array]:
        """Forward and backward kernels under one ``jax.custom_vjp``."""
        _check_platform(q, config)
        from gdn2_pallas_tpu.vjp import NO_EXTRAS, gdn2_pallas_trainable

        plan = make_plan(spec, config, vmem_capacity_bytes(q))
        o, h_final, _ = gdn2_pallas_trainable(q, k, v, w, b, g, h0, NO_EXTRAS, plan)
        return probe("pallas_tpu o", o), probe("pallas_tpu h_final", h_final)
