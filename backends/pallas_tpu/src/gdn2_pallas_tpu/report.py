"""The pallas_tpu kernels as report rows (the ``gdn2_kernel_costs`` hook, shown by
``gdn2 tpu-report``): per kernel, the VMEM byte model of one grid step, and the FLOPs,
transcendentals and HBM bytes of its ``pl.CostEstimate`` (cost.py), next to the minimum HBM
bytes of the operator (docs/algorithm.md section 9)."""

from __future__ import annotations

from gdn2core.plugin import KernelConfig, KernelCost, OpSpec


def kernel_costs(spec: OpSpec, config: KernelConfig) -> list[KernelCost]:
    """The rows of one call: the inference forward, the training forward and the backward.

    Args:
        spec: the call.
        config: its kernel config.

    Returns:
        One :class:`~gdn2core.plugin.KernelCost` per kernel.
    """
    from gdn2_pallas_tpu import cost
    from gdn2_pallas_tpu.plan import F32_BYTES, make_plan, vmem_bytes

    plan = make_plan(spec, config)
    train = make_plan(spec, config, training=True)  # the training forward's and the backward's
    K, V, s = spec.dk, spec.dv, plan.itemsize
    token_heads = spec.batch * spec.heads * spec.seq_len
    state = spec.batch * spec.heads * K * V * F32_BYTES

    def notes(p) -> str:
        return (
            f"grid (B, H / hb, steps) = {p.grid()}; {p.hb} head(s) x {p.nc} chunk(s) of "
            f"{p.C} tokens per step (T padded to {p.t_pad}); MXU {p.precisions}"
        )

    fwd_min = (4 * K + 3 * V) * s * token_heads + 2 * state
    bwd_min = (8 * K + 5 * V) * s * token_heads + 3 * state
    kernels = (
        ("gdn2_fwd (inference)", plan, cost.cost_forward(plan, False), fwd_min, vmem_bytes(plan, False)),
        ("gdn2_fwd_train (saves residuals)", train, cost.cost_forward(train, True), fwd_min, vmem_bytes(train, False)),
        ("gdn2_bwd", train, cost.cost_backward(train), bwd_min, vmem_bytes(train, True)),
    )  # fmt: skip
    return [
        KernelCost(
            name,
            flops=c["flops"],
            transcendentals=c["transcendentals"],
            bytes_accessed=c["bytes_accessed"],
            min_bytes_accessed=minimum,
            vmem_bytes=vmem,
            vmem_limit_bytes=p.vmem_limit_bytes,
            notes=notes(p),
        )
        for name, p, c, minimum, vmem in kernels
    ]
