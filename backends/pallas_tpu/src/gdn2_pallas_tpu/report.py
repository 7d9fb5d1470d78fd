"""The pallas_tpu kernels as report rows (the ``gdn2_kernel_costs`` hook, shown by
``gdn2 tpu-report``): per kernel, the VMEM byte model of one grid step, and the FLOPs,
transcendentals and HBM bytes of its ``pl.CostEstimate`` (config.py), next to the minimum HBM
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
    from gdn2_pallas_tpu import config as cfg

    plan = cfg.make_plan(spec, config)
    K, V, s = spec.dk, spec.dv, plan.itemsize
    token_heads = spec.batch * spec.heads * spec.seq_len
    state = spec.batch * spec.heads * K * V * 4
    notes = (
        f"grid (B, H / Hb, N) = {(spec.batch, spec.heads // plan.hb, plan.n_chunks)}; chunks "
        f"N={plan.n_chunks} (T padded to {plan.t_pad}), saved state every {plan.ckpt} chunk(s); "
        f"layout {plan.layout!r}, {plan.hb} head(s) per grid step"
    )
    fwd_vmem = cfg.vmem_bytes_fwd(plan.C, K, V, s, plan.hb)
    fwd_min = (4 * K + 3 * V) * s * token_heads + 2 * state
    bwd_vmem = cfg.vmem_bytes_bwd(plan.C, K, V, s, plan.ckpt, plan.hb)
    bwd_min = (8 * K + 5 * V) * s * token_heads + 3 * state
    kernels = (
        ("gdn2_fwd_fused (inference)", cfg.cost_fwd(plan, save_states=False), fwd_min, fwd_vmem),
        (
            "gdn2_fwd_fused (training, saves states)",
            cfg.cost_fwd(plan, save_states=True),
            fwd_min,
            fwd_vmem,
        ),
        ("gdn2_bwd_fused", cfg.cost_bwd(plan), bwd_min, bwd_vmem),
    )
    return [
        KernelCost(
            name,
            flops=cost["flops"],
            transcendentals=cost["transcendentals"],
            bytes_accessed=cost["bytes_accessed"],
            min_bytes_accessed=minimum,
            vmem_bytes=vmem,
            vmem_limit_bytes=cfg.VMEM_LIMIT_BYTES,
            notes=notes,
        )
        for name, cost, minimum, vmem in kernels
    ]
