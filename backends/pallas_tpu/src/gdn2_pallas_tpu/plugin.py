"""Entry point of the ``gdn2.backends`` group: this package's backend, and its kernels as report
rows (``gdn2 tpu-report``)."""

from gdn2core.plugin import KernelConfig, KernelCost, OpSpec, hookimpl


@hookimpl
def gdn2_backend():
    """The pallas_tpu backend."""
    from gdn2_pallas_tpu.backend import PallasTpuBackend

    return PallasTpuBackend()


@hookimpl
def gdn2_kernel_costs(spec: OpSpec, config: KernelConfig) -> list[KernelCost]:
    """One row per kernel of a call (see report.py)."""
    from gdn2_pallas_tpu.report import kernel_costs

    return kernel_costs(spec, config)
