"""Time fla's ``chunk_gdn2`` (Triton, GPU) at the shapes and inputs of ``gdn2 bench``, check its
outputs and gradients against ours, and write the rows in the ``gdn2 bench`` JSON schema.

STATUS: NOT RUN. This script was written without a GPU, torch or fla-core; it has never been
executed. Expect to fix small API details on first use (fla-core's signature has changed between
releases). It is not part of the test suite.

Requirements: a CUDA GPU, ``torch``, ``fla-core >= 0.6.0`` (``fla.ops.gdn2.chunk_gdn2``), and
gdn2core (for the inputs, the shapes, the gate and the trusted result; ours runs on JAX's CPU or
GPU backend, whichever this JAX has).

    python benchmarks/peers/fla_chunk_gdn2.py --shapes seed --out bench-results/fla
    gdn2 bench --shapes seed --include bench-results/fla/bench.json   # table with the peer row

Argument order: fla is ``chunk_gdn2(q, k, v, g, b, w, scale, initial_state, output_final_state)``;
ours is ``(q, k, v, w, b, g, scale, h0)``. Both use the (B, T, H, d) layout, the natural-log decay
``g`` on the key axis, and an initial/final state of shape (B, H, dk, dv) (docs/operator.md).

What is timed (CUDA events around each call, after a warm-up, ``--repeats`` times, median/min/max
and IQR as in ``gdn2 bench``): ``fwd`` (no grad), ``bwd`` (``torch.autograd.backward`` on a graph
kept from one forward), ``fwdbwd`` (forward and backward). Triton's autotuning and compilation
happen in the warm-up and are reported as ``compile_s`` of the first call.

The gate: fla's outputs (o, h_final) and gradients (dq, dk, dv, dw, db, dg, dh0) for the same
cotangents are compared with ours by the gate of ``gdn2_tools.bench.gate`` (the conformance kit's
metric and tolerances, gdn2_conformance); ours is
the token-serial reference where affordable, else jax_ref, both in float32 on the dtype-rounded
inputs. A row that fails is written ``rejected`` and not timed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from gdn2_conformance import GRAD_NAMES, TOLERANCES, make_arrays
from gdn2_tools.bench import gate as gate_mod
from gdn2_tools.bench.inputs import bench_case
from gdn2_tools.bench.shapes import SHAPE_LISTS, BenchShape, parse_shape


def _arrays(shape: BenchShape, seed: int) -> tuple[dict, dict]:
    """The bench's inputs as float32 NumPy arrays (the kit's generator), and the cotangents."""
    arr = {n: a.astype(np.float32) for n, a in make_arrays(bench_case(shape, seed)).items()}
    return arr, {"do": arr.pop("do"), "dh": arr.pop("dh")}


SCHEMA = "gdn2-bench/1"
ROW_NAME = "fla_chunk_gdn2"


def ours_f32(shape: BenchShape, dtype: str, seed: int, trusted: str) -> dict[str, np.ndarray]:
    """Our float32 result on the dtype-rounded inputs (reference, or jax_ref for large shapes)."""
    import jax
    import jax.numpy as jnp

    from gdn2_tools.bench.programs import programs_for, reference_programs

    arr, cts = _arrays(shape, seed)
    xs = tuple(
        jnp.asarray(arr[n], dtype=dtype).astype(jnp.float32) for n in ("q", "k", "v", "w", "b", "g")
    )
    h0 = jnp.asarray(arr["h0"])
    ct = (jnp.asarray(cts["do"], dtype=dtype).astype(jnp.float32), jnp.asarray(cts["dh"]))
    progs = reference_programs() if trusted == "reference" else programs_for("jax_ref")
    with jax.default_matmul_precision("highest"):
        o, h, grads = jax.jit(progs.fwdbwd)(xs, h0, ct)
    out = {"o": o, "h_final": h, **dict(zip(GRAD_NAMES, grads, strict=True))}
    return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}


def torch_inputs(shape: BenchShape, dtype: str, seed: int):
    import torch

    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    arr, cts = _arrays(shape, seed)

    def t(x, dt_=tdt):
        return torch.from_numpy(x).to("cuda", dt_).requires_grad_(True)

    xs = {n: t(arr[n]) for n in ("q", "k", "v", "w", "b", "g")}
    h0 = t(arr["h0"], torch.float32)
    do = torch.from_numpy(cts["do"]).to("cuda", tdt)
    dh = torch.from_numpy(cts["dh"]).to("cuda", torch.float32)
    return xs, h0, do, dh


def fla_call(xs, h0):
    from fla.ops.gdn2 import chunk_gdn2

    # fla order: q, k, v, g, b, w  (ours: q, k, v, w, b, g)
    o, ht = chunk_gdn2(
        xs["q"],
        xs["k"],
        xs["v"],
        xs["g"],
        xs["b"],
        xs["w"],
        scale=xs["q"].shape[-1] ** -0.5,
        initial_state=h0,
        output_final_state=True,
    )
    return o, ht


def _grads(xs, h0):
    out = {}
    for n in ("q", "k", "v", "w", "b", "g"):
        out[f"d{n}"] = xs[n].grad
    out["dh0"] = h0.grad
    return out


def _zero(xs, h0):
    for x in (*xs.values(), h0):
        x.grad = None


def cuda_time(fn, repeats: int) -> list[float]:
    import torch

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def timing_dict(compile_s: float, times: list[float]) -> dict:
    t = np.asarray(times)
    return {
        "compile_s": compile_s,
        "median_s": float(np.median(t)),
        "min_s": float(t.min()),
        "max_s": float(t.max()),
        "p25_s": float(np.percentile(t, 25)),
        "p75_s": float(np.percentile(t, 75)),
        "repeats": int(t.size),
        "times_s": [float(x) for x in t],
    }


def run_row(shape: BenchShape, dtype: str, args) -> dict:
    import torch

    row = {
        "backend": ROW_NAME,
        "shape": shape.as_dict(),
        "dtype": dtype,
        "status": "ok",
        "reason": "",
        "gate": None,
        "modes": {},
        "speedup": {},
        "source": "this run",
    }
    xs, h0, do, dh = torch_inputs(shape, dtype, args.seed)

    # Warm-up (Triton autotune + compile) doubles as the gate run.
    torch.cuda.synchronize()
    start = time.perf_counter()
    o, ht = fla_call(xs, h0)
    torch.autograd.backward((o, ht), (do, dh))
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - start
    got = {"o": o.detach(), "h_final": ht.detach(), **_grads(xs, h0)}
    got = {k: v.float().cpu().numpy() for k, v in got.items() if v is not None}

    if args.check != "none":
        trusted = args.check
        if trusted == "auto":
            dev_bytes = torch.cuda.get_device_properties(0).total_memory
            trusted = "reference" if gate_mod.reference_affordable(shape, dev_bytes) else "jax_ref"
        expected = ours_f32(shape, dtype, args.seed, trusted)
        result = gate_mod.compare(got, expected, dtype, f"gdn2 {trusted}")
        row["gate"] = result.as_dict()
        if not result.ok:
            row["status"], row["reason"] = "rejected", result.message
            return row

    def fwd():
        with torch.no_grad():
            fla_call(xs, h0)

    def fwdbwd():
        _zero(xs, h0)
        o, ht = fla_call(xs, h0)
        torch.autograd.backward((o, ht), (do, dh))

    o, ht = fla_call(xs, h0)

    def bwd():
        _zero(xs, h0)
        torch.autograd.backward((o, ht), (do, dh), retain_graph=True)

    for name, fn in (("fwd", fwd), ("bwd", bwd), ("fwdbwd", fwdbwd)):
        fn()  # warm-up of this exact path
        torch.cuda.synchronize()
        row["modes"][name] = timing_dict(first_call_s, cuda_time(fn, args.repeats))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", choices=sorted(SHAPE_LISTS), default="seed")
    p.add_argument("--shape", action="append", type=parse_shape, metavar="B,T,H,DK,DV")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", choices=("auto", "reference", "jax_ref", "none"), default="auto")
    p.add_argument("--out", type=Path, default=Path("bench-results/fla"))
    args = p.parse_args(argv)

    import fla
    import torch

    shapes = args.shape or list(SHAPE_LISTS[args.shapes])
    rows = []
    for shape in shapes:
        for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            try:
                row = run_row(shape, dtype, args)
            except Exception as err:  # keep going; the error is the row
                row = {
                    "backend": ROW_NAME,
                    "shape": shape.as_dict(),
                    "dtype": dtype,
                    "status": "error",
                    "reason": f"{type(err).__name__}: {err}",
                    "gate": None,
                    "modes": {},
                    "speedup": {},
                    "source": "this run",
                }
            med = row["modes"].get("fwdbwd", {}).get("median_s")
            print(
                f"{shape.label} {dtype}: {row['status']} {row['reason']}"
                + (f" fwd+bwd {med * 1e3:.3f} ms" if med else "")
            )
            rows.append(row)
    report = {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "environment": {
            "torch": torch.__version__,
            "fla": getattr(fla, "__version__", "?"),
            "platform": "gpu",
            "device_kind": torch.cuda.get_device_name(0),
            "device_count": torch.cuda.device_count(),
            "python": platform.python_version(),
            "host": platform.node(),
        },
        "gate_tolerances": {
            d: {str(q): t for q, t in tol.items()} for d, tol in TOLERANCES.items()
        },
        "command": "benchmarks/peers/fla_chunk_gdn2.py",
        "repeats": args.repeats,
        "seed": args.seed,
        "rows": rows,
        "checks": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        print(
            "median fwd+bwd ms:",
            statistics.median(r["modes"]["fwdbwd"]["median_s"] * 1e3 for r in ok),
        )
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
