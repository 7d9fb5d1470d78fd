"""TPU time without a TPU: the static cycle estimate of libtpu's compiler, per compiled op.

With ``--xla_jf_dump_static_llo_profile_to=DIR`` in ``LIBTPU_INIT_ARGS``, the deviceless TPU
compile writes one textproto per compiled HLO op holding ``estimated_cycles``: a simulation of the
op's LLO program (for a Pallas kernel, its whole grid and in-kernel loops). It is a compiler
estimate, not a measurement: on matmul- and HBM-bound XLA ops it lands within about 5% of the peak
rates, and on a real kernel it has been about 1.3x optimistic, so compare ratios, not absolutes.

How this module turns the dump into a time:

- Ops inside an XLA ``while`` loop are profiled once per iteration; they are multiplied by the
  loop's trip count, read from the compiled HLO (``known_trip_count``, else the ``i < N`` of the
  loop condition).
- Cycles become milliseconds at the chip's clock (:data:`CLOCK_HZ`).
- Ops whose DMAs the profiler classifies as remote get 0 cycles: they are reported as
  ``unmodelled``, with XLA's own fusion cost model as a rough figure and their HBM bytes
  (:func:`hbm_bytes`), which ``gdn2 tpu-report --estimate`` prices at the chip's HBM bandwidth.
  Every op's bytes are kept (a Mosaic kernel's from its own ``CostEstimate``), so a kernel's
  strided DMAs, which the profiler prices at 0, can be bounded by its bytes too. Ops on which the profiler
  aborts are reported as ``unprofiled`` (the compile is repeated profiling only the others),
  unless their profile was written before the abort (some aborts come from a type check that
  runs after the simulation): then the estimate is kept.
- The simulation of a kernel's grid needs memory per grid step (tens of MB; a full train-shape
  compile can need more than 20 GB), so :func:`estimate_fit` simulates the Pallas kernels at small
  ``(B, T)`` and extrapolates them linearly in ``B * T`` (their grids are linear in it; the fit
  residual is reported), while the XLA ops are profiled at the requested shape itself.

Every compile runs in a child process (``python -m gdn2_tools.static_profile``), which compiles
the public op of a backend through :func:`gdn2_tools.tpu.compile_op`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Final

from gdn2_tools.chips import CHIPS
from gdn2_tools.hlo import mosaic_kernels

#: Clock of a TensorCore (chips.py: how each is derived, and where HBM time is not modelled).
CLOCK_HZ: Final = {name: chip.clock_hz for name, chip in CHIPS.items()}
PROFILE_FLAG: Final = "--xla_jf_dump_static_llo_profile_to="
ONLY_FLAG: Final = "--xla_jf_dump_only_matching_hlo="
NO_MSA_FLAG: Final = "--xla_msa_enable=false"
#: The longest Pallas kernel program (one grid step, every branch of it, in bundles of the
#: compiler's schedule) measured on a TPU v5e within 4% of its static estimate; every program of
#: 69,237 bundles or more measured there ran 2.2x to 2.4x as long as its estimate or as the same
#: work in a shorter program (docs/results.md, "A fourth run" and "A fifth run on a TPU v5e").
#: The profile does not price what makes a long program slow.
LONGEST_FAST_PROGRAM: Final = 62_881
LABEL: Final = "TPU compiler static cycle estimate (libtpu LLO profile), not a measurement"


@dataclasses.dataclass(frozen=True)
class Program:
    """What to compile: one backend's forward, train step or decode step through the public op.

    ``value_heads`` HV (0: H): grouped value heads (b, g on the H key heads, or with
    ``value_gates`` on the HV value heads). For
    ``mode="decode"``: ``B`` is the number of sequences N, ``T`` the tokens per sequence S,
    ``H`` the key heads, ``value_heads`` HV (0: H), b and g on the H key heads (or the HV value
    heads with ``value_gates``), and the pool is ``pool_dtype`` with one slot per sequence,
    donated (:func:`gdn2_tools.tpu.compile_decode`)."""

    backend: str
    mode: str  # "forward", "chunk-states" (return_chunk_states), "train" or "decode"
    B: int
    T: int
    H: int
    dk: int
    dv: int
    dtype: str
    config: str = "default"  # "default" or a gdn2core.PRESETS name
    value_heads: int = 0
    value_gates: bool = False  # b, g on the value heads (else on the key heads)
    pool_dtype: str = "float32"
    segments: bool = False  # forward/train: with segment_ids (packed sequences)
    gate: str = ""  # the fused gate, "softplus" or a lower bound ("-5"); "" none (decode: with
    #   the q/k L2 norm and b/w sigmoids too, gdn2_tools.tpu.compile_decode)
    gates: str = ""  # forward/train: scalar gates as KDA ("kda": b, w) or GDN ("gdn": b, w, g)
    #   call the op (gdn2_tools.tpu.SCALAR_GATES); "" the per-channel gates of GDN-2
    decay_dtype: str = ""  # forward/train: g's dtype, "" the inputs' ("float32" beside bfloat16)

    def at(self, B: int, T: int) -> Program:
        return dataclasses.replace(self, B=B, T=T)


@dataclasses.dataclass
class OpCycles:
    name: str
    cycles: int  # per execution
    runs: int  # times it executes (while-loop trip counts)
    kernel: bool  # a Mosaic (Pallas) kernel
    unmodelled: bool = False  # remote DMA: the profiler says 0
    cost_model_cycles: int = 0  # XLA's fusion cost model, for unmodelled ops
    fit: dict | None = None  # extrapolation details
    equivalents: int = 1  # the identical ops this profile stands for (read_profiles), itself too
    bundles: int | None = None  # a kernel's program length in the compiler's schedule (one grid
    #   step, every branch; :func:`estimate` with ``bundles``)

    @property
    def times(self) -> int:
        """Executions of the op and its equivalents."""
        return self.runs * self.equivalents

    @property
    def total(self) -> int:
        return self.cycles * self.times


@dataclasses.dataclass
class Estimate:
    program: Program
    tpu: str
    ops: list[OpCycles]
    temp_bytes: int | None
    unprofiled: dict[str, str]
    loops_without_trip_count: list[str]
    error: str | None = None
    op_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # HBM bytes per run of
    #   each op of the compiled program (:func:`hbm_bytes`)

    @property
    def cycles(self) -> int:
        return sum(op.total for op in self.ops)

    @property
    def kernel_cycles(self) -> int:
        return sum(op.total for op in self.ops if op.kernel)

    def ms(self, cycles: int | None = None) -> float:
        return (self.cycles if cycles is None else cycles) / CLOCK_HZ[self.tpu] * 1e3

    @property
    def unmodelled(self) -> list[OpCycles]:
        return [op for op in self.ops if op.unmodelled]

    @property
    def trustworthy(self) -> bool:
        """No kernel left out of the estimate (unprofiled or unmodelled) and no loop miscounted."""
        bad_kernels = [op for op in self.unmodelled if op.kernel]
        return not (self.error or self.unprofiled or bad_kernels or self.loops_without_trip_count)


# -------------------------------------------------------------------------------------------------
# Reading the dumps
# -------------------------------------------------------------------------------------------------
def read_profiles(directory: str) -> dict[str, tuple[int, str, int]]:
    """``{hlo op: (estimated cycles, DMA type, equivalents)}`` from the profile textprotos in
    ``directory``. ``equivalents`` is the profile's ``num_equivalent_hlos``: the profiler
    simulates identical ops (the same computation on the same shapes, e.g. the four broadcasts
    that repeat q, k, b and g of a decode step to the value heads) once, under one op's name, and
    writes no profile for the others; so the profile stands for that many executions. (They are
    counted at the named op's while-loop runs.)"""
    pattern = re.compile(
        r'hlo_op_name: "([^"]+)"\s+estimated_cycles: (\d+)(?:\s+num_equivalent_hlos: (\d+))?'
        r"(?:\s+dma_instruction_type: (\w+))?"
    )
    found = {}
    for path in glob.glob(os.path.join(directory, "*static_llo_profile.textproto")):
        with open(path) as f:
            for name, cycles, same, dma in pattern.findall(f.read()):
                found[name] = (
                    int(cycles),
                    dma.replace("DMA_INSTRUCTION_TYPE_", ""),
                    int(same or 1),
                )
    return found


def profiled_ops(directory: str, hlo: str, kernels: Sequence[str]) -> list[OpCycles]:
    """The ops of the profile in ``directory`` (:func:`read_profiles`), with their runs from the
    compiled ``hlo`` (:func:`run_counts`); ``kernels``: the Mosaic kernels' op names. An op the
    profiler prices at 0 cycles as a remote DMA is marked unmodelled, with XLA's cost model."""
    runs, _ = run_counts(hlo)
    cost_model = fusion_cost_model(hlo)
    ops = []
    for name, (cycles, dma, same) in read_profiles(directory).items():
        op = OpCycles(name, cycles, runs.get(name, 1), name in kernels, equivalents=same)
        if cycles == 0 and "REMOTE" in dma:
            op.unmodelled, op.cost_model_cycles = True, cost_model.get(name, 0)
        ops.append(op)
    return ops


def fusion_cost_model(hlo: str) -> dict[str, int]:
    """``{op: cycles}`` of XLA's own fusion cost model (``window_config.estimated_cycles``)."""
    pattern = r'^\s*(?:ROOT )?%(\S+) = [^\n]*?"window_config":\{[^}]*?"estimated_cycles":"(\d+)"'
    return {name: int(c) for name, c in re.findall(pattern, hlo, re.M)}


#: Bytes per element of the HLO element types.
_ELEMENT_BYTES: Final = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                         "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}  # fmt: skip
_OP_LINE = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (an array ``bf16[8,128]{...}`` or a tuple of them)."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _ELEMENT_BYTES.get(dtype, 0)
    return total


#: Ops that move no bytes of their own (views, tuples, constants).
_NO_TRAFFIC: Final = frozenset(
    {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all", "partition-id"}
)


def _computations(hlo: str) -> dict[str, tuple[dict[str, int], list[re.Match]]]:
    """``{computation: ({parameter: bytes}, [its op lines' matches of _OP_LINE])}``."""
    found: dict[str, tuple[dict[str, int], list[re.Match]]] = {}
    current = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) \((.*)\) -> .*\{\s*$", line)
        if head:
            params = re.findall(r"([\w.\-]+): ((?:\([^)]*\))|[a-z]+\d*\[[\d,]*\])", head.group(2))
            current = head.group(1)
            found[current] = ({n: shape_bytes(sh) for n, sh in params}, [])
            continue
        m = _OP_LINE.match(line)
        if m and current is not None:
            found[current][1].append(m)
    return found


def _operands(rest: str) -> list[str]:
    return re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])


