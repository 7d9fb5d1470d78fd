"""The bench loop: for each shape, dtype and row, compile, run once, gate, then time.

Rows are chosen by what the backends declare, never by name: every backend whose verdict here is
yes (``--interpret`` adds those that run off their platform in interpret mode). Baselines are
``reference_grad`` and every named-only backend (``Capabilities(auto=False)``); the trusted
backend (the gate's fallback, :mod:`gdn2_tools.bench.gate`) is the one ``backend="auto"`` picks
here. Rows at one (shape, dtype) run in the order reference_grad, the trusted backend, then the
others, so that the baselines and the fallback exist before they are needed. Speed-ups over each
baseline come from the medians of this same run.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gdn2_tools.bench import gate as gate_mod
from gdn2_tools.bench.inputs import GRAD_NAMES, make_inputs, make_options
from gdn2_tools.bench.programs import (
    MODES,
    REFERENCE_ROW,
    Programs,
    programs_for,
    reference_programs,
)
from gdn2_tools.bench.shapes import BenchShape
from gdn2_tools.bench.timing import (
    Timing,
    compile_program,
    run_once,
    time_pipelined,
    time_repeats,
)
from gdn2core import registry
from gdn2core.config import DEFAULT_CONFIG, KernelConfig
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.platform import default_platform, device_memory_bytes
from gdn2core.selection import resolve_backend
from gdn2core.verdict import judge


def baselines() -> tuple[str, ...]:
    """The rows speed-ups are measured against: reference_grad and every named-only backend.

    Returns:
        Row names.
    """
    named_only = [b.name for b in registry.usable_backends() if not b.capabilities.auto]
    return (REFERENCE_ROW, *sorted(named_only))


def trusted_backend(dtype: str = "float32") -> str | None:
    """The backend ``backend="auto"`` picks here for a trainable call (the gate's fallback).

    Args:
        dtype: the call's dtype.

    Returns:
        Its name, or None when no backend would run such a call.
    """
    spec = OpSpec(1, 64, 1, 64, 64, dtype, 0.125)
    try:
        return resolve_backend(spec, DEFAULT_CONFIG, "auto", trainable=True).name
    except registry.BackendNotFoundError:
        return None


@dataclasses.dataclass
class RowResult:
    backend: str
    shape: BenchShape
    dtype: str
    status: str  # "ok" | "rejected" | "skipped" | "error"
    reason: str = ""
    gate: gate_mod.GateResult | None = None
    modes: dict[str, Timing] = dataclasses.field(default_factory=dict)
    speedup: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    source: str = "this run"

    def median(self, mode: str) -> float | None:
        t = self.modes.get(mode)
        return t.median_s if (t is not None and t.times_s) else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "shape": self.shape.as_dict(),
            "dtype": self.dtype,
            "status": self.status,
            "reason": self.reason,
            "gate": None if self.gate is None else self.gate.as_dict(),
            "modes": {m: t.as_dict() for m, t in self.modes.items()},
            "speedup": self.speedup,
            "source": self.source,
        }


@dataclasses.dataclass
class RowPlan:
    """A row and how to run it, or why it is skipped at every shape."""

    name: str
    programs: Programs | None
    skip: str = ""
    config: KernelConfig | None = None


def plan_rows(
    names: Sequence[str] | None, *, interpret: bool = False, config: KernelConfig | None = None
) -> list[RowPlan]:
    """The rows to run, each with its programs or the reason it is skipped.

    Args:
        names: row names (backends or ``reference_grad``); None: reference_grad and every
            installed backend.
        interpret: run backends whose platforms exclude this host in interpret mode, when they
            support it (``Capabilities.interpret``).
        config: the kernel config (None: the default).

    Returns:
        The plans, reference_grad first, then the trusted backend, then the others.
    """
    infos = {i.name: i for i in registry.list_backends() if not i.broken}
    if names is None:
        names = [REFERENCE_ROW, *infos]
    platform = default_platform()
    plans = []
    for name in names:
        if name == REFERENCE_ROW:
            plans.append(RowPlan(name, reference_programs()))
            continue
        try:
            backend = registry.get_backend(name)
        except registry.BackendNotFoundError as err:
            plans.append(RowPlan(name, None, str(err)))
            continue
        cfg = config or DEFAULT_CONFIG
        caps = backend.capabilities
        if interpret and platform not in caps.platforms and caps.interpret:
            cfg = cfg.model_copy(update={"interpret": True})
        answer = judge(backend, None, cfg, trainable=False, auto=False, platform=platform)
        if not answer:
            hint = (
                "; --interpret runs its kernels in interpret mode (very slow)"
                if caps.interpret and not interpret
                else ""
            )
            plans.append(RowPlan(name, None, f"would not run here: {answer.reason}{hint}"))
            continue
        used = cfg if cfg.interpret else config
        plans.append(RowPlan(name, programs_for(name, used), config=used))
    order = {REFERENCE_ROW: 0, trusted_backend(): 1}
    return sorted(plans, key=lambda p: order.get(p.name, 2))


#: Fewest timed runs per program when the time budget cuts the repeats (median and spread of 3).
MIN_REPEATS = 3


def effective_repeats(repeats: int, warm_s: float, budget_s: float | None) -> int:
    """``repeats``, cut so that a program whose warm-up took ``warm_s`` stays within ``budget_s``
    seconds of timed runs, but never below ``MIN_REPEATS`` (nor above ``repeats``)."""
    if budget_s is None or warm_s <= 0:
        return repeats
    return max(min(MIN_REPEATS, repeats), min(repeats, int(budget_s / warm_s)))


def _timed_once(warm: dict[str, float], mode: str, compiled, *args):
    start = time.perf_counter()
    out = run_once(compiled, *args)
    warm[mode] = time.perf_counter() - start
    return out


def _np(tree) -> Any:
    return jax.tree.map(lambda a: np.asarray(jnp.asarray(a, jnp.float32)), jax.device_get(tree))


def _per_mode(expected: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The expected arrays also under the names the fwd-only and bwd-only outputs carry."""
    out = dict(expected)
    for name, x in expected.items():
        out[f"{name} (fwd)"] = out[f"{name} (bwd)"] = x
    return out


def _opts_args(shape: BenchShape, seed: int) -> tuple:
    """The programs' optional last argument for ``shape``: ``(opts,)``, or ``()`` without one."""
    opts = make_options(shape, seed)
    return (opts,) if opts else ()


def _named(o, h, grads) -> dict[str, np.ndarray]:
    out = {"o": o, "h_final": h}
    if grads is not None:
        out.update(dict(zip(GRAD_NAMES, grads, strict=True)))
    return out


class Bench:
    """Runs the plans over shapes and dtypes; ``progress(description)`` is called per unit."""

    def __init__(
        self,
        plans: Sequence[RowPlan],
        shapes: Sequence[BenchShape],
        dtypes: Sequence[str],
        *,
        repeats: int = 5,
        budget_s: float | None = 10.0,
        seed: int = 0,
        progress: Callable[[str], None] | None = None,
        advance: Callable[[], None] | None = None,
        place: Callable | None = None,
    ):
        """``place(xs, h0, cts) -> (xs, h0, cts)``: where the rows' inputs live (e.g. sharded
        over a mesh, ``gdn2 bench --devices``); the trusted results always run unplaced."""
        self.plans = list(plans)
        self.shapes = list(shapes)
        self.dtypes = list(dtypes)
        self.repeats = repeats
        self.budget_s = budget_s
        self.seed = seed
        self.progress = progress or (lambda _d: None)
        self.advance = advance or (lambda: None)
        self.place = place
        self.device_bytes = device_memory_bytes()
        self.platform = default_platform()
        self.trusted_backend = trusted_backend()
        self._trusted: dict[tuple[BenchShape, str], tuple[dict, str] | str] = {}
        self._fallback_checked: dict[tuple[BenchShape, str], gate_mod.GateResult | str] = {}
        self.results: list[RowResult] = []

    # ----------------------------------------------------------------- trusted results
    def _f32_run(self, progs: Programs, shape: BenchShape, dtype: str) -> dict[str, np.ndarray]:
        """fwd+bwd of ``progs`` in float32 at highest matmul precision on dtype-rounded inputs."""
        xs, h0, (do, dh) = make_inputs(shape, dtype, self.seed)
        xs = tuple(x.astype(jnp.float32) for x in xs)
        cts = (do.astype(jnp.float32), dh)
        opts = _opts_args(shape, self.seed)
        with jax.default_matmul_precision("highest"):
            o, h, grads = jax.jit(progs.fwdbwd)(xs, h0, cts, *opts)
        return _named(*_np((o, h, grads)))

    def _check_fallback_small(self, shape: BenchShape, dtype: str) -> gate_mod.GateResult | str:
        small = gate_mod.fallback_shape(shape)
        key = (small, dtype)
        if key not in self._fallback_checked:
            try:
                expected = self._f32_run(reference_programs(), small, dtype)
                got = self._run_programs(self._fallback_programs(), small, dtype, time=False)
                self._fallback_checked[key] = gate_mod.compare(
                    got["outputs"], _per_mode(expected), dtype, f"reference at {small.label}",
                    self.platform,
                )  # fmt: skip
            except Exception as err:
                self._fallback_checked[key] = f"{type(err).__name__}: {err}"
        return self._fallback_checked[key]

    def _fallback_programs(self) -> Programs:
        for p in self.plans:
            if p.name == self.trusted_backend and p.programs is not None:
                return p.programs
        return programs_for(self.trusted_backend)

    def trusted(self, shape: BenchShape, dtype: str) -> tuple[dict, str] | str:
        """``(expected arrays, description)``, or a string saying why there is none."""
        key = (shape, dtype)
        if key in self._trusted:
            return self._trusted[key]
        if gate_mod.reference_affordable(shape, self.device_bytes):
            try:
                result = (self._f32_run(reference_programs(), shape, dtype), "reference")
            except Exception as err:
                result = f"reference failed: {type(err).__name__}: {err}"
        elif self.trusted_backend is None:
            result = "reference autodiff too large here and no backend to fall back on"
        else:
            check = self._check_fallback_small(shape, dtype)
            name = self.trusted_backend
            if isinstance(check, str) or not check.ok:
                msg = check if isinstance(check, str) else check.message
                result = (
                    f"reference autodiff too large here and {name} could not be trusted ({msg})"
                )
            else:
                try:
                    result = (
                        self._f32_run(self._fallback_programs(), shape, dtype),
                        f"{name} float32 (itself {check.message})",
                    )
                except Exception as err:
                    result = f"{name} float32 failed: {type(err).__name__}: {err}"
        self._trusted[key] = result
        return result

    # ----------------------------------------------------------------- one row
    def _run_programs(
        self, progs: Programs, shape: BenchShape, dtype: str, *, time: bool
    ) -> dict[str, Any]:
        """Compile the three modes, run each once (warm-up); with ``time``, also return the
        compile times and a closure that times the repeats."""
        xs, h0, cts = make_inputs(shape, dtype, self.seed)
        if self.place is not None:
            xs, h0, cts = self.place(xs, h0, cts)
        opts = _opts_args(shape, self.seed)  # () for a plain shape: the same programs as before
        c_fwd, t_fwd = compile_program(progs.fwd, xs, h0, *opts)
        c_vjp, t_vjp = compile_program(progs.vjp_fwd, xs, h0, *opts)
        c_fb, t_fb = compile_program(progs.fwdbwd, xs, h0, cts, *opts)
        warm: dict[str, float] = {}
        o_f, h_f = _timed_once(warm, "fwd", c_fwd, xs, h0, *opts)
        _, vjp_fn = run_once(c_vjp, xs, h0, *opts)
        c_bwd, t_bwd = compile_program(progs.bwd, vjp_fn, cts)
        grads_b = _timed_once(warm, "bwd", c_bwd, vjp_fn, cts)
        o, h, grads = _timed_once(warm, "fwdbwd", c_fb, xs, h0, cts, *opts)
        outputs = _named(*_np((o, h, grads)))
        fwd_o, fwd_h = _np((o_f, h_f))
        outputs["o (fwd)"], outputs["h_final (fwd)"] = fwd_o, fwd_h
        for name, gb in zip(GRAD_NAMES, _np(grads_b), strict=True):
            outputs[f"{name} (bwd)"] = gb
        del o_f, h_f, o, h, grads, grads_b
        result: dict[str, Any] = {"outputs": outputs}
        if time:
            result["compile"] = {"fwd": t_fwd, "bwd": t_bwd, "fwdbwd": t_fb, "vjp_fwd": t_vjp}
            programs = {
                "fwd": (c_fwd, (xs, h0, *opts)),
                "bwd": (c_bwd, (vjp_fn, cts)),
                "fwdbwd": (c_fb, (xs, h0, cts, *opts)),
            }

            def timer(repeats: int, budget_s: float | None) -> dict[str, tuple[list[float], float]]:
                """Per mode: the blocking calls' times and the time per call back to back (as
                many calls)."""
                out = {}
                for m, (c, a) in programs.items():
                    n = effective_repeats(repeats, warm[m], budget_s)
                    out[m] = (time_repeats(c, a, n), time_pipelined(c, a, n))
                return out

            result["timer"] = timer
        return result

    def run_row(self, plan: RowPlan, shape: BenchShape, dtype: str) -> RowResult:
        row = RowResult(plan.name, shape, dtype, "skipped")
        if plan.programs is None:
            row.reason = plan.skip
            return row
        if plan.name == REFERENCE_ROW and not gate_mod.reference_affordable(
            shape, self.device_bytes
        ):
            need = gate_mod.reference_bytes(shape) / 2**30
            have = gate_mod.reference_budget(self.device_bytes) / 2**30
            row.reason = f"reference autodiff needs ~{need:.1f} GiB > budget {have:.1f} GiB"
            return row
        try:
            ran = self._run_programs(plan.programs, shape, dtype, time=True)
        except registry.BackendUnsupportedError as err:
            row.reason = str(err)
            return row
        except Exception as err:
            row.status = "error"
            row.reason = f"{type(err).__name__}: {err}"
            row.reason += (
                "\n" + traceback.format_exc(limit=3) if os.environ.get("GDN2_DEBUG") else ""
            )
            return row
        trusted = self.trusted(shape, dtype)
        if isinstance(trusted, str):
            row.status = "rejected"
            row.reason = f"no trusted result to gate against: {trusted}"
            return row
        expected, against = trusted
        row.gate = gate_mod.compare(
            ran["outputs"], _per_mode(expected), dtype, against, self.platform
        )
        if not row.gate.ok:
            row.status = "rejected"
            row.reason = row.gate.message
            return row
        try:
            times = ran["timer"](self.repeats, self.budget_s)
        except Exception as err:
            row.status = "error"
            row.reason = f"while timing: {type(err).__name__}: {err}"
            return row
        row.status = "ok"
        for mode in MODES:
            blocking, pipelined = times[mode]
            row.modes[mode] = Timing(ran["compile"][mode], blocking, pipelined)
        return row

    # ----------------------------------------------------------------- all
    def run(self) -> list[RowResult]:
        for shape in self.shapes:
            for dtype in self.dtypes:
                for plan in self.plans:
                    self.progress(f"{plan.name} {dtype} {shape.label}")
                    self.results.append(self.run_row(plan, shape, dtype))
                    self.advance()
                self._trusted.pop((shape, dtype), None)  # free the expected arrays
        compute_speedups(self.results)
        return self.results


def compute_speedups(results: Sequence[RowResult]) -> None:
    """``row.speedup[mode][baseline] = baseline median / row median`` within the same run.

    Args:
        results: the rows of one run; their ``speedup`` is filled in.
    """
    index = {(r.backend, r.shape, r.dtype): r for r in results if r.source == "this run"}
    for r in results:
        if r.status != "ok" or r.source != "this run":
            continue
        for mode in MODES:
            mine = r.median(mode)
            for base in baselines():
                other = index.get((base, r.shape, r.dtype))
                theirs = other.median(mode) if other is not None else None
                if mine and theirs:
                    r.speedup.setdefault(mode, {})[base] = theirs / mine
