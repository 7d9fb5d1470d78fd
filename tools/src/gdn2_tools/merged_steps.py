"""Which copy of pallas_tpu's grid step each step of a call runs, for the bench's inputs: a grid
step merges the decay levels inside 16-row (or 8-row) blocks when its log decays allow it, and
keeps the levels otherwise (docs/algorithm.md section 10). The rule applied outside the kernels
(``gdn2_pallas_tpu.merged_steps``), on the plans the chip's compile gets (libtpu's
description of it; no compile, no TPU).

    python -m gdn2_tools.merged_steps --shape 8,4096,6,128 --decay model --tpu v5e

One line per kernel plan (the inference forward; the training forward and the backward), with
the count of steps per copy. ``--dtype`` (default bfloat16, the bench's train step) is the inputs'
dtype, which sets the plans' blocking too: a float32 training plan takes fewer rows a step
(pallas_tpu's plan.py, "Training steps").
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

from gdn2_conformance import Decay
from gdn2_tools.bench.inputs import make_inputs
from gdn2_tools.bench.shapes import BenchShape, parse_shape
from gdn2_tools.chips import CHIPS
from gdn2_tools.tpu_report import planned_for

COPIES = {16: "16-row blocks", 8: "8-row blocks", 1: "levels"}


def copies(
    shape: BenchShape, decay: Decay, tpu: str, seed: int = 0, dtype: str = "bfloat16"
) -> dict[str, dict[int, int]]:
    """Steps per copy (block 16, 8 or 1) of the inference and the training plan.

    Args:
        shape: the bench shape (its key heads are the kernels' heads).
        decay: the log decays' distribution.
        tpu: a chip of :data:`gdn2_tools.chips.CHIPS`: its plans (VMEM, MXU depth, cores).
        seed: the input seed.
        dtype: the inputs' dtype ("bfloat16" or "float32"): the plans' too.

    Returns:
        ``{"forward": {block: steps}, "training": {block: steps}}``.
    """
    from gdn2_pallas_tpu.merged_steps import step_blocks
    from gdn2_pallas_tpu.plan import make_plan
    from gdn2core import KernelConfig
    from gdn2core.ops.forward.spec import OpSpec

    xs, _, _ = make_inputs(shape, dtype, seed, decay)
    spec = OpSpec.from_inputs(*xs, None, None)
    out = {}
    for name, training in (("forward", False), ("training", True)):
        with planned_for(tpu):  # the plans read the chip's VMEM, MXU and cores
            plan = make_plan(spec, KernelConfig(), training=training)
        blocks = step_blocks(xs[5], plan)
        out[name] = {b: int(np.sum(blocks == b)) for b in COPIES}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gdn2_tools.merged_steps", description=__doc__)
    parser.add_argument("--shape", default="8,4096,6,128", help="B,T,H,DK[,DV]")
    parser.add_argument("--decay", choices=[d.value for d in Decay], default=Decay.MODEL.value)
    parser.add_argument("--tpu", choices=sorted(CHIPS), default="v5e")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    try:
        shape = parse_shape(args.shape)
    except ValueError as e:
        parser.error(str(e))
    if shape.HV or shape.seqs > 1:
        parser.error("--shape: grouped value heads and packed rows are not taken here")
    for name, counts in copies(shape, Decay(args.decay), args.tpu, args.seed, args.dtype).items():
        parts = ", ".join(f"{COPIES[b]} {n}" for b, n in counts.items())
        print(f"{name}: {sum(counts.values())} steps: {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
