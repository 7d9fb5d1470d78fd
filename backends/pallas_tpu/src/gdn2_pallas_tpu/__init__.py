"""The pallas_tpu backend of gdn2: fused Pallas TPU kernels for the GDN-2 recurrence.

Modules (tokamax-like layout):

- ``plugin.py``: the entry point: the ``gdn2_backend`` and ``gdn2_kernel_costs`` hooks.
- ``backend.py``: ``PallasTpuBackend`` (name "pallas_tpu", priority 200): capabilities, supports(),
  platform guard, hybrid mode switch.
- ``config.py``: ``Plan`` (static blocking of one call), VMEM byte model, cost formulas
  (docs/algorithm.md section 9) used by every ``pl.CostEstimate`` and by the report rows.
- ``layout.py``: the HBM layouts the kernels index ((B, H, T, d) view or (B, T, H, d) in place with
  8 heads per grid step), BlockSpecs, per-head tile access.
- ``chunk_math.py``: in-kernel chunk math shared by both kernels: ``gamma_cum``, decay-safe scores
  (reference-row matmuls off the diagonal, pairwise masked diagonal blocks), blocked WY inverse
  ``T``, ``Y``, ``U``, score backward.
- ``kernels_fwd.py``: one forward ``pallas_call`` (``gdn2_fwd_fused``), grid (B, H/Hb, N), chunk
  axis last and "arbitrary", float32 state in VMEM scratch.
- ``kernels_bwd.py``: one backward ``pallas_call`` (``gdn2_bwd_fused``), chunks in reverse, dS in
  VMEM scratch, entry states recomputed per superchunk from the saved ones.
- ``vjp.py``: the ``jax.custom_vjp`` and its ``Residuals`` dataclass; the platform guard.
- ``hybrid.py``: ``KernelConfig(hybrid_forward=True)``: jax_ref forward + Pallas backward.
- ``report.py``: the kernels as report rows (``gdn2 tpu-report`` of gdn2-tools).
"""
