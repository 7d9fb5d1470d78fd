"""Wall-clock of the public ops on the device at hand, without the bench's correctness gate: a few
minutes on a lent TPU, to set a measurement beside the compiler's static estimate.

    python -m gdn2_tools.wallclock --shape 8,4096,6,128 pallas_tpu:bfloat16:forward \\
        pallas_tpu:bfloat16:train --out times.jsonl

Each spec is ``BACKEND:DTYPE:PROGRAM``; ``forward`` is ``gdn2_forward``, ``train`` the forward and
backward of ``gdn2_forward_trainable`` (the bench's fwd+bwd), on the bench's inputs
(:func:`gdn2_tools.bench.inputs.make_inputs`), whose log decays are model-like unless ``--decay``
names another of the kit's distributions: pallas_tpu runs a grid step's merged-levels copy only
when the step's decays are bounded (``--decay mixed``, ``weak`` and, at the train shape, ``model``
time the 16-row copy; docs/algorithm.md section 10). Compile is timed apart; one warm-up call, then the
median of ``--repeats`` blocking calls (:mod:`gdn2_tools.bench.timing`), and ``pipelined_ms``: as
many calls dispatched back to back with one wait at the end, per call (a training loop's way: the
host's dispatch and wait overlap the device's work). Each row also gives:

- ``kernels``: the Mosaic kernels (``tpu_custom_call``) in the compiled program: a pallas_tpu row
  that ran in interpret mode, or anything but the kernels, shows 0;
- ``diff``: the largest relative difference (:func:`gdn2_conformance.metrics.rel_err`) of its
  outputs and gradients from the first row of the same dtype and program, a cross-check only.
  Correctness on the device is the conformance suite's (``gdn2 conformance NAME``); ``gdn2 bench``
  is the gated benchmark.

With ``--trace N``, N more calls run under a profiler trace and the row gets ``op_ms``: each op's
measured milliseconds per call on the device (:mod:`gdn2_tools.op_times`; a Pallas kernel is its
custom call, ``gdn2_fwd.1`` ...), beside the compiler's per-kernel estimate of
``gdn2 tpu-report --estimate``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Final

import jax
import numpy as np

from gdn2_conformance import Decay
from gdn2_conformance.metrics import rel_err
from gdn2_tools.bench.cli import DTYPES
from gdn2_tools.bench.inputs import make_inputs
from gdn2_tools.bench.programs import programs_for
from gdn2_tools.bench.shapes import BenchShape, parse_shape
from gdn2_tools.bench.timing import compile_program, run_once, time_pipelined, time_repeats
from gdn2_tools.hlo import mosaic_kernels
from gdn2_tools.op_times import op_times

PROGRAMS: Final = ("forward", "train")


@dataclasses.dataclass(frozen=True)
class Spec:
    """One row: a backend, an input dtype and a program."""

    backend: str
    dtype: str
    program: str

    @classmethod
    def parse(cls, text: str) -> Spec:
        parts = text.split(":")
        if len(parts) != 3 or parts[2] not in PROGRAMS or parts[1] not in DTYPES:
            raise ValueError(
                f"spec {text!r}: expected BACKEND:DTYPE:PROGRAM with DTYPE float32 or bfloat16 "
                f"and PROGRAM one of {PROGRAMS}"
            )
        return cls(*parts)

    def __str__(self) -> str:
        return f"{self.backend}:{self.dtype}:{self.program}"


def _run(
    spec: Spec, shape: BenchShape, repeats: int, decay: Decay, trace: int = 0
) -> tuple[dict[str, Any], Any]:
    """Compile, warm up and time one row (and with ``trace``, that many calls traced); its record
    and its outputs."""
    xs, h0, cts = make_inputs(shape, spec.dtype, decay=decay)
    programs = programs_for(spec.backend)
    if spec.program == "forward":
        fn, args = programs.fwd, (xs, h0)
    else:
        fn, args = programs.fwdbwd, (xs, h0, cts)
    compiled, compile_s = compile_program(fn, *args)
    outputs = run_once(compiled, *args)
    times = np.asarray(time_repeats(compiled, args, repeats))
    pipelined = time_pipelined(compiled, args, repeats)
    leaves = [np.asarray(a, np.float32) for a in jax.tree.leaves(outputs)]
    record = {
        "spec": str(spec),
        "shape": dataclasses.asdict(shape),
        "decay": str(decay),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "compile_s": round(compile_s, 2),
        "median_ms": round(1e3 * float(np.median(times)), 4),
        "min_ms": round(1e3 * float(times.min()), 4),
        "pipelined_ms": round(1e3 * pipelined, 4),
        "repeats": int(times.size),
        "kernels": len(mosaic_kernels(compiled.as_text() or "")),
        "finite": bool(all(np.isfinite(a).all() for a in leaves)),
    }
    if trace:
        ops = op_times(compiled, args, trace)
        record["op_ms"] = {name: round(ms, 4) for name, ms in ops.ms.items()}
        if ops.module_ms is not None:
            record["module_ms"] = round(ops.module_ms, 4)
        if not ops.ms:  # a trace laid out otherwise: what it held
            record["trace_lines"] = list(ops.lines)
    return record, leaves


def measure(
    specs: Sequence[Spec],
    shape: BenchShape,
    repeats: int,
    decay: Decay = Decay.MODEL,
    trace: int = 0,
) -> Iterator[dict[str, Any]]:
    """One record per spec, in order, each as soon as it is measured (the fields: the module
    docstring)."""
    first: dict[tuple[str, str], tuple[str, list[np.ndarray]]] = {}
    for spec in specs:
        record, leaves = _run(spec, shape, repeats, decay, trace)
        key = (spec.dtype, spec.program)
        if key in first:
            name, ref = first[key]
            record["diff_vs"] = name
            record["diff"] = max(rel_err(a, e) for a, e in zip(leaves, ref, strict=True))
        else:
            first[key] = (str(spec), leaves)
        yield record


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gdn2_tools.wallclock", description=__doc__)
    parser.add_argument("specs", nargs="+", help="BACKEND:DTYPE:PROGRAM (forward or train)")
    parser.add_argument(
        "--shape", default="8,4096,6,128", help="B,T,H,DK[,DV] (as gdn2 bench --shape)"
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--decay",
        choices=[d.value for d in Decay],
        default=Decay.MODEL.value,
        help="the inputs' log decays (the conformance kit's distributions; default: model)",
    )
    parser.add_argument(
        "--trace",
        type=int,
        default=0,
        metavar="N",
        help="also run N calls under a profiler trace: each op's measured ms per call (op_ms)",
    )
    parser.add_argument("--out", help="append one JSON line per row to this file")
    args = parser.parse_args(argv)
    if args.trace < 0:
        parser.error(f"--trace: expected a count >= 0, got {args.trace}")
    try:
        specs = [Spec.parse(s) for s in args.specs]
        shape = parse_shape(args.shape)
    except ValueError as e:
        parser.error(str(e))
    for record in measure(specs, shape, args.repeats, Decay(args.decay), args.trace):
        line = json.dumps(record)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
