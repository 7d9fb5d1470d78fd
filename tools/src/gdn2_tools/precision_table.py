"""``python -m gdn2_tools.precision_table``: the measured error of the Pallas kernels' MXU precision
choices (the table of docs/algorithm.md section 10).

Each row runs the pallas_tpu kernels in TPU interpret mode on the CPU with one set of per-stage
precisions (``gdn2_pallas_tpu.plan.Precisions``) and prints the worst relative error
(``max|x - ref| / max|ref|``) of the outputs (o, h_final) and of the seven gradients against the
token-serial reference run in float64 on the same values, over mixed, strong and uniformly
strong decay with ``b`` up to 2. Takes several minutes (interpret mode simulates every grid step).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Final

#: (input dtype, label, stages overridden to one bf16 pass, dtype of the saved step states or
#: None for the plan's own: ``Plan.saved_state_dtype``).
VARIANTS: Final = (
    ("float32", "all bf16x3 (three bf16 passes)", (), None),
    ("float32", "scores in one bf16 pass, rest bf16x3", ("scores", "score_grads"), None),
    ("float32", "WY inverse in one bf16 pass, rest bf16x3", ("inverse",), None),
    ("float32", "`Y`, `U` in one bf16 pass", ("wy",), None),
    ("float32", "state pass in one bf16 pass", ("state",), None),
    ("bfloat16", "all one bf16 pass (step states saved in bfloat16)", (), None),
    ("bfloat16", "all one bf16 pass, step states saved in float32", (), "float32"),
)


def _cases(T: int, H: int, d: int):
    from gdn2_conformance import Case, Decay

    return (
        Case(B=1, T=T, H=H, dk=d, dv=d, b_max=2.0, decay=Decay.MIXED, seed=1),
        Case(B=1, T=T, H=H, dk=d, dv=d, b_max=2.0, decay=Decay.STRONG, seed=2),
        Case(B=1, T=T, H=H, dk=d, dv=d, b_max=2.0, decay=Decay.STRONG, seed=3, strong_share=1.0),
    )


def _outputs_and_grads(fn, inp):
    """``(o, h_final)`` and the seven gradients of ``sum(o * do) + sum(h_final * dh)``."""
    import jax

    args = (*inp.args, inp.h0_or_zeros)
    (o, h), vjp = jax.vjp(fn, *args)
    return (o, h), vjp((inp.do.astype(o.dtype), inp.dh.astype(h.dtype)))


def worst_errors(
    dtype: str,
    bf16_stages: Sequence[str],
    T: int,
    H: int,
    d: int,
    states: str | None = None,
    bt: int = 64,
):
    """Worst relative error of the outputs and of the gradients over the cases (``states``: the
    saved step states' dtype, None for the plan's; ``bt``: the chunk length)."""
    import jax
    import jax.numpy as jnp

    from gdn2_conformance import make_inputs, rel_err
    from gdn2_pallas_tpu.matmul import MatmulPrecision
    from gdn2_pallas_tpu.plan import make_plan, precisions_for
    from gdn2_pallas_tpu.vjp import NO_EXTRAS, gdn2_pallas_trainable
    from gdn2core import KernelConfig, gdn2_token_serial_reference
    from gdn2core.ops.forward.spec import OpSpec

    precisions = dataclasses.replace(
        precisions_for(dtype), **{s: MatmulPrecision.BF16 for s in bf16_stages}
    )
    plan = make_plan(
        OpSpec(1, T, H, d, d, dtype, d**-0.5),
        KernelConfig(bt=bt, interpret=True),
        precisions=precisions,
    )
    if states is not None:
        plan = dataclasses.replace(plan, saved_state_dtype=states)

    def pallas(q, k, v, w, b, g, h0):
        o, h, _ = gdn2_pallas_trainable(q, k, v, w, b, g, h0, NO_EXTRAS, plan)
        return o, h

    def reference(q, k, v, w, b, g, h0):
        return gdn2_token_serial_reference(q, k, v, w, b, g, d**-0.5, h0)

    worst_fwd = worst_grad = 0.0
    for case in _cases(T, H, d):
        inp = make_inputs(case).astype(jnp.dtype(dtype))  # the values the kernels see
        (o, h), grads = _outputs_and_grads(jax.jit(pallas), inp)
        (o_r, h_r), grads_r = _outputs_and_grads(jax.jit(reference), inp.astype(jnp.float64))
        worst_fwd = max(worst_fwd, rel_err(o, o_r), rel_err(h, h_r))
        worst_grad = max(worst_grad, *(rel_err(a, r) for a, r in zip(grads, grads_r, strict=True)))
    return worst_fwd, worst_grad


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gdn2_tools.precision_table", description=__doc__)
    p.add_argument("-T", type=int, default=256)
    p.add_argument("-H", type=int, default=2)
    p.add_argument("-d", type=int, default=128, help="dk = dv")
    p.add_argument("--bt", type=int, default=64, help="chunk length C (KernelConfig.bt)")
    p.add_argument(
        "--only-dtype", choices=("float32", "bfloat16"), help="the rows of one input dtype only"
    )
    args = p.parse_args(argv)
    import jax

    jax.config.update("jax_enable_x64", True)  # the float64 reference
    print(
        f"T={args.T} H={args.H} dk=dv={args.d} C={args.bt}, pallas_tpu in TPU interpret mode",
        flush=True,
    )
    if args.only_dtype:
        print(f"(the {args.only_dtype} rows only)")
    print("| inputs | products | worst forward | worst gradient |")
    print("| --- | --- | --- | --- |")
    for dtype, label, stages, states in VARIANTS:
        if args.only_dtype and dtype != args.only_dtype:
            continue
        fwd, grad = worst_errors(dtype, stages, args.T, args.H, args.d, states, args.bt)
        print(f"| {dtype} | {label} | {fwd:.1e} | {grad:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