#: Ops that view a value without moving it: a slice of the view is a slice of the value.
_VIEWS: Final = frozenset({"bitcast", "get-tuple-element"})


def _param_use(comp: str, comps, memo) -> dict[str, tuple[int | None, int]]:
    """How computation ``comp`` touches each of its parameters: ``{parameter: (bytes read, None
    for all of it; bytes written into it in place)}``. A dynamic slice reads its slice, a
    dynamic-update-slice writes its update into its buffer (the buffer itself is not read), a
    nested fusion touches a parameter as its own body does, anything else reads all of it."""
    if comp in memo:
        return memo[comp]
    params, body = comps[comp]
    shapes = {**params, **{m.group(1): shape_bytes(m.group(2)) for m in body}}
    alias: dict[str, str] = {}
    read: dict[str, int | None] = {}
    written: dict[str, int] = {}

    def root(a: str) -> str:
        while a in alias:
            a = alias[a]
        return a

    def reads(a: str, n: int | None) -> None:
        a = root(a)
        old = read.get(a, 0)
        read[a] = None if n is None or old is None else old + n

    for m in body:
        name, shape, opcode, rest = m.groups()
        args = _operands(rest)
        if opcode in _VIEWS and args:
            alias[name] = args[0]
        elif opcode == "dynamic-slice" and args:
            reads(args[0], shape_bytes(shape))
            for a in args[1:]:
                reads(a, None)
        elif opcode == "dynamic-update-slice" and len(args) > 1:
            written[root(args[0])] = written.get(root(args[0]), 0) + shapes.get(root(args[1]), 0)
            for a in args[1:]:
                reads(a, None)
        elif opcode == "fusion" and re.search(r"calls=%([\w.\-]+)", m.string):
            callee = re.search(r"calls=%([\w.\-]+)", m.string).group(1)
            inner = _param_use(callee, comps, memo) if callee in comps else {}
            for a, p in zip(args, _param_order(comps.get(callee)), strict=False):
                r, w = inner.get(p, (None, 0))
                reads(a, r)
                if w:
                    written[root(a)] = written.get(root(a), 0) + w
        elif opcode not in _NO_TRAFFIC:
            for a in args:
                reads(a, None)
    memo[comp] = {p: (read.get(p, 0), written.get(p, 0)) for p in params}
    return memo[comp]


