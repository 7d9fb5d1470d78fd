"""The pallas_tpu backend of gdn2: fused Pallas TPU kernels for the GDN-2 recurrence.

Modules (per job, as in tokamax):

- ``plugin.py``: the entry point: the ``gdn2_backend`` and ``gdn2_kernel_costs`` hooks.
- ``backend.py``: ``PallasTpuBackend`` (name "pallas_tpu", priority 200): capabilities,
  supports(), platform guard.
- ``config.py``: ``PallasTpuConfig``, the backend's own config class (the core fields and the
  knobs of interpret mode: race detection, simulated cores, grid order).
- ``plan.py``: ``Plan``, the static description of one call: blocking (heads and chunks per grid
  step), the MXU precision of each group of products, the VMEM byte model.
- ``matmul.py``: products at an explicit MXU precision (bf16, bf16x3, f32).
- ``chunk_math.py``: in-kernel math of a batch of chunks: decay levels, scores and WY inverse by
  levels, the score backward.
- ``blocks.py``: layouts, index maps, BlockSpecs, the per-head output DMAs.
- ``kernels_fwd.py``: the forward ``pallas_call`` (``gdn2_fwd``, ``gdn2_fwd_train``).
- ``kernels_bwd.py``: the backward ``pallas_call`` (``gdn2_bwd``).
- ``cost.py``: FLOPs and bytes of each call (``pl.CostEstimate``, report rows).
- ``vjp.py``: the ``jax.custom_vjp``, its ``Residuals`` dataclass, vmap folding, platform guard.
- ``report.py``: the kernels as report rows (``gdn2 tpu-report`` of gdn2-tools).
"""

from gdn2_pallas_tpu.config import PallasTpuConfig

__all__ = ["PallasTpuConfig"]
