"""``gdn2 mesh-report``: per-chip HBM of the sharded train step on a TPU pod topology, compiled
deviceless (libtpu, no TPU needed).

The step is ``value_and_grad`` of ``sum(o * do) + sum(h_final * dh)`` in all seven arguments
(:func:`gdn2_tools.train_step.train_step`), jitted over ``ShapeDtypeStruct`` inputs that carry their
``NamedSharding`` on a mesh over the topology's devices, lowered for TPU and compiled; the numbers
are XLA's ``memory_analysis()`` of the per-chip program. Two layouts by default, on ``v5e:2x4``:

- ``batch``: B=8, T=4096, H=6, dk=dv=128, batch over the 8 chips;
- ``context``: B=1, T=32768, H=6, dk=dv=128, time over the 8 chips (context parallelism).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from gdn2_conformance.backends import ReferenceBackend
from gdn2_tools.hlo import Collective, collective_summary
from gdn2_tools.preflight import missing
from gdn2_tools.tpu import compile_for_tpu, topology_mesh

MESH_AXIS = "chips"


@dataclasses.dataclass(frozen=True)
class Shape:
    mode: str  # "batch" (B over the chips) or "context" (T over the chips)
    B: int
    T: int
    H: int
    d: int  # dk = dv

    def describe(self) -> str:
        return f"B={self.B} T={self.T} H={self.H} dk=dv={self.d}"


DEFAULT_SHAPES = (
    Shape("batch", B=8, T=4096, H=6, d=128),
    Shape("context", B=1, T=32768, H=6, d=128),
)


@dataclasses.dataclass(frozen=True)
class ReportArgs:
    backend: str
    topology: str = "v5e:2x4"
    dtype: str = "bfloat16"
    config: str | None = None  # a preset name of gdn2core.config.PRESETS
    shapes: tuple[Shape, ...] = DEFAULT_SHAPES


@dataclasses.dataclass
class Row:
    shape: Shape
    chips: int
    argument_bytes: int = 0
    output_bytes: int = 0
    temp_bytes: int = 0
    alias_bytes: int = 0
    code_bytes: int = 0
    peak_bytes: int | None = None
    collectives: list[Collective] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def per_chip_bytes(self) -> int:
        """Arguments + outputs - aliased + temporaries + code: XLA's per-chip HBM footprint."""
        total = (
            self.argument_bytes
            + self.output_bytes
            - self.alias_bytes
            + self.temp_bytes
            + self.code_bytes
        )
        return max(total, self.peak_bytes or 0)


def default_backend(args_shape: Shape, dtype: str, config: str | None) -> str:
    """The backend ``backend="auto"`` would pick for a TPU train step of this shape.

    Args:
        args_shape: the first shape of the report.
        dtype: the input dtype.
        config: a preset name, or None.

    Returns:
        The backend name.

    Raises:
        BackendNotFoundError: no installed backend would run it on a TPU.
    """
    from gdn2core.config import DEFAULT_CONFIG, PRESETS
    from gdn2core.ops.forward.spec import OpSpec
    from gdn2core.selection import resolve_backend

    sh = args_shape
    spec = OpSpec(sh.B, sh.T, sh.H, sh.d, sh.d, dtype, sh.d**-0.5)
    cfg = PRESETS[config] if config else DEFAULT_CONFIG
    return resolve_backend(spec, cfg, "auto", trainable=True, platform="tpu").name


def compile_row(mesh, shape: Shape, args: ReportArgs) -> Row:
    import jax.numpy as jnp

    from gdn2_tools.train_step import input_specs, train_step
    from gdn2core.config import PRESETS

    chips = int(mesh.size)
    row = Row(shape, chips)
    kw = {"batch_axes": MESH_AXIS} if shape.mode == "batch" else {"context_axis": MESH_AXIS}
    if shape.mode == "context":
        kw["batch_axes"] = ()
    specs = input_specs(
        mesh, shape.B, shape.T, shape.H, shape.d, shape.d, dtype=jnp.dtype(args.dtype), **kw
    )
    op_kw = dict(kw, backend=args.backend, mesh=mesh)
    if args.config is not None:
        op_kw["config"] = PRESETS[args.config]
    try:
        compiled = compile_for_tpu(train_step(**op_kw), *specs)
    except Exception as err:  # reported, not fatal: the other rows still compile
        row.error = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        return row
    mem = compiled.memory_analysis()
    row.argument_bytes = int(getattr(mem, "argument_size_in_bytes", 0))
    row.output_bytes = int(getattr(mem, "output_size_in_bytes", 0))
    row.temp_bytes = int(getattr(mem, "temp_size_in_bytes", 0))
    row.alias_bytes = int(getattr(mem, "alias_size_in_bytes", 0))
    row.code_bytes = int(getattr(mem, "generated_code_size_in_bytes", 0))
    peak = getattr(mem, "peak_memory_in_bytes", None)
    row.peak_bytes = int(peak) if peak else None
    row.collectives = collective_summary(compiled.as_text())
    return row


