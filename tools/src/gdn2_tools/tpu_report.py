"""``gdn2 tpu-report``: per-kernel VMEM, FLOPs, HBM bytes and roofline of a backend for a TPU
target, and the compiled HBM of its forward and train step.

Everything is compile-time analysis (no TPU run). ``--estimate`` adds TPU time from the compiler's
static cycle estimate (gdn2_tools.tpu_estimate), ``--table`` writes the table of them in docs/results.md.
The per-kernel rows come from the backend's own
``gdn2_kernel_costs`` hook (a backend without one reports only the compiled HBM); the roofline
divides them by the generation's peak numbers; the compiled HBM is ``memory_analysis()`` of a
deviceless compile (libtpu). The default backend is the one ``backend="auto"`` picks for a TPU.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Sequence
from typing import Final

from gdn2_tools.preflight import missing
from gdn2_tools.static_profile import preset
from gdn2_tools.tpu import TOPOLOGIES
from gdn2_tools.tpu_estimate import (
    PEAKS,
    TABLE_DTYPES,
    TABLE_SHAPES,
    TABLE_TPUS,
    table_names_problem,
)

LABEL: Final = "compile-time analysis (no TPU run)"


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f} MiB"


def _parser() -> argparse.ArgumentParser:
    """The arguments of ``gdn2 tpu-report``; each help text says its default."""
    from gdn2core import PRESETS

    summary = " ".join(__doc__.split("\n\n")[0].split())  # the whole first paragraph
    p = argparse.ArgumentParser(prog="gdn2 tpu-report", description=summary)
    p.add_argument(
        "--backend", default=None, help="backend name (default: the one auto picks on a TPU)"
    )
    p.add_argument("--batch", "-B", type=int, default=8, help="batch B (default %(default)s)")
    p.add_argument(
        "--seq-len", "-T", type=int, default=4096, help="sequence length T (default %(default)s)"
    )
    p.add_argument("--heads", "-H", type=int, default=6, help="heads H (default %(default)s)")
    p.add_argument("--dk", type=int, default=128, help="key head size (default %(default)s)")
    p.add_argument("--dv", type=int, default=128, help="value head size (default %(default)s)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="bfloat16",
        help="input dtype (default %(default)s)",
    )
    p.add_argument(
        "--tpu", choices=tuple(PEAKS), default="v5e", help="TPU generation (default %(default)s)"
    )
    p.add_argument(
        "--config",
        choices=("default", *PRESETS),
        default="default",
        help="KernelConfig preset (default: %(default)s, i.e. DEFAULT_CONFIG)",
    )
    p.add_argument("--no-compile", action="store_true", help="skip the deviceless compile")
    p.add_argument(
        "--estimate",
        action="store_true",
        help="TPU time from the compiler's static cycle estimate: the backend's kernels and jax_ref "
        "for the same TPU, train step, forward and forward with chunk states, against the "
        "roofline; each kernel with its fit's residual (minutes)",
    )
    p.add_argument(
        "--value-heads",
        type=int,
        default=0,
        help="with --estimate: grouped value heads HV (v, w, the state; b, g on the key heads; "
        "default 0: HV = H)",
    )
    p.add_argument(
        "--value-gates",
        action="store_true",
        help="with --value-heads: b and g on the value heads too (Qwen3-Next's beta and decay)",
    )
    p.add_argument(
        "--segment-ids",
        action="store_true",
        help="with --estimate: the calls take segment_ids (packed sequences; compare with a run "
        "without it for their cost)",
    )
    p.add_argument(
        "--gate",
        default="",
        help="with --estimate: a gate fused in the op, 'softplus' or a lower bound in [-5, 0) "
        "such as -5 (the lower-bound gate, whose bounded decays take pallas_tpu's merged-levels "
        "path); default: none",
    )
    p.add_argument(
        "--gates",
        default="",
        choices=("", "kda", "gdn", "kda-broadcast", "gdn-broadcast"),
        help="with --estimate: the scalar gates of a family op, one value per head and token: "
        "'kda' (beta as b and w, chunk_kda) or 'gdn' (beta and the decay, "
        "chunk_gated_delta_rule), each also broadcast in XLA before the op for comparison; "
        "'...-broadcast' only that; default: GDN-2's per-channel gates",
    )
    p.add_argument(
        "--g-dtype",
        default="",
        choices=("", "float32"),
        help="with --estimate and --dtype bfloat16: g in float32 (fla's layers compute the log "
        "decay in float32; the op keeps it so); default: g in the inputs' dtype",
    )
    p.add_argument(
        "--table",
        metavar="OUT.md",
        help="write the table of estimates of docs/results.md (train and long shapes, v5e and v6e, bf16 and "
        "f32; tens of minutes); see gdn2_tools.tpu_estimate",
    )
    p.add_argument(
        "--shapes",
        default=",".join(TABLE_SHAPES),
        help="with --table: its shapes, comma-separated, of "
        f"{', '.join(f'{n} (B, T, H, dk, dv = {v})' for n, v in TABLE_SHAPES.items())} "
        "(default %(default)s)",
    )
    p.add_argument(
        "--tpus",
        default=",".join(TABLE_TPUS),
        help=f"with --table: its TPUs, comma-separated, of {', '.join(PEAKS)} (default %(default)s)",
    )
    p.add_argument(
        "--dtypes",
        default=",".join(TABLE_DTYPES),
        help=f"with --table: its input dtypes, comma-separated, of {', '.join(TABLE_DTYPES)} "
        "(default %(default)s)",
    )
    return p


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(list(argv))
    if (args.segment_ids or args.value_heads or args.gate or args.gates or args.g_dtype) and (
        not args.estimate
    ):
        p.error("--segment-ids, --value-heads, --gate, --gates and --g-dtype apply to --estimate "
                "only")  # fmt: skip
    table_options = ("shapes", "tpus", "dtypes")
    if not args.table and any(getattr(args, n) != p.get_default(n) for n in table_options):
        p.error("--shapes, --tpus and --dtypes apply to --table only")
    problem = table_names_problem(args.shapes, args.tpus, args.dtypes)
    if problem:
        p.error(problem)
    if args.g_dtype and args.dtype != "bfloat16":
        p.error(f"--g-dtype float32: expected --dtype bfloat16, got {args.dtype}")
    if args.value_gates and args.value_heads in (0, args.heads):
        p.error(f"--value-gates: expected --value-heads other than -H {args.heads}, got "
                f"{args.value_heads}")  # fmt: skip
    if args.gate not in ("", "softplus"):
        try:
            bound = float(args.gate)
        except ValueError:
            bound = None
        if bound is None or not -5.0 <= bound < 0.0:
            p.error(f"--gate: expected 'softplus' or a lower bound in [-5, 0), got {args.gate!r}")
    return args


def planned_for(tpu: str) -> contextlib.AbstractContextManager:
    """A context in which a backend plans for the chip ``tpu`` (its VMEM, its TensorCores per
    device): the abstract mesh of its topology, as a traced call sees on that chip. Without
    libtpu (``--no-compile`` runs without it) none: the plans are then the host's."""
    if missing("libtpu", extra="tpu", why="the target's description"):
        return contextlib.nullcontext()
    import jax

    from gdn2_tools.tpu import topology_mesh

    return jax.sharding.use_abstract_mesh(topology_mesh(TOPOLOGIES[tpu]).abstract_mesh)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gdn2 tpu-report``.

    Args:
        argv: the arguments after ``gdn2 tpu-report``.

    Returns:
        0, or 2 when no backend would run the call on a TPU or libtpu is missing for the compile.
    """
    argv = list(argv or [])
    args = _parse(argv)
    if args.table or args.estimate:
        problem = missing("libtpu", extra="tpu", why="gdn2 tpu-report --estimate")
        if problem:
            print(f"gdn2 tpu-report: {problem}")
            return 2
        from gdn2_tools import tpu_estimate

        if args.table:
            return tpu_estimate.table_main(
                ["--table", args.table, "--shapes", args.shapes, "--tpus", args.tpus,
                 "--dtypes", args.dtypes, "--config", args.config]
            )  # fmt: skip
        return tpu_estimate.estimate_main(args, preset(args.config))
    if not args.no_compile:
        problem = missing("libtpu", extra="tpu", why="gdn2 tpu-report (compiled HBM)")
        if problem:
            print(f"gdn2 tpu-report: {problem}; --no-compile skips that part")
            return 2
    from gdn2_tools.tpu import compile_op
    from gdn2core.ops.forward.spec import OpSpec
    from gdn2core.registry import BackendNotFoundError, get_backend, plugin_hook
    from gdn2core.selection import resolve_backend
    from gdn2core.verdict import judge

    config = preset(args.config)
    B, T, H, K, V = args.batch, args.seq_len, args.heads, args.dk, args.dv
    spec = OpSpec(B, T, H, K, V, args.dtype, K**-0.5)
    try:
        if args.backend is None:
            backend = resolve_backend(spec, config, "auto", trainable=True, platform="tpu")
        else:
            backend = get_backend(args.backend)
    except BackendNotFoundError as err:
        print(f"gdn2 tpu-report: {err}")
        return 2
    name = backend.name
    print(f"gdn2 tpu-report: {LABEL}")
    print(
        f"backend {name}; shape B={B} T={T} H={H} dk={K} dv={V} {args.dtype}; target {args.tpu} "
        f"({TOPOLOGIES[args.tpu]}); config {config!r}"
    )
    with planned_for(args.tpu):  # the backend's plans see the target's VMEM and cores
        answer = judge(backend, spec, config, trainable=True, auto=False, platform="tpu")
        rows = [
            r
            for found in plugin_hook(name, "gdn2_kernel_costs", spec=spec, config=config)
            for r in found
        ]
    if not answer:
        print(f"would not run on a TPU: {answer.reason}")
    peak_flops, bandwidth = PEAKS[args.tpu]
    if rows:
        print(f"\nper kernel ({LABEL})")
    else:
        print(f"\n{name} reports no per-kernel rows (no gdn2_kernel_costs hook for this call)")
    for row in rows:
        t_c, t_m = row.flops / peak_flops, row.bytes_accessed / bandwidth
        bound = "compute" if t_c > t_m else "memory"
        print(f"  {row.name}")
        if row.notes:
            print(f"    {row.notes}")
        if row.vmem_bytes:
            parts = ", ".join(f"{k} {_mib(v)}" for k, v in row.vmem_bytes.items() if k != "total")
            limit = f" of {_mib(row.vmem_limit_bytes)} limit" if row.vmem_limit_bytes else ""
            print(f"    VMEM/step   {_mib(row.vmem_bytes.get('total', 0))} ({parts}){limit}")
        print(f"    FLOPs       {row.flops / 1e9:10.2f} G   exp {row.transcendentals / 1e9:.3f} G")
        minimum = ""
        if row.min_bytes_accessed:
            minimum = f"  (minimum {row.min_bytes_accessed / 1e6:.1f} MB)"
        print(f"    HBM bytes   {row.bytes_accessed / 1e6:10.1f} MB{minimum}")
        line = (
            f"    roofline    compute {t_c * 1e3:.3f} ms, memory {t_m * 1e3:.3f} ms -> "
            f"{bound}-bound >= {max(t_c, t_m) * 1e3:.3f} ms"
        )
        if row.min_bytes_accessed:
            line += f" (minimum-bytes bound {row.min_bytes_accessed / bandwidth * 1e3:.3f} ms)"
        print(line)
    if rows:
        print("    note: the roofline assumes bf16-rate matmuls on the MXU.")
    if args.no_compile:
        return 0
    topology = TOPOLOGIES[args.tpu]
    print(f"\ncompiled HBM (memory_analysis of a deviceless compile for {topology}; {LABEL})")
    for mode in ("forward", "train"):
        try:
            compiled = compile_op(name, topology, mode, B, T, H, K, V, args.dtype, config)
        except Exception as err:  # report, do not crash: the rest of the report stands
            print(f"  {mode}: compile failed: {type(err).__name__}: {str(err)[:300]}")
            continue
        m = compiled.memory_analysis()
        what = "forward" if mode == "forward" else "value_and_grad (train step)"
        print(
            f"  {what}: arguments {_mib(m.argument_size_in_bytes)}, outputs "
            f"{_mib(m.output_size_in_bytes)}, temp {_mib(m.temp_size_in_bytes)}, "
            f"code {_mib(m.generated_code_size_in_bytes)}; "
            f"tpu_custom_call: {'tpu_custom_call' in compiled.as_text()}"
        )
    return 0