def _param_order(comp) -> list[str]:
    """The parameters of a computation in their order (``parameter(i)``)."""
    if comp is None:
        return []
    order = {
        int(re.search(r"parameter\((\d+)\)", m.string).group(1)): m.group(1)
        for m in comp[1]
        if m.group(3) == "parameter"
    }
    return [order[i] for i in sorted(order)]


def hbm_bytes(hlo: str) -> dict[str, int]:
    """``{op: HBM bytes per run}`` of the compiled HLO's ops: a Mosaic kernel's own
    ``CostEstimate.bytes_accessed``; an XLA op's result and operands, where an operand read by
    dynamic slices counts the slices and a buffer updated in place (dynamic-update-slice, as in a
    loop's carry) counts only the update, through nested fusions; views and tuples count nothing.
    An estimate: it assumes every operand comes from HBM once."""
    comps = _computations(hlo)
    shapes: dict[str, int] = {}
    for params, ops in comps.values():
        shapes.update(params)
        shapes.update((m.group(1), shape_bytes(m.group(2))) for m in ops)
    memo: dict = {}
    found: dict[str, int] = {}
    for _, ops in comps.values():
        for m in ops:
            name, shape, opcode, rest = m.groups()
            kernel = re.search(r'"bytes_accessed":"(\d+)"', m.string)
            if kernel and 'custom_call_target="tpu_custom_call"' in m.string:
                found[name] = int(kernel.group(1))
                continue
            if opcode in _NO_TRAFFIC:
                found[name] = 0
                continue
            # the op as a computation of its own: a fusion's body, else the op alone
            callee = re.search(r"calls=%([\w.\-]+)", m.string) if opcode == "fusion" else None
            args = _operands(rest)
            if callee and callee.group(1) in comps:
                use = _param_use(callee.group(1), comps, memo)
                names = _param_order(comps[callee.group(1)])
            else:  # an op of its own: a dynamic slice reads its slice, an update writes its update
                names = [f"arg{i}" for i in range(len(args))]
                use = {n: (None, 0) for n in names}
                if opcode == "dynamic-slice" and args:
                    use["arg0"] = (shape_bytes(shape), 0)
                elif opcode == "dynamic-update-slice" and len(args) > 1:
                    use["arg0"] = (0, shapes.get(args[1], 0))
            total = shape_bytes(shape)
            for a, p in zip(args, names, strict=False):
                r, w = use.get(p, (None, 0))
                total += shapes.get(a, 0) if r is None else r
                if w:  # updated in place: the result is that buffer, only the update is written
                    total += w - shapes.get(a, 0)
            found[name] = max(total, 0)
    return found


