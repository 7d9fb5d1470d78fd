"""``gdn2 tpu-report --estimate``: TPU time of the train step, the forward and the forward with
chunk states (``return_chunk_states=True``), per kernel, from the TPU compiler's static cycle
estimate (:mod:`gdn2_tools.static_profile`), next to the roofline of the operator and to the
pure-JAX chunked backend compiled by XLA for the same TPU.

The Pallas kernels are simulated at :data:`FIT_POINTS` (at B=2 for an even batch on a chip of two
TensorCores, :func:`fit_points`) and extrapolated linearly in ``B * T``;
each kernel's line prints its fit's points and largest relative residual, and a row whose fit has
fewer than three points or a residual above :data:`MAX_FIT_RESIDUAL` is flagged (exit status 1).
Each kernel's line also prints its program's length in bundles (the compiler's schedule of one
grid step, dumped at the middle fit point), and a kernel whose program is longer than
:data:`~gdn2_tools.static_profile.LONGEST_FAST_PROGRAM` flags its row too: on a TPU v5e such
programs ran 2.2x to 2.4x their estimate, a cost the profile does not price.

Every figure here is a compiler estimate, not a measurement (no TPU is used); on real kernels it
has been about 1.3x optimistic, so compare ratios. The roofline is docs/algorithm.md section 9:
per pass, the larger of its minimum FLOPs at the bf16 MXU rate and its minimum HBM bytes (inputs
and outputs once; with chunk states, the float32 state of every chunk too) at the HBM rate; the
train step is forward plus backward.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from typing import Final

from gdn2_tools.chips import CHIPS
from gdn2_tools.static_profile import (
    LABEL,
    LONGEST_FAST_PROGRAM,
    Estimate,
    Program,
    estimate,
    estimate_fit,
    preset,
)
from gdn2_tools.tpu import SCALAR_GATES

#: bf16 matmul FLOP/s and HBM bytes/s per chip (chips.py).
PEAKS: Final = {name: (chip.peak_flops, chip.hbm_bytes_per_s) for name, chip in CHIPS.items()}
#: Small (B, T) shapes at which the Pallas kernels are simulated, then extrapolated in B * T:
#: three, so that the residual of the line tests something (two points fit any line exactly).
FIT_POINTS: Final = ((1, 512), (1, 1024), (1, 2048))
#: Largest relative residual of a kernel's fit a trustworthy row may have.
MAX_FIT_RESIDUAL: Final = 0.02
#: The modes of ``--estimate``: the train step, the forward, and the forward with
#: ``return_chunk_states=True`` (for the backends that declare chunk states).
MODES: Final = ("train", "forward", "chunk-states")
#: Backends whose kernels the profiler simulates directly at the requested shape (no Pallas
#: kernels: XLA ops only).
XLA_ONLY: Final = ("jax_ref",)


def roofline_ms(program: Program, tpu: str, C: int) -> float:
    """Lower bound of ``program`` on ``tpu`` (module docstring), in milliseconds. With grouped
    value heads, that of the plain call on the value heads (the key side shared by a group can
    make the grouped call faster than it)."""
    flops_peak, bandwidth = PEAKS[tpu]
    K, V, s = program.dk, program.dv, 4 if program.dtype == "float32" else 2
    heads = program.value_heads or program.H
    tokens = program.B * program.T * heads
    states = program.B * heads * K * V * 4
    fwd_flops = 6 * C * K + 4 * C * V + C * C / 3 + 6 * K * V
    bwd_flops = 12 * C * K + 8 * C * V + 12 * K * V + 6 * C * K + 2 * C * V + C * C / 3 + 4 * K * V
    # a scalar gate moves one value per head and token, not K or V (its gradient likewise)
    scalar = sum({"w": V, "b": K, "g": K}[n] - 1 for n in SCALAR_GATES[program.gates])
    # a float32 g beside bfloat16 inputs: its values (and dg's) 2 bytes wider
    g_values = 1 if "g" in SCALAR_GATES[program.gates] else K
    wide_g = g_values * (4 - s) if program.decay_dtype == "float32" else 0
    fwd_bytes = tokens * ((4 * K + 3 * V - scalar) * s + wide_g) + 2 * states
    if program.mode == "chunk-states":  # and the float32 state entering every chunk
        fwd_bytes += -(-program.T // C) * states
    fwd = max(tokens * fwd_flops / flops_peak, fwd_bytes / bandwidth)
    if program.mode in ("forward", "chunk-states"):
        return fwd * 1e3
    bwd = max(
        tokens * bwd_flops / flops_peak,
        (tokens * ((8 * K + 5 * V - 2 * scalar) * s + 2 * wide_g) + 3 * states) / bandwidth,
    )
    return (fwd + bwd) * 1e3


def fit_points(batch: int, tpu: str) -> tuple[tuple[int, int], ...]:
    """:data:`FIT_POINTS` at a batch planned as ``batch`` is on ``tpu``: on a chip of two
    TensorCores the kernels' plans give both cores as many grid points (heads per step depend on
    the batch's parity: B=1 H=6 takes 3 heads a step, B=2 or 8 all 6), so the small shapes take
    B=1 for an odd batch and B=2 for an even one; B=1 on a chip of one core."""
    cores = CHIPS[tpu].tensor_cores
    b = (batch - 1) % cores + 1
    return tuple((b, t) for _, t in FIT_POINTS)


def run(program: Program, tpu: str, points=None) -> Estimate:
    """The estimate of one program (Pallas kernels fitted from small shapes: ``points``, else
    :func:`fit_points`)."""
    if program.backend in XLA_ONLY:
        return estimate(program, tpu)
    return estimate_fit(program, tpu, points or fit_points(program.B, tpu))


@dataclasses.dataclass
class Row:
    program: Program
    tpu: str
    ms: float
    roofline_ms: float
    trustworthy: bool
    temp_mib: float | None
    kernels: dict[str, float]  # kernel name -> ms
    notes: list[str]
    fits: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)  # kernel name ->
    #   (fit points, largest relative residual)
    kernel_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # kernel name -> HBM
    #   bytes (its CostEstimate)
    hbm_bytes: int = 0  # the whole program's: every op's operands and results (XLA ops) or its
    #   CostEstimate (kernels), times its runs
    bundles: dict[str, int] = dataclasses.field(default_factory=dict)  # kernel name -> its
    #   program's length in the compiler's schedule (at the middle fit point)


def row_of(program: Program, tpu: str, C: int) -> Row:
    """The estimate of ``program`` as a row. What the profiler prices at 0 is priced by its HBM
    bytes at the chip's bandwidth and added: XLA ops with remote DMAs, and a kernel whose bytes
    take longer than its profile (strided DMAs, priced 0; v6e, where HBM is not modelled)."""
    e = run(program, tpu)
    bandwidth = PEAKS[tpu][1]
    notes = []
    if e.error:
        notes.append(f"error: {e.error[:200]}")
    if e.unprofiled:
        notes.append(f"unprofiled (counted 0): {sorted(e.unprofiled)}")
    added_ms = 0.0
    if e.unmodelled:  # one note per row: how many ops the profiler prices at 0, and their bytes
        priced = sum(e.op_bytes.get(op.name, 0) * op.times for op in e.unmodelled)
        added_ms += priced / bandwidth * 1e3
        largest = max(e.unmodelled, key=lambda op: e.op_bytes.get(op.name, 0) * op.times)
        notes.append(
            f"{len(e.unmodelled)} XLA op(s) priced 0 by the profiler (remote DMA), priced here by "
            f"their HBM bytes: {priced / 1e6:.1f} MB, {priced / bandwidth * 1e3:.3f} ms at "
            f"{bandwidth / 1e9:.0f} GB/s, added (largest {largest.name}: "
            f"{e.op_bytes.get(largest.name, 0) * largest.times / 1e6:.1f} MB; XLA's cost model: "
            f"{e.ms(sum(op.cost_model_cycles for op in e.unmodelled)):.3f} ms in all)"
        )
    fits = {op.name: (len(op.fit["points"]), op.fit["max_rel_residual"]) for op in e.ops if op.fit}
    bad_fits = [name for name, (n, resid) in fits.items() if n < 3 or resid > MAX_FIT_RESIDUAL]
    for name in bad_fits:
        n, resid = fits[name]
        notes.append(f"{name}: fit of {n} points, residual {100 * resid:.2f}% (a trustworthy fit: "
                     f">= 3 points, <= {100 * MAX_FIT_RESIDUAL:.0f}%)")  # fmt: skip
    kernels, kernel_bytes = {}, {}
    for op in (op for op in e.ops if op.kernel):
        profile_ms = e.ms(op.total)
        kernel_bytes[op.name] = e.op_bytes.get(op.name, 0) * op.times
        floor_ms = kernel_bytes[op.name] / bandwidth * 1e3
        kernels[op.name] = max(profile_ms, floor_ms)
        if floor_ms > profile_ms:
            added_ms += floor_ms - profile_ms
            notes.append(
                f"kernel {op.name}: its HBM bytes take {floor_ms:.3f} ms at {bandwidth / 1e9:.0f} "
                f"GB/s, more than its profile's {profile_ms:.3f} ms: counted at its bytes"
            )
    bundles = {op.name: op.bundles for op in e.ops if op.kernel and op.bundles}
    long_programs = [name for name, n in bundles.items() if n > LONGEST_FAST_PROGRAM]
    for name in long_programs:
        notes.append(
            f"kernel {name}: its program is {bundles[name]:,} bundles, longer than any a TPU v5e "
            f"ran at its estimate's speed ({LONGEST_FAST_PROGRAM:,}; from 69,237 they ran 2.2x to "
            "2.4x as long): the profile does not price that, this kernel may take twice its "
            "estimate"
        )
    if program.value_heads and program.value_heads != program.H:
        notes.append(f"roofline: the plain call on {program.value_heads} heads (no sharing)")
    temp = e.temp_bytes / 2**20 if e.temp_bytes is not None else None
    total_bytes = sum(e.op_bytes.get(op.name, 0) * op.times for op in e.ops)
    return Row(
        program, tpu, e.ms() + added_ms, roofline_ms(program, tpu, C),
        e.trustworthy and not bad_fits and not long_programs, temp, kernels, notes, fits,
        kernel_bytes, total_bytes, bundles,
    )  # fmt: skip


def print_row(row: Row, reference: Row | None = None, forward: Row | None = None) -> None:
    """One row; ``reference``: jax_ref's row of the same mode; ``forward``: the backend's forward
    row (for the chunk-states mode)."""
    p = row.program
    gates = ""
    if p.gates:
        how = " broadcast in XLA before the op" if p.gates.endswith("-broadcast") else ""
        gates = f" [{p.gates.split('-')[0].upper()}'s scalar gates{how}]"
    print(
        f"  {p.backend} {p.mode}{gates}: {row.ms:.3f} ms estimated "
        f"({row.ms / row.roofline_ms:.1f}x the roofline {row.roofline_ms:.3f} ms)"
        + (
            f"; {reference.ms / row.ms:.1f}x faster than {reference.program.backend}"
            if reference
            else ""
        )
        + (f"; {row.ms / forward.ms:.3f}x its forward" if forward else "")
        + (f"; temp HBM {row.temp_mib:.1f} MiB" if row.temp_mib is not None else "")
        + (f"; HBM {row.hbm_bytes / 1e6:.1f} MB in all" if row.hbm_bytes else "")
    )
    bandwidth = PEAKS[row.tpu][1]
    for name, ms in sorted(row.kernels.items(), key=lambda kv: -kv[1]):
        fit = row.fits.get(name)
        how = f"; fit of {fit[0]} points, residual {100 * fit[1]:.2f}%" if fit else ""
        how += f"; program {row.bundles[name]:,} bundles" if name in row.bundles else ""
        hbm = row.kernel_bytes.get(name, 0)
        print(f"    kernel {name}: {ms:.3f} ms; HBM {hbm / 1e6:.1f} MB ({hbm / bandwidth * 1e3:.3f} ms "
              f"at {bandwidth / 1e9:.0f} GB/s){how}")  # fmt: skip
    for note in row.notes:
        print(f"    note: {note}")
    if not row.trustworthy:
        print(
            "    WARNING: part of this program was not profiled or not modelled, a kernel's "
            "fit is poor or its program longer than any measured at its estimate's speed (notes "
            "above)"
        )


def estimate_main(args, config) -> int:
    """One shape, one generation: the Pallas backend (or ``--backend``) and jax_ref, train step,
    forward and, for the backends that declare chunk states, the forward with
    ``return_chunk_states=True``. With ``--gates kda|gdn``, also the backend on the same gates
    broadcast in XLA (what a backend that takes only full gates costs)."""
    from gdn2core import get_backend

    print(f"gdn2 tpu-report --estimate: {LABEL}")
    backends = [args.backend or "pallas_tpu", *(b for b in XLA_ONLY if b != args.backend)]
    rows = {}
    for mode in MODES:
        chosen = [
            name for name in backends
            if mode != "chunk-states"
            or (get_backend(name).capabilities.chunk_states and not args.segment_ids)
        ]  # fmt: skip
        variants = [(name, args.gates) for name in chosen]
        if args.gates and not args.gates.endswith("-broadcast"):  # the same, broadcast in XLA
            variants.insert(1, (chosen[0], args.gates + "-broadcast"))
        for name, gates in variants:
            program = Program(name, mode, args.batch, args.seq_len, args.heads, args.dk, args.dv,
                              args.dtype, args.config, value_heads=args.value_heads,
                              value_gates=args.value_gates,
                              segments=args.segment_ids, gate=args.gate,
                              gates=gates, decay_dtype=args.g_dtype)  # fmt: skip
            rows[name, gates, mode] = row_of(program, args.tpu, config.bt)
        packed = (
            (f", HV={args.value_heads}" if args.value_heads else "")
            + (" (b, g on the value heads)" if args.value_gates else "")
            + (", segment_ids" if args.segment_ids else "")
            + (f", gate {args.gate}" if args.gate else "")
            + (f", scalar gates as {args.gates.upper()}" if args.gates else "")
            + (f", g {args.g_dtype}" if args.g_dtype else "")
        )
        print(f"\n{mode} (B={args.batch} T={args.seq_len} H={args.heads} dk={args.dk} dv={args.dv} "
              f"{args.dtype}, {args.tpu}{packed})")  # fmt: skip
        ref = rows.get((XLA_ONLY[0], args.gates, mode))
        for name, gates in variants:
            fwd = rows[name, gates, "forward"] if mode == "chunk-states" else None
            print_row(rows[name, gates, mode], ref if name not in XLA_ONLY else None, fwd)
    return 0 if all(r.trustworthy for r in rows.values()) else 1


#: The shapes of the table in docs/results.md: the train shape of the performance target, and a long, wide one.
TABLE_SHAPES: Final = {"train": (8, 4096, 6, 128, 128), "long": (1, 32768, 16, 128, 128)}


#: The TPUs and input dtypes of the table's rows by default.
TABLE_TPUS: Final = ("v5e", "v6e")
TABLE_DTYPES: Final = ("bfloat16", "float32")


def table_names_problem(shapes: str, tpus: str, dtypes: str) -> str | None:
    """What is wrong with the table's comma-separated ``--shapes``, ``--tpus`` and ``--dtypes``,
    or None."""
    options = (("--shapes", shapes, TABLE_SHAPES), ("--tpus", tpus, PEAKS),
               ("--dtypes", dtypes, TABLE_DTYPES))  # fmt: skip
    for option, value, known in options:
        unknown = [x for x in value.split(",") if x not in known]
        if unknown:
            return f"{option}: expected names of {', '.join(known)}, got {unknown}"
    return None


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def table_main(argv: Sequence[str]) -> int:
    """``gdn2 tpu-report --table OUT.md [--json OUT.json] [--shapes ...] [--tpus ...]
    [--dtypes ...] [--config PRESET]``: the table of docs/results.md (every row a compiler
    estimate): pallas_tpu and jax_ref, train step and forward, per shape, generation and dtype,
    with pallas_tpu's compiled temp HBM; both backends at the preset's chunk length (default:
    DEFAULT_CONFIG; another one is named in the shape column)."""
    import argparse

    from gdn2core import PRESETS

    p = argparse.ArgumentParser(prog="gdn2 tpu-report --table")
    p.add_argument("--table", required=True, help="markdown output file")
    p.add_argument("--json", help="raw rows")
    p.add_argument("--tpus", default=",".join(TABLE_TPUS))
    p.add_argument("--dtypes", default=",".join(TABLE_DTYPES))
    p.add_argument("--shapes", default=",".join(TABLE_SHAPES))
    p.add_argument("--config", choices=("default", *PRESETS), default="default",
                   help="KernelConfig preset of both backends (default: DEFAULT_CONFIG)")  # fmt: skip
    args = p.parse_args(list(argv))
    problem = table_names_problem(args.shapes, args.tpus, args.dtypes)
    if problem:
        p.error(problem)
    config = preset(args.config)
    named = "" if args.config == "default" else f" {args.config} (C={config.bt})"
    lines = [
        "| shape | TPU | dtype | mode | pallas_tpu ms | jax_ref ms | roofline ms | pallas / roofline | jax_ref / pallas | pallas_tpu temp HBM MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    raw, ok = [], True
    start = time.time()
    for shape in args.shapes.split(","):
        B, T, H, K, V = TABLE_SHAPES[shape]
        for tpu in args.tpus.split(","):
            for dtype in args.dtypes.split(","):
                for mode in ("train", "forward"):
                    cells = {}
                    for backend in ("pallas_tpu", "jax_ref"):
                        program = Program(backend, mode, B, T, H, K, V, dtype, args.config)
                        print(f"[{time.time() - start:6.0f} s] {shape} {tpu} {dtype} {mode} {backend}",
                              file=sys.stderr, flush=True)  # fmt: skip
                        cells[backend] = row_of(program, tpu, config.bt)
                        ok &= cells[backend].trustworthy
                        raw.append(dataclasses.asdict(cells[backend]))
                    pal, ref = cells["pallas_tpu"], cells["jax_ref"]
                    flag = {n: "" if c.trustworthy else " (see notes)" for n, c in cells.items()}
                    lines.append(
                        f"| B={B} T={T} H={H} d={K}{named} | {tpu} | {dtype} | {mode} | "
                        f"{pal.ms:.2f}{flag['pallas_tpu']} | {ref.ms:.2f}{flag['jax_ref']} | "
                        f"{pal.roofline_ms:.2f} | {pal.ms / pal.roofline_ms:.1f}x | "
                        f"{ref.ms / pal.ms:.1f}x | {_mib(pal.temp_mib)} |"
                    )
    notes = [
        f"{p['backend']} {p['mode']} B={p['B']} T={p['T']} H={p['H']} {p['dtype']} {r['tpu']}: {n}"
        for r in raw
        for p in [r["program"]]
        for n in r["notes"]
    ]
    with open(args.table, "w") as f:
        f.write(f"Every figure: {LABEL}.\n\n" + "\n".join(lines) + "\n")
        if notes:
            f.write("\nNotes:\n" + "\n".join(f"- {n}" for n in notes) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    print("\n".join(lines))
    return 0 if ok else 1
