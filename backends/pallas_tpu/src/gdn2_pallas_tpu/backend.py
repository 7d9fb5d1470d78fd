"""The pallas_tpu backend: fused Pallas TPU kernels (one forward, one backward ``pallas_call``).

- ``availability()``: always yes. The kernels can always be built; whether they can *run* depends
  on the platform the computation is compiled for (see ``vjp.py``: on a non-TPU platform without
  ``KernelConfig(interpret=True)`` the compiled computation fails with a message naming the fix,
  while ``jax.jit(...).lower(lowering_platforms=("tpu",))`` on a CPU host compiles the kernels).
- ``auto_selectable()``: only on a TPU host.
- ``supports()``: head sizes 64/128/256 (dk and dv independently), float32/bfloat16, and blockings
  whose tiles are sublane aligned and whose VMEM byte model fits (config.py).
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
from gdn2core import Backend, Capabilities, Verdict
from gdn2core.backend import YES
from gdn2core.config import KernelConfig
from gdn2core.diagnostics import probe
from gdn2core.platform import is_tpu_available
from gdn2core.spec import OpSpec


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
    )

    def availability(self) -> Verdict:
        return YES

    def auto_selectable(self) -> Verdict:
        if is_tpu_available():
            return YES
        return Verdict(False, "auto picks pallas_tpu only on a TPU")

    def supports(self, spec: OpSpec, config: KernelConfig) -> Verdict:
        base = super().supports(spec, config)
        if not base:
            return base
        if config.bt % 8 != 0:
            return Verdict(
                False, f"bt={config.bt} must be a multiple of 8 (TPU sublane tile of a chunk)"
            )
        if config.hybrid_forward:
            try:
                import gdn2_jax_ref  # noqa: F401
            except ImportError as err:
                return Verdict(False, f"hybrid_forward needs gdn2-jax-ref installed ({err})")
        reason = check_vmem(spec, config)
        if reason:
            return Verdict(False, reason)
        return YES

    def forward(
        self, q, k, v, w, b, g, h0, *, spec: OpSpec, config: KernelConfig
    ) -> tuple[jax.Array, jax.Array]:
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
        _check_platform(q, config)
        plan = make_plan(spec, config)
        if config.hybrid_forward:
            from gdn2_pallas_tpu.hybrid import gdn2_hybrid_trainable

            return gdn2_hybrid_trainable(q, k, v, w, b, g, h0, plan, spec, config)
        from gdn2_pallas_tpu.vjp import gdn2_pallas_trainable

        o, h_final = gdn2_pallas_trainable(q, k, v, w, b, g, h0, plan)
        return probe("pallas_tpu o", o), probe("pallas_tpu h_final", h_final)