def run_counts(hlo: str) -> tuple[dict[str, int], list[str]]:
    """``({op: times it runs}, [while loops without a known trip count])`` from compiled HLO text:
    a while body runs trip-count times per run of its caller."""
    computation_of: dict[str, str] = {}
    callers: dict[str, list[tuple[str, int]]] = {}
    bodies: dict[str, list[str]] = {}
    whiles = []
    entry, current = None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) ", line)
        if head and line.rstrip().endswith("{"):
            current = head.group(2)
            bodies[current] = []
            entry = current if head.group(1) else entry
            continue
        op = re.match(r"^\s*(?:ROOT )?%(\S+) = ", line)
        if not op or current is None:
            continue
        computation_of[op.group(1)] = current
        bodies[current].append(line)
        loop = re.search(r"condition=%([\w.\-]+), body=%([\w.\-]+)", line)
        if loop:
            whiles.append((current, op.group(1), loop.group(1), loop.group(2), line))
            continue
        for callee in re.findall(
            r"(?:calls|to_apply|true_computation|false_computation)=%([\w.\-]+)", line
        ):
            callers.setdefault(callee, []).append((current, 1))
        for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
            for callee in re.findall(r"%([\w.\-]+)", group):
                callers.setdefault(callee, []).append((current, 1))
    unknown = []
    for caller, name, cond, body, line in whiles:
        trip = None
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        if known:
            trip = int(known.group(1))
        else:
            inner = re.findall(r"calls=%([\w.\-]+)", "\n".join(bodies.get(cond, [])))
            text = "\n".join(ln for c in [cond, *inner] for ln in bodies.get(c, []))
            consts = dict(re.findall(r"%(\S+) = s32\[\]\S* constant\((-?\d+)\)", text))
            bound = re.search(r"compare\(%\S+, %(\S+)\), direction=LT", text)
            if bound and bound.group(1).rstrip(",") in consts:
                trip = int(consts[bound.group(1).rstrip(",")])
        if trip is None:
            unknown.append(name)
        callers.setdefault(body, []).append((caller, trip or 1))
        callers.setdefault(cond, []).append((caller, (trip or 0) + 1))
    memo: dict[str, int] = {}

    def runs(computation: str) -> int:
        if computation not in memo:
            memo[computation] = (
                1
                if computation == entry
                else sum(runs(c) * n for c, n in callers.get(computation, []))
            )
        return memo[computation]

    return {name: runs(comp) for name, comp in computation_of.items()}, unknown


