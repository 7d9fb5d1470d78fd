"""``gdn2 tpu-report``: per-kernel VMEM, compiled HBM, FLOPs, bytes and roofline for a TPU target.

Everything is compile-time analysis (no TPU run): VMEM from the byte model of config.py, FLOPs and
HBM bytes from the ``pl.CostEstimate`` formulas (ALGORITHM.md section 9), HBM buffers from
``compiled.memory_analysis()`` of a deviceless compile (libtpu), roofline from the peak numbers.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Final

PEAKS: Final = {  # bf16 matmul FLOP/s, HBM bytes/s
    "v5e": (197e12, 819e9),
    "v6e": (918e12, 1640e9),
}
TOPOLOGY: Final = {"v5e": "v5e:1x1", "v6e": "v6e:1x1"}
LABEL: Final = "compile-time analysis (no TPU run)"


def _mib(x: float) -> str:
    return f"{x / 2**20:9.2f} MiB"


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    from gdn2core import PRESETS

    p = argparse.ArgumentParser(prog="gdn2 tpu-report", description=__doc__.splitlines()[0])
    p.add_argument("--batch", "-B", type=int, default=8)
    p.add_argument("--seq-len", "-T", type=int, default=4096)
    p.add_argument("--heads", "-H", type=int, default=6)
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--tpu", choices=tuple(PEAKS), default="v5e")
    p.add_argument(
        "--config", choices=("default", *PRESETS), default="default", help="KernelConfig preset"
    )
    p.add_argument("--no-compile", action="store_true", help="skip the deviceless compile")
    return p.parse_args(list(argv))


def _roofline(flops: float, nbytes: float, tpu: str) -> tuple[float, float]:
    peak_flops, bw = PEAKS[tpu]
    return flops / peak_flops, nbytes / bw


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv or [])
    from gdn2_pallas_tpu import config as cfg
    from gdn2core import DEFAULT_CONFIG, PRESETS
    from gdn2core.spec import OpSpec

    config = DEFAULT_CONFIG if args.config == "default" else PRESETS[args.config]
    B, T, H, K, V = args.batch, args.seq_len, args.heads, args.dk, args.dv
    spec = OpSpec(B, T, H, K, V, args.dtype, K**-0.5, True)
    plan = cfg.make_plan(spec, config)
    s = plan.itemsize
    print(f"gdn2 tpu-report: {LABEL}")
    print(
        f"shape B={B} T={T} H={H} dk={K} dv={V} {args.dtype}; target {args.tpu} "
        f"({TOPOLOGY[args.tpu]}); config bt={config.bt} bc={config.bc} mb={config.mb}; "
        f"chunks N={plan.n_chunks} (T padded to {plan.t_pad}), saved state every "
        f"{plan.ckpt} chunk(s); layout {plan.layout!r}, {plan.hb} head(s) per grid step"
    )
    reason = cfg.check_vmem(spec, config)
    if reason:
        print(f"refused by supports(): {reason}")

    token_heads = B * H * T
    kernels = {
        "gdn2_fwd_fused (inference)": (
            cfg.vmem_bytes_fwd(plan.C, K, V, s, plan.hb),
            cfg.cost_fwd(plan, save_states=False),
            (4 * K + 3 * V) * s * token_heads + 2 * B * H * K * V * 4,
        ),
        "gdn2_fwd_fused (training, saves states)": (
            cfg.vmem_bytes_fwd(plan.C, K, V, s, plan.hb),
            cfg.cost_fwd(plan, save_states=True),
            (4 * K + 3 * V) * s * token_heads + 2 * B * H * K * V * 4,
        ),
        "gdn2_bwd_fused": (
            cfg.vmem_bytes_bwd(plan.C, K, V, s, plan.ckpt, plan.hb),
            cfg.cost_bwd(plan),
            (8 * K + 5 * V) * s * token_heads + 3 * B * H * K * V * 4,
        ),
    }
    grid = (B, H // plan.hb, plan.n_chunks)
    print(f"\nper kernel (grid (B, H / Hb, N) = {grid}; {LABEL})")
    for name, (vmem, cost, min_bytes) in kernels.items():
        t_c, t_m = _roofline(cost["flops"], cost["bytes_accessed"], args.tpu)
        t_min = min_bytes / PEAKS[args.tpu][1]
        bound = "compute" if t_c > t_m else "memory"
        print(f"  {name}")
        print(
            f"    VMEM/step   {_mib(vmem['total'])} (blocks {_mib(vmem['blocks']).strip()}, "
            f"scratch {_mib(vmem['scratch']).strip()}, live {_mib(vmem['live']).strip()}) "
            f"of {cfg.VMEM_LIMIT_BYTES / 2**20:.0f} MiB scoped limit"
        )
        print(
            f"    FLOPs       {cost['flops'] / 1e9:10.2f} G   exp {cost['transcendentals'] / 1e9:.3f} G"
        )
        print(
            f"    HBM bytes   {cost['bytes_accessed'] / 1e6:10.1f} MB  (section 9 minimum "
            f"{min_bytes / 1e6:.1f} MB)"
        )
        print(
            f"    roofline    compute {t_c * 1e3:.3f} ms, memory {t_m * 1e3:.3f} ms -> "
            f"{bound}-bound >= {max(t_c, t_m) * 1e3:.3f} ms (minimum-bytes bound "
            f"{t_min * 1e3:.3f} ms)"
        )
    print(
        "    note: the roofline assumes bf16-rate matmuls; the kernels run float32 matmuls at "
        "HIGHEST precision (multi-pass on the MXU), so the compute bound is optimistic."
    )

    if args.no_compile:
        return 0
    try:
        import libtpu  # noqa: F401
    except ImportError:
        print("\ncompiled HBM: skipped (libtpu not installed)")
        return 0
    from gdn2_pallas_tpu.tpu_compile import compile_for_tpu

    print(
        f"\ncompiled HBM (memory_analysis of a deviceless compile for {TOPOLOGY[args.tpu]}; "
        f"{LABEL})"
    )
    for mode in ("forward", "train"):
        try:
            compiled = compile_for_tpu(TOPOLOGY[args.tpu], mode, B, T, H, K, V, args.dtype, config)
        except Exception as err:  # report, do not crash: the rest of the report stands
            print(f"  {mode}: compile failed: {type(err).__name__}: {str(err)[:300]}")
            continue
        m = compiled.memory_analysis()
        what = "forward" if mode == "forward" else "value_and_grad (train step)"
        print(
            f"  {what}: arguments {_mib(m.argument_size_in_bytes).strip()}, outputs "
            f"{_mib(m.output_size_in_bytes).strip()}, temp {_mib(m.temp_size_in_bytes).strip()}, "
            f"code {_mib(m.generated_code_size_in_bytes).strip()}; "
            f"tpu_custom_call: {'tpu_custom_call' in compiled.as_text()}"
        )
    return 0