def run(args: ReportArgs) -> list[Row]:
    """Compile every shape of ``args`` for the topology; one :class:`Row` each."""
    mesh = topology_mesh(args.topology, MESH_AXIS)
    return [compile_row(mesh, shape, args) for shape in args.shapes]


def _gib(n: int) -> str:
    return f"{n / 2**30:8.3f}"


def format_rows(rows: Sequence[Row], args: ReportArgs) -> str:
    out = [
        f"gdn2 mesh-report: {args.topology}, backend {args.backend}, {args.dtype} inputs, "
        f"value_and_grad of sum(o*do)+sum(h_final*dh) in q,k,v,w,b,g,h0",
        f"{'layout':<8} {'shape':<30} {'args GiB':>9} {'out GiB':>9} {'temp GiB':>9} "
        f"{'code GiB':>9} {'peak GiB':>9} {'per-chip GiB':>12}  collectives (largest)",
    ]
    for r in rows:
        if r.error:
            out.append(f"{r.shape.mode:<8} {r.shape.describe():<30} FAILED: {r.error}")
            continue
        big = max(r.collectives, key=lambda c: c.bytes, default=None)
        coll = f"{len(r.collectives)} ({big})" if big else "none"
        out.append(
            f"{r.shape.mode:<8} {r.shape.describe():<30} {_gib(r.argument_bytes):>9} "
            f"{_gib(r.output_bytes):>9} {_gib(r.temp_bytes):>9} {_gib(r.code_bytes):>9} "
            f"{_gib(r.peak_bytes or 0):>9} {_gib(r.per_chip_bytes):>12}  "
            f"{coll}"
        )
    out.append(
        "per-chip = max(XLA's peak, args + out - aliased + temp + code), from memory_analysis() of "
        "the partitioned program"
    )
    for r in rows:
        if r.error or r.shape.mode != "context":
            continue
        p, sh = r.chips, r.shape
        summ = 4 * p * sh.B * sh.H * sh.d * 2 * sh.d
        total = sum(c.bytes for c in r.collectives)
        shard = 6 * sh.B * (sh.T // p) * sh.H * sh.d * (2 if args.dtype == "bfloat16" else 4)
        out.append(
            f"context: {len(r.collectives)} collectives, {total / 2**20:.2f} MiB in all (forward "
            f"all-gathers of the state summaries, P*B*H*dk*(dk+dv)*4 = {summ / 2**20:.2f} MiB, "
            f"their backward reduce-scatters, and dk x dv psums); independent of T. "
            f"For scale: one chip's q..g shard is {shard / 2**20:.2f} MiB"
        )
    return "\n".join(out)


def _shape(text: str) -> Shape:
    """``mode:B,T,H,d``, e.g. ``batch:8,4096,6,128``."""
    try:
        mode, dims = text.split(":")
        B, T, H, d = (int(x) for x in dims.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected mode:B,T,H,d, got {text!r}") from err
    if mode not in ("batch", "context"):
        raise argparse.ArgumentTypeError(f"mode must be batch or context, got {mode!r}")
    return Shape(mode, B, T, H, d)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gdn2 mesh-report``.

    Args:
        argv: the arguments after ``gdn2 mesh-report``.

    Returns:
        0; 1 when a shape failed to compile; 2 without libtpu or without a backend for a TPU.
    """
    parser = argparse.ArgumentParser(
        prog="gdn2 mesh-report",
        description="Per-chip HBM of the sharded GDN-2 train step, compiled deviceless for TPU.",
    )
    parser.add_argument("--topology", default="v5e:2x4", help="TPU topology (default v5e:2x4)")
    parser.add_argument(
        "--backend",
        default=None,
        help="gdn2 backend (default: the one backend='auto' picks for a TPU train step); "
        f"{ReferenceBackend.name!r} registers the token-serial reference",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--config", default=None, help="KernelConfig preset (e.g. LONG_CHUNKS)")
    parser.add_argument(
        "--shape",
        action="append",
        type=_shape,
        help="mode:B,T,H,d (repeatable); default batch:8,4096,6,128 and context:1,32768,6,128",
    )
    ns = parser.parse_args(list(argv) if argv is not None else None)
    problem = missing("libtpu", extra="tpu", why="gdn2 mesh-report")
    if problem:
        parser.exit(2, f"{parser.prog}: {problem}\n")
    shapes = tuple(ns.shape) if ns.shape else DEFAULT_SHAPES
    from gdn2core.registry import BackendNotFoundError, register_backend

    backend = ns.backend
    if backend == ReferenceBackend.name:
        register_backend(ReferenceBackend(), replace=True)
    elif backend is None:
        try:
            backend = default_backend(shapes[0], ns.dtype, ns.config)
        except BackendNotFoundError as err:
            parser.exit(2, f"{parser.prog}: {err}\n")
    args = ReportArgs(
        topology=ns.topology, backend=backend, dtype=ns.dtype, config=ns.config, shapes=shapes
    )
    rows = run(args)
    print(format_rows(rows, args))
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