def preset(name: str):
    """The ``KernelConfig`` a tool's ``--config`` name stands for (:attr:`Program.config`):
    ``"default"`` is ``DEFAULT_CONFIG``, any other name a ``gdn2core.PRESETS`` entry."""
    from gdn2core import DEFAULT_CONFIG, PRESETS

    return DEFAULT_CONFIG if name == "default" else PRESETS[name]


# -------------------------------------------------------------------------------------------------
# Compiling in a child process
# -------------------------------------------------------------------------------------------------
def _child_main(argv: Sequence[str]) -> int:
    """``python -m gdn2_tools.static_profile PROGRAM_JSON TPU WORKDIR``: compile and write
    ``hlo.txt`` and ``meta.json`` (the profile itself is written by libtpu)."""
    program, tpu, work = Program(**json.loads(argv[0])), argv[1], argv[2]
    from gdn2_tools.tpu import TOPOLOGIES, compile_decode, compile_op

    config = preset(program.config)
    if program.mode == "decode":
        compiled = compile_decode(
            program.backend, TOPOLOGIES[tpu], program.B, program.T, program.H,
            program.value_heads or program.H, program.dk, program.dv, program.dtype,
            program.pool_dtype, config=config, gate=program.gate,
            gate_heads=program.value_heads if program.value_gates else None,
        )  # fmt: skip
    else:
        compiled = compile_op(
            program.backend, TOPOLOGIES[tpu], program.mode,
            program.B, program.T, program.H, program.dk, program.dv, program.dtype, config,
            segments=program.segments, value_heads=program.value_heads,
            value_gates=program.value_gates, gate=program.gate,
            gates=program.gates, decay_dtype=program.decay_dtype,
        )  # fmt: skip
    hlo = compiled.as_text()
    with open(os.path.join(work, "hlo.txt"), "w") as f:
        f.write(hlo)
    kernels = mosaic_kernels(hlo)
    memory = compiled.memory_analysis()
    meta = {"kernels": kernels, "temp_bytes": memory.temp_size_in_bytes if memory else None}
    with open(os.path.join(work, "meta.json"), "w") as f:
        json.dump(meta, f)
    return 0


