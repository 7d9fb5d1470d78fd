"""``gdn2 bench --decode``: the latency of one decode step per backend, correctness-gated, and
the accuracy cost of a bfloat16 state pool; with ``--tpu``, the decode kernels' static cycle
estimate against the HBM bound.

A step is what a server runs: ``jax.jit(gdn2_decode)`` of ``S`` tokens for each of ``N``
sequences against a pool of ``N`` slots named by ``state_indices`` (a permutation), the pool
donated (``donate_argnums``) and the returned pool fed to the next step. Rows: ``reference`` (the
token-serial decode reference under the same jit) and every backend whose decode verdict here is
yes. Each row's first step is gated against the reference (the kit's decode tolerances:
``gdn2_conformance.metrics``) before it is timed; median of the repeats, compile excluded.

Drift (``--drift-steps K``): ``K`` consecutive steps of one token through a row with a bfloat16
pool, against the reference with a float32 pool on the same tokens: the relative error of the last
step's o and of the final states (what serving with a bfloat16 pool costs).

``--tpu v5e,v6e``: for backends that run on a TPU, the kernels' static cycle estimate from a
deviceless compile (:mod:`gdn2_tools.static_profile`, XLA's memory-space assignment off so that
the profiler models the scalar-prefetch copies), next to the time to read and write the named
slots once at the chip's HBM bandwidth. Compile-time analysis, not a measurement. ``--gate
softplus`` (or a lower bound, ``--gate -5``) compiles the step with the layers' fused activations
(that gate, the q/k L2 norm, the b/w sigmoids), as a GDN or KDA layer's decode runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from gdn2_tools.chips import CHIPS

#: HBM bytes/s per chip (the bound of a decode step; chips.py).
HBM_BYTES_PER_S: Final = {name: chip.hbm_bytes_per_s for name, chip in CHIPS.items()}
REFERENCE: Final = "reference"


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """One decode step: N sequences of S tokens, H key and HV value heads, head sizes."""

    N: int
    S: int
    H: int
    HV: int
    dk: int
    dv: int
    gate_heads: int = 0  # heads of b and g: H (0) or HV

    @property
    def label(self) -> str:
        gates = f" Hg={self.gate_heads}" if self.gate_heads else ""
        return f"N={self.N} S={self.S} H={self.H} HV={self.HV}{gates} dk={self.dk} dv={self.dv}"

    def pool_bytes(self, pool_dtype: str) -> int:
        """Bytes of the N named slots (read once and written once per step)."""
        import jax.numpy as jnp

        return self.N * self.HV * self.dk * self.dv * jnp.dtype(pool_dtype).itemsize


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    summary = " ".join(__doc__.split("\n\n")[0].split())  # the whole first paragraph
    p = argparse.ArgumentParser(prog="gdn2 bench --decode", description=summary)
    p.add_argument("--sizes", default="1,8,64", help="numbers of sequences N (default 1,8,64)")
    p.add_argument("--tokens", "-S", type=int, default=1, help="tokens per sequence (default 1)")
    p.add_argument("--heads", "-H", type=int, default=16, help="key heads (default 16)")
    p.add_argument("--value-heads", type=int, default=32, help="value heads HV (default 32)")
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--pool-dtypes", default="float32,bfloat16", help="default float32,bfloat16")
    p.add_argument("--backends", default=None, help="comma-separated rows (default: all)")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per row (default 20)")
    p.add_argument("--drift-steps", type=int, default=256, help="0 skips the drift measurement")
    p.add_argument("--tpu", default="", help="e.g. v5e,v6e: static cycle estimates (libtpu)")
    p.add_argument("--no-timing", action="store_true", help="only the --tpu estimates")
    p.add_argument(
        "--gate", default="",
        help="--tpu: the layers' fused activations on the step, with this gate: 'softplus' or a "
        "lower bound ('-5'), plus the q/k L2 norm and the b/w sigmoids; default none",
    )  # fmt: skip
    p.add_argument(
        "--value-gates",
        action="store_true",
        help="b and g on the HV value heads (fla's and Qwen3-Next's layout; default: the H key heads)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="report folder")
    args = p.parse_args(list(argv))
    args.sizes = [int(n) for n in args.sizes.split(",") if n.strip()]
    args.pool_dtypes = [d.strip() for d in args.pool_dtypes.split(",") if d.strip()]
    args.tpu = [t.strip() for t in args.tpu.split(",") if t.strip()]
    bad = [d for d in args.pool_dtypes if d not in ("float32", "bfloat16")]
    if bad:
        p.error(f"--pool-dtypes: expected float32 or bfloat16, got {bad}")
    bad = [t for t in args.tpu if t not in HBM_BYTES_PER_S]
    if bad:
        p.error(f"--tpu: expected {sorted(HBM_BYTES_PER_S)}, got {bad}")
    if args.value_heads % args.heads:
        p.error(f"--value-heads {args.value_heads} must be a multiple of --heads {args.heads}")
    if args.gate and not args.tpu:
        p.error(f"--gate {args.gate}: applies to the --tpu estimates; add --tpu")
    if args.repeats < 1 or min(args.sizes, default=0) < 1:
        p.error("--repeats and every --sizes entry must be >= 1")
    return args


def _inputs(shape: DecodeShape, dtype: str, pool_dtype: str, seed: int):
    import jax.numpy as jnp

    from gdn2_conformance import Decay, DecodeCase, make_decode_inputs

    case = DecodeCase(
        N=shape.N, S=shape.S, H=shape.H, HV=shape.HV, gate_heads=shape.gate_heads, dk=shape.dk,
        dv=shape.dv, P=shape.N, decay=Decay.MODEL, seed=seed,
    )  # fmt: skip
    return make_decode_inputs(case, jnp.dtype(dtype), jnp.dtype(pool_dtype))


def _step(row: str):
    """``jit(step)`` with the pool donated: ``step(q, k, v, w, b, g, pool, idx) -> (o, pool)``."""
    import jax

    from gdn2core import gdn2_decode, gdn2_decode_reference

    if row == REFERENCE:

        def step(q, k, v, w, b, g, pool, idx):
            return gdn2_decode_reference(q, k, v, w, b, g, pool, idx)
    else:

        def step(q, k, v, w, b, g, pool, idx):
            return gdn2_decode(q, k, v, w, b, g, pool, state_indices=idx, backend=row)

    return jax.jit(step, donate_argnums=(6,))


def decode_rows(names: Sequence[str] | None) -> tuple[list[str], dict[str, str]]:
    """The rows to time here and the skipped ones with their reason.

    Args:
        names: row names (backends or ``reference``); None: the reference and every installed
            backend.

    Returns:
        ``(rows, {skipped row: reason})``.
    """
    from gdn2core.platform import default_platform
    from gdn2core.registry import BackendNotFoundError, get_backend, list_backends
    from gdn2core.verdict import judge_decode

    if names is None:
        names = [REFERENCE, *(i.name for i in list_backends() if not i.broken)]
    rows, skipped = [], {}
    for name in names:
        if name == REFERENCE:
            rows.append(name)
            continue
        try:
            backend = get_backend(name)
        except BackendNotFoundError as err:
            skipped[name] = str(err)
            continue
        answer = judge_decode(backend, None, None, auto=False, platform=default_platform())
        if answer:
            rows.append(name)
        else:
            skipped[name] = answer.reason
    return rows, skipped


def _gate(outputs, x, dtype: str) -> tuple[bool, dict[str, float], list[str]]:
    import jax.numpy as jnp

    from gdn2_conformance import decode_reference_outputs
    from gdn2_conformance.metrics import rel_err, tolerance

    o_ref, pool_ref, _ = decode_reference_outputs(x)
    state_dt = "bfloat16" if x.state.dtype == jnp.bfloat16 else dtype
    errors, failures = {}, []
    for name, got, want, dt in (
        ("o (decode)", outputs[0], o_ref, dtype),
        ("state (decode)", outputs[1], pool_ref, state_dt),
    ):
        err, tol = rel_err(got, want), tolerance(dt, name)
        errors[name] = err
        if not err <= tol:
            failures.append(f"{name}: rel err {err:.2e} > tol {tol:.0e}")
    return not failures, errors, failures


def time_row(row: str, shape: DecodeShape, dtype: str, pool_dtype: str, args) -> dict[str, Any]:
    """Gate, then time, one row at one shape and pool dtype.

    Args:
        row: the backend (or ``reference``).
        shape: the step.
        dtype: the token dtype.
        pool_dtype: the pool dtype.
        args: the parsed options (repeats, seed).

    Returns:
        The row as a JSON-ready dict.
    """
    import jax
    import jax.numpy as jnp

    out: dict[str, Any] = {"backend": row, "shape": dataclasses.asdict(shape), "dtype": dtype,
                           "pool_dtype": pool_dtype}  # fmt: skip
    x = _inputs(shape, dtype, pool_dtype, args.seed)
    step = _step(row)
    try:
        start = time.perf_counter()
        compiled = step.lower(*x.args, x.state, x.state_indices).compile()
        out["compile_s"] = time.perf_counter() - start
        given = x.state.copy()
        o, pool = jax.block_until_ready(compiled(*x.args, x.state, x.state_indices))
    except Exception as err:  # a row that fails is reported, never fatal
        return {**out, "status": "error", "reason": f"{type(err).__name__}: {err}"[:300]}
    ok, errors, failures = _gate((o, pool), dataclasses.replace(x, state=given), dtype)
    out["gate"] = {"ok": ok, "errors": errors, "failures": failures}
    if not ok:
        return {**out, "status": "rejected", "reason": "; ".join(failures)}
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        o, pool = jax.block_until_ready(compiled(*x.args, pool, x.state_indices))
        times.append(time.perf_counter() - start)
    median = float(jnp.median(jnp.asarray(times)))
    return {**out, "status": "ok", "reason": "", "times_s": times, "median_s": median}


def drift(row: str, shape: DecodeShape, dtype: str, steps: int, seed: int) -> dict[str, Any]:
    """``steps`` one-token steps with a bfloat16 pool through ``row``, against the reference with
    a float32 pool on the same tokens.

    Args:
        row: the backend (or ``reference``).
        shape: N, H, HV, dk, dv (S is 1 here).
        dtype: the token dtype.
        steps: how many steps.
        seed: the input seed.

    Returns:
        ``{"o": rel err of the last step's o, "state": rel err of the final states}``.
    """
    import jax
    import jax.numpy as jnp

    from gdn2_conformance import Decay, DecodeCase, make_decode_inputs
    from gdn2_conformance.metrics import rel_err

    one = dataclasses.replace(shape, S=1)
    case = DecodeCase(
        N=one.N, S=steps, H=one.H, HV=one.HV, gate_heads=one.gate_heads, dk=one.dk, dv=one.dv,
        P=one.N, decay=Decay.MODEL, seed=seed,
    )  # fmt: skip
    x = make_decode_inputs(case, jnp.dtype(dtype))  # S = steps tokens, one per step
    mine, ref = _step(row), _step(REFERENCE)
    pool = x.state.astype(jnp.bfloat16)
    pool_ref = x.state.copy()
    with jax.default_matmul_precision("highest"):
        for t in range(steps):
            toks = [a[:, t : t + 1] for a in x.args]
            o, pool = mine(*toks, pool, x.state_indices)
            o_ref, pool_ref = ref(*toks, pool_ref, x.state_indices)
    return {"steps": steps, "o": rel_err(o, o_ref), "state": rel_err(pool, pool_ref)}


def static_rows(
    rows: Sequence[str], shape: DecodeShape, dtype: str, pool_dtype: str, tpu: str, gate: str = ""
):
    """The static cycle estimate of each TPU backend's decode kernels at ``shape`` on ``tpu``.

    Args:
        rows: candidate backends (those whose platforms include a TPU are compiled).
        shape: the step.
        dtype: the token dtype.
        pool_dtype: the pool dtype.
        tpu: a chip of :data:`gdn2_tools.chips.CHIPS` (``"v5e"``, ``"v6e"``, ``"v5p"``).
        gate: ``--gate``: the fused activations with this gate, or ``""`` (none).

    Returns:
        JSON-ready dicts: kernel time, the XLA ops' time (index handling) where profiled, the
        HBM bound and the ratio.
    """
    from gdn2_tools.static_profile import LABEL, NO_MSA_FLAG, Program, estimate
    from gdn2core.registry import get_backend

    bound_us = 2 * shape.pool_bytes(pool_dtype) / HBM_BYTES_PER_S[tpu] * 1e6
    out = []
    for name in rows:
        try:
            caps = get_backend(name).capabilities if name != REFERENCE else None
        except Exception:  # not installed or broken: nothing to compile
            caps = None
        if caps is None or not caps.decode or "tpu" not in caps.platforms:
            continue
        program = Program(
            name, "decode", shape.N, shape.S, shape.H, shape.dk, shape.dv, dtype,
            value_heads=shape.HV, pool_dtype=pool_dtype, gate=gate,
            value_gates=shape.gate_heads == shape.HV != shape.H,
        )  # fmt: skip
        kernels = estimate(program, tpu, xla_ops=False, extra_flags=[NO_MSA_FLAG])
        xla = estimate(program, tpu, kernels=False, extra_flags=[NO_MSA_FLAG])
        row = {"backend": name, "tpu": tpu, "shape": dataclasses.asdict(shape),
               "dtype": dtype, "pool_dtype": pool_dtype, "bound_us": bound_us, "label": LABEL,
               "gate": gate}  # fmt: skip
        error = kernels.error or xla.error
        if error:
            row["error"] = error
            out.append(row)
            continue
        has_kernels = any(op.kernel for op in kernels.ops)
        row["kernel_us"] = kernels.ms(kernels.kernel_cycles) * 1e3 if has_kernels else None
        row["xla_ops_us"] = xla.ms(sum(op.total for op in xla.ops if not op.kernel)) * 1e3
        row["unprofiled"] = sorted({*kernels.unprofiled, *xla.unprofiled})
        row["total_us"] = (row["kernel_us"] or 0.0) + row["xla_ops_us"]
        if row["kernel_us"]:
            row["kernel_ratio"] = row["kernel_us"] / bound_us
        row["total_ratio"] = row["total_us"] / bound_us
        out.append(row)
    return out


def _markdown(results: dict[str, Any]) -> str:
    lines = [f"# gdn2 bench --decode\n\n`{results['command']}`\n"]
    if results["rows"]:
        lines += [
            "## Latency per step (median ms, compile excluded; gated against the reference)\n",
            "| shape | dtype | pool | backend | status | ms/step | tokens/s |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in results["rows"]:
            s = DecodeShape(**r["shape"])
            ms = f"{r['median_s'] * 1e3:.3f}" if r.get("median_s") else "-"
            tps = f"{s.N * s.S / r['median_s']:,.0f}" if r.get("median_s") else "-"
            status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
            lines.append(
                f"| {s.label} | {r['dtype']} | {r['pool_dtype']} | {r['backend']} | {status} | "
                f"{ms} | {tps} |"
            )
    if results["drift"]:
        lines += ["\n## bfloat16 pool: error after K one-token steps (vs a float32 pool)\n",
                  "| shape | backend | steps | o | state |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
        for d in results["drift"]:
            s = DecodeShape(**d["shape"])
            lines.append(
                f"| {s.label} | {d['backend']} | {d['steps']} | {d['o']:.2e} | {d['state']:.2e} |"
            )
    if results["static"]:
        lines += [
            "\n## TPU static cycle estimate (compile-time analysis, not a measurement)\n",
            "Kernel: the Pallas kernels; XLA ops: the rest of the step (index handling, or the "
            "whole step of a pure-JAX backend). Bound: the named slots read and written once at "
            "the chip's HBM bandwidth.\n",
            "| tpu | shape | pool | backend | kernel us | XLA ops us | bound us | kernel / bound "
            "| total / bound |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in results["static"]:
            s = DecodeShape(**r["shape"])
            if "error" in r:
                cells = [r["error"][:80], "-", f"{r['bound_us']:.2f}", "-", "-"]
            else:
                kernel = "-" if r["kernel_us"] is None else f"{r['kernel_us']:.2f}"
                xla = f"{r['xla_ops_us']:.2f}" + (
                    f" (+{len(r['unprofiled'])} unprofiled)" if r["unprofiled"] else ""
                )
                ratio = f"{r['kernel_ratio']:.2f}" if "kernel_ratio" in r else "-"
                cells = [kernel, xla, f"{r['bound_us']:.2f}", ratio, f"{r['total_ratio']:.2f}"]
            gate = f" (activations, {r['gate']} gate)" if r.get("gate") else ""
            lines.append(
                f"| {r['tpu']} | {s.label} | {r['pool_dtype']} | {r['backend']}{gate} | "
                + " | ".join(cells)
                + " |"
            )
    skipped = results.get("skipped") or {}
    if skipped:
        lines.append("\nNot run here: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    return "\n".join(lines) + "\n"


def decode_main(argv: Sequence[str]) -> int:
    """Run ``gdn2 bench --decode``.

    Args:
        argv: the arguments after ``gdn2 bench --decode`` (``--help`` lists them).

    Returns:
        0; 1 when a row was rejected by the gate or failed.
    """
    args = _parse(argv)
    names = [n.strip() for n in args.backends.split(",")] if args.backends else None
    rows, skipped = decode_rows(names)
    gate_heads = args.value_heads if args.value_gates else 0
    shapes = [
        DecodeShape(n, args.tokens, args.heads, args.value_heads, args.dk, args.dv, gate_heads)
        for n in args.sizes
    ]
    results: dict[str, Any] = {
        "schema": "gdn2-bench-decode/1",
        "command": "gdn2 bench --decode " + " ".join(argv),
        "rows": [],
        "drift": [],
        "static": [],
        "skipped": skipped,
    }
    if not args.no_timing:
        for shape in shapes:
            for pool_dtype in args.pool_dtypes:
                for row in rows:
                    r = time_row(row, shape, args.dtype, pool_dtype, args)
                    results["rows"].append(r)
                    ms = f"{r['median_s'] * 1e3:.3f} ms" if r.get("median_s") else r["reason"]
                    print(f"{shape.label} {pool_dtype} pool {row}: {r['status']} {ms}", flush=True)
        if args.drift_steps and "bfloat16" in args.pool_dtypes:
            for row in rows:
                if row == REFERENCE:
                    continue
                d = drift(row, shapes[0], args.dtype, args.drift_steps, args.seed)
                results["drift"].append(
                    {**d, "backend": row, "shape": dataclasses.asdict(shapes[0])}
                )
                print(f"drift {row} {d['steps']} steps: o {d['o']:.2e} state {d['state']:.2e}")
    for tpu in args.tpu:
        for shape in shapes:
            for pool_dtype in args.pool_dtypes:
                candidates = rows + list(skipped)
                for r in static_rows(candidates, shape, args.dtype, pool_dtype, tpu, args.gate):
                    results["static"].append(r)
                    print(
                        f"{tpu} {shape.label} {pool_dtype} {r['backend']}: "
                        f"{r.get('error') or r['total_us']} us in all, bound "
                        f"{r['bound_us']:.2f} us"
                    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(json.dumps(results, indent=2) + "\n")
    md = _markdown(results)
    (args.out / "decode.md").write_text(md)
    print(md)
    print(f"wrote {args.out / 'decode.json'} and {args.out / 'decode.md'}")
    bad = [r for r in results["rows"] if r["status"] in ("rejected", "error")]
    return 1 if bad else 0