def _rss_gb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 2**20
    except (OSError, StopIteration):
        return 0.0


#: Seconds between truncations of libtpu's logs while a compile runs (:func:`_trim_logs`).
LOG_TRIM_S: Final = 5.0


def _trim_logs(logs: str) -> None:
    """Truncate libtpu's log files in ``logs`` to 0 bytes. With the profiler on, a large program
    (jax_ref at 32 heads) logs tens of GB during one compile; the estimate reads none of it. A
    truncated file keeps its writer's offset, so later writes leave a hole that takes no disk."""
    for name in os.listdir(logs):
        with contextlib.suppress(OSError):  # gone, or not a file
            os.truncate(os.path.join(logs, name), 0)


def _compile_child(program, tpu, work, flags, timeout_s, max_rss_gb) -> tuple[int | str, str]:
    logs = os.path.join(work, "logs")
    os.makedirs(logs, exist_ok=True)
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        ALLOW_MULTIPLE_LIBTPU_LOAD="1",
        # With the profiler on, libtpu logs about 1 GB per compile, to TPU_LOG_DIR or, with it
        # disabled, to TMPDIR: both point into the work folder, which estimate() removes.
        TPU_LOG_DIR=logs,
        TMPDIR=work,
        LIBTPU_INIT_ARGS=" ".join([env.get("LIBTPU_INIT_ARGS", ""), *flags]).strip(),
    )
    cmd = [sys.executable, "-m", "gdn2_tools.static_profile", json.dumps(dataclasses.asdict(program)), tpu, work]  # fmt: skip
    start = time.time()
    with open(os.path.join(work, "stderr.txt"), "w+") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
        trimmed = start
        while (code := proc.poll()) is None:
            time.sleep(0.5)
            if time.time() - trimmed > LOG_TRIM_S:
                _trim_logs(logs)
                trimmed = time.time()
            if _rss_gb(proc.pid) > max_rss_gb or time.time() - start > timeout_s:
                proc.kill()
                proc.wait()
                code = f"stopped (over {max_rss_gb} GB or {timeout_s} s)"
                break
        log.seek(0)
        return code, log.read()


def llo_dump_flags(directory: str) -> list[str]:
    """libtpu flags that write each compiled op's LLO program to ``directory`` after every pass,
    among them the per-bundle slot use of the scheduled program (gdn2_tools.llo_utilization)."""
    return [f"--xla_jf_dump_to={directory}", "--xla_jf_dump_llo_text=true"]


def program_bundles(directory: str, op: str) -> int | None:
    """The bundles of ``op``'s scheduled program in the LLO dump in ``directory``
    (:func:`llo_dump_flags`), or None without its utilization file."""
    from gdn2_tools import llo_utilization  # it reads the dump; it imports this module

    u = llo_utilization.read_dump(directory, op)
    return None if u is None else u.bundles


def estimate(
    program: Program,
    tpu: str,
    *,
    kernels: bool = True,
    xla_ops: bool = True,
    extra_flags: Sequence[str] = (),
    timeout_s: float = 1800,
    max_rss_gb: float = 12.0,
    bundles: bool = False,
) -> Estimate:
    """Compile ``program`` for ``tpu`` in a child process and read its static profile.

    Args:
        program: what to compile.
        tpu: a chip of :data:`gdn2_tools.chips.CHIPS` (``"v5e"``, ``"v6e"``, ``"v5p"``).
        kernels: profile the Pallas kernels.
        xla_ops: profile the XLA ops.
        extra_flags: more libtpu flags.
        timeout_s: stop the child after this long.
        max_rss_gb: stop the child above this resident memory.
        bundles: also dump the programs' LLO and give each kernel its bundle count
            (:attr:`OpCycles.bundles`); meant with ``xla_ops=False`` (the dump then holds only the
            kernels).

    Returns:
        The :class:`Estimate` (``error`` set when the compile failed).
    """
    work = tempfile.mkdtemp(prefix="gdn2_profile_")
    try:
        return _estimate_in(
            work, program, tpu, kernels, xla_ops, extra_flags, timeout_s, max_rss_gb, bundles
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _estimate_in(work, program, tpu, kernels, xla_ops, extra_flags, timeout_s, max_rss_gb,
                 bundles=False):  # fmt: skip
    profile_dir = os.path.join(work, "profile")
    llo_dir = os.path.join(work, "llo")
    if bundles:
        extra_flags = [*extra_flags, *llo_dump_flags(llo_dir)]
    only: str | None = None
    if not (kernels and xla_ops):  # a plain compile names the ops to profile
        code, log = _compile_child(program, tpu, work, list(extra_flags), timeout_s, max_rss_gb)
        if code != 0:
            return Estimate(program, tpu, [], None, {}, [], error=_tail(log, code))
        names = re.findall(r"^\s*(?:ROOT )?%(\S+) = ", _read(work, "hlo.txt"), re.M)
        kernel_names = set(json.loads(_read(work, "meta.json"))["kernels"])
        chosen = [n for n in names if (n in kernel_names) == kernels]
        only = ";".join(f"{n}=true" for n in chosen)
    unprofiled: dict[str, str] = {}
    for _ in range(6):  # each round drops the ops the profiler aborted on
        flags = [*extra_flags, PROFILE_FLAG + profile_dir] + ([ONLY_FLAG + only] if only else [])
        code, log = _compile_child(program, tpu, work, flags, timeout_s, max_rss_gb)
        crashed = dict(re.findall(r"Static LLO profiling of (\S+) failed: ([^\n]*)", log))
        check = re.search(r"LLO_CHECK failure[^\n]*", log)  # the profiler's own type check
        if check:
            crashed.update((n, check.group(0)) for n in re.findall(r" in HLO \[([^\]]+)\]", log))
        if code == 0 or not crashed:
            break
        unprofiled.update(crashed)
        if not os.path.exists(os.path.join(work, "hlo.txt")):  # the abort came before the child
            # wrote the HLO: a compile without the profiler names the ops
            code, log = _compile_child(program, tpu, work, list(extra_flags), timeout_s, max_rss_gb)
            if code != 0:
                break
        names = re.findall(r"^\s*(?:ROOT )?%(\S+) = ", _read(work, "hlo.txt"), re.M)
        done = read_profiles(profile_dir)
        todo = [n for n in names if n not in done and n not in unprofiled]
        if only is not None:
            todo = [n for n in todo if f"{n}=true" in only.split(";")]
        if not todo:
            code = 0
            break
        only = ";".join(f"{n}=true" for n in todo)
    if code != 0 or not os.path.exists(os.path.join(work, "meta.json")):
        return Estimate(program, tpu, [], None, unprofiled, [], error=_tail(log, code))
    hlo = _read(work, "hlo.txt")
    meta = json.loads(_read(work, "meta.json"))
    _, unknown_loops = run_counts(hlo)
    ops = profiled_ops(profile_dir, hlo, meta["kernels"])
    for op in ops if bundles else ():
        if op.kernel:
            op.bundles = program_bundles(llo_dir, op.name)
    profiled = {op.name for op in ops}
    unprofiled = {k: v for k, v in unprofiled.items() if k not in profiled}
    return Estimate(program, tpu, ops, meta["temp_bytes"], unprofiled, unknown_loops,
                    op_bytes=hbm_bytes(hlo))  # fmt: skip


def _read(work: str, name: str) -> str:
    with open(os.path.join(work, name)) as f:
        return f.read()


def _tail(log: str, code) -> str:
    lines = [ln for ln in log.splitlines() if ln.strip() and "TPU_WORKER" not in ln]
    return f"compile child exit {code}: " + " | ".join(lines[-4:])


def fit_line(xs: Sequence[float], ys: Sequence[float], x: float) -> tuple[float, float, float]:
    """Least squares ``y = a + b x``: (prediction at ``x``, slope, largest relative residual)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((u - mx) * (v - my) for u, v in zip(xs, ys, strict=True)) / sum(
        (u - mx) ** 2 for u in xs
    )
    a = my - slope * mx
    resid = max(abs(a + slope * u - v) / max(v, 1) for u, v in zip(xs, ys, strict=True))
    return a + slope * x, slope, resid


def estimate_fit(program: Program, tpu: str, points: Sequence[tuple[int, int]], **kw) -> Estimate:
    """The XLA ops of ``program`` profiled at its own shape; its Pallas kernels simulated at the
    ``(B, T)`` ``points`` (with XLA's memory-space assignment off, so that kernel operands stay
    in HBM as at full size) and extrapolated linearly in ``B * T``.

    Args:
        program: the program at the size to report.
        tpu: a chip of :data:`gdn2_tools.chips.CHIPS` (``"v5e"``, ``"v6e"``, ``"v5p"``).
        points: at least two small ``(B, T)`` shapes.
        **kw: passed to :func:`estimate`.

    Returns:
        The combined :class:`Estimate`; each kernel's ``fit`` holds its points and residual, and
        its ``bundles`` the length of its program at the middle point (a kernel's program is
        one grid step: its length does not grow with the shape).
    """
    target = estimate(program, tpu, kernels=False, **kw)
    if target.error:
        return target
    small = [
        estimate(program.at(b, t), tpu, xla_ops=False, extra_flags=[NO_MSA_FLAG],
                 bundles=i == len(points) // 2, **kw)
        for i, (b, t) in enumerate(points)
    ]  # fmt: skip
    for s in small:
        if s.error:
            target.error = f"fit point B={s.program.B} T={s.program.T}: {s.error}"
            return target
        target.unprofiled.update(s.unprofiled)
    x = program.B * program.T
    kernel_names = {op.name for s in small for op in s.ops if op.kernel}
    for name in sorted(kernel_names):
        pts = [
            (s.program.B * s.program.T, op.total) for s in small for op in s.ops if op.name == name
        ]
        if len(pts) < 2:
            target.error = f"kernel {name}: fewer than two fit points"
            continue
        cycles, per_token, resid = fit_line([p for p, _ in pts], [c for _, c in pts], x)
        length = [op.bundles for s in small for op in s.ops if op.name == name and op.bundles]
        target.ops.append(
            OpCycles(
                name, round(cycles), 1, True,
                fit={"points": pts, "cycles_per_token": per_token, "max_rel_residual": resid},
                bundles=length[0] if length else None,
            )
        )  # fmt: skip
    return target


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
