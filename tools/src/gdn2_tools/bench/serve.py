"""``gdn2 bench --serve``: one step of a serving engine through :func:`gdn2core.gdn2_ragged`,
correctness-gated and timed on this machine; with ``--tpu``, the TPU compiler's static cycle
estimate of the same call.

A scenario is a step's flat batch of requests: ``COUNTxLEN`` groups joined by ``+``, in order
(``64x1+2x2048``: 64 one-token decodes, then two 2048-token prompts). The leading requests of at
most ``--decode-len`` tokens are the step's decodes: they continue from their slot; the rest are
new prompts (``has_initial_state`` false, ``context_lens`` 0). Each scenario runs once without
and once with prefix checkpoints every ``--checkpoint-every`` tokens (each checkpoint met gets a
slot of its own; a decode at context ``63 + 61 i`` meets one now and then). The pool holds one
slot per request and per checkpoint, and is donated to the jitted step, as a server runs it.

Every row here is first gated: the same step at a small size (at most 4 decodes and 2 prompts of
at most ``2 * every + 37`` tokens, the same heads) against :func:`gdn2core.gdn2_ragged_reference`
(the token-serial ground truth) with the kit's metric and tolerances (``gdn2_conformance``). Then
it is timed: one jitted call at the full size, compile excluded, after a warm-up, median of the
repeats. Beside it, the separate calls the ragged call replaces, gated and timed the same way:
``gdn2_decode`` for the decodes and ``gdn2_forward`` per group of prompts, their final states
written into the pool, in one jitted step.

``--tpu v5e,v6e``: the static cycle estimate (:mod:`gdn2_tools.static_profile`) of a deviceless
compile of the same programs on the backend ``auto`` picks on a TPU, next to the HBM bound (the
named slots read and written once and the tokens' bytes at the chip's HBM bandwidth), the
separate calls, and the same step without checkpoints. Compile-time analysis, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from gdn2_tools.bench.decode import HBM_BYTES_PER_S
from gdn2_tools.hlo import mosaic_kernels

#: The default scenarios: a decode-only step, decodes with two prompts, prompts only.
SCENARIOS: Final = ("256x1", "64x1+2x2048", "8x4096")
#: Decode contexts: request i has processed ``63 + 61 i`` tokens (a checkpoint now and then).
DECODE_CONTEXT: Final = (63, 61)
#: The gate's small version: at most this many requests per group, prompts of at most
#: ``2 * every + 37`` tokens (two checkpoints and a partial chunk).
GATE_REQUESTS: Final = {"decodes": 4, "prompts": 2}
LABEL: Final = "TPU compiler static cycle estimate (compile-time analysis), not a measurement"
#: Prompt tokens (all prompts together) at which the kernels are simulated when a step has more:
#: the simulation's memory grows with the grid (a step's 8192 prompt tokens on 32 value heads
#: need more than 12 GB); more are extrapolated from these.
FIT_TOKENS: Final = (512, 1024, 2048)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A step's requests: ``(count, tokens)`` groups in order; the leading requests of at most
    ``decode_len`` tokens are decodes."""

    groups: tuple[tuple[int, int], ...]
    decode_len: int = 1

    @classmethod
    def parse(cls, text: str, decode_len: int = 1) -> Scenario:
        """``"64x1+2x2048"`` -> 64 requests of 1 token, then 2 of 2048.

        Raises:
            ValueError: a malformed group, a count below 1 or a length below 1.
        """
        groups = []
        for part in text.split("+"):
            m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", part)
            if not m or min(int(m.group(1)), int(m.group(2))) < 1:
                raise ValueError(
                    f"expected COUNTxLEN groups joined by '+' (e.g. 64x1+2x2048), got {text!r}"
                )
            groups.append((int(m.group(1)), int(m.group(2))))
        return cls(tuple(groups), decode_len)

    @property
    def text(self) -> str:
        return "+".join(f"{c}x{n}" for c, n in self.groups)

    @property
    def decode_groups(self) -> int:
        """How many leading groups are decodes."""
        n = 0
        while n < len(self.groups) and self.groups[n][1] <= self.decode_len:
            n += 1
        return n

    @property
    def n_decodes(self) -> int:
        return sum(c for c, _ in self.groups[: self.decode_groups])

    @property
    def lens(self) -> list[int]:
        return [n for c, n in self.groups for _ in range(c)]

    @property
    def tokens(self) -> int:
        return sum(self.lens)

    @property
    def label(self) -> str:
        parts = []
        for i, (c, n) in enumerate(self.groups):
            if i < self.decode_groups:
                parts.append(f"{c} decode{'s' * (c > 1)}" + (f" of {n}" if n > 1 else ""))
            else:
                parts.append(f"{c} prefill{'s' * (c > 1)} of {n}")
        return " + ".join(parts)

    def small(self, every: int | None) -> Scenario:
        """The gate's version: the same groups, fewer and shorter requests."""
        most = 2 * (every or 64) + 37
        groups = tuple(
            (min(c, GATE_REQUESTS["decodes"]), n)
            if i < self.decode_groups
            else (min(c, GATE_REQUESTS["prompts"]), min(n, most))
            for i, (c, n) in enumerate(self.groups)
        )
        return Scenario(groups, self.decode_len)


@dataclasses.dataclass(frozen=True)
class Heads:
    """Head counts, head sizes and dtypes of the step."""

    H: int
    HV: int
    dk: int
    dv: int
    dtype: str
    pool_dtype: str
    gates: str = ""  # a key of gdn2_tools.tpu.SCALAR_GATES: which gates come scalar, (T, heads)
    value_gates: bool = False  # b, g on the value heads (fla's, Qwen3-Next's), else the key heads

    @property
    def gate_heads(self) -> int:
        return self.HV if self.value_gates else self.H

    @property
    def label(self) -> str:
        shape = f"H={self.H} HV={self.HV} dk={self.dk} dv={self.dv}"
        scalar = f", {self.gates.upper()}'s scalar gates" if self.gates else ""
        where = "value" if self.value_gates else "key"
        return f"{shape} {self.dtype}, {self.pool_dtype} pool, b and g on the {where} heads{scalar}"

    @property
    def scalar(self) -> tuple[str, ...]:
        """The gates passed as one value per head and token."""
        from gdn2_tools.tpu import SCALAR_GATES

        return SCALAR_GATES[self.gates]

    def token_shapes(self, t: int) -> tuple[tuple[int, ...], ...]:
        """The shapes of ``(q, k, v, w, b, g)`` for ``t`` flat tokens."""
        key, val, gate = (t, self.H, self.dk), (t, self.HV, self.dv), (t, self.gate_heads, self.dk)
        full = dict(zip("qkvwbg", (key, key, val, val, gate, gate), strict=True))
        return tuple(full[n][:2] if n in self.scalar else full[n] for n in "qkvwbg")


@dataclasses.dataclass(frozen=True)
class Step:
    """A scenario's metadata (NumPy, concrete): what an engine passes besides the tokens."""

    cu_seqlens: Any  # [N + 1]
    state_indices: Any  # [N]
    has_initial_state: Any  # [N]
    context_lens: Any  # [N]
    checkpoint_slots: Any  # [N, M] or None
    pool_size: int
    every: int | None
    stored: int  # checkpoints the step stores

    @classmethod
    def build(cls, scenario: Scenario, every: int | None, seed: int) -> Step:
        """Slots for every request and every checkpoint met, in a random order of the pool."""
        import numpy as np

        lens = np.asarray(scenario.lens, np.int64)
        n, d = len(lens), scenario.n_decodes
        ctx = np.zeros(n, np.int64)
        ctx[:d] = DECODE_CONTEXT[0] + DECODE_CONTEXT[1] * np.arange(d)
        met = (ctx + lens) // every - ctx // every if every else np.zeros(n, np.int64)
        pool_size = n + int(met.sum())
        perm = np.random.default_rng(seed + 77).permutation(pool_size).astype(np.int32)
        slots = None
        if every:
            slots = np.full((n, max(1, int(met.max()))), -1, np.int32)
            start = n
            for i, m in enumerate(met):
                slots[i, :m] = perm[start : start + m]
                start += m
        return cls(
            cu_seqlens=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
            state_indices=perm[:n], has_initial_state=np.arange(n) < d,
            context_lens=ctx.astype(np.int32), checkpoint_slots=slots, pool_size=pool_size,
            every=every, stored=int(met.sum()),
        )  # fmt: skip

    def metadata(self) -> tuple:
        """The traced arguments of the step: ``(cu, idx, flags, ctx, ckpt)`` (ckpt None without
        checkpoints), as JAX arrays."""
        import jax.numpy as jnp

        ck = None if self.checkpoint_slots is None else jnp.asarray(self.checkpoint_slots)
        return (
            jnp.asarray(self.cu_seqlens), jnp.asarray(self.state_indices),
            jnp.asarray(self.has_initial_state), jnp.asarray(self.context_lens), ck,
        )  # fmt: skip


# -------------------------------------------------------------------------------------------------
# The programs
# -------------------------------------------------------------------------------------------------
def decode_keywords(scenario: Scenario) -> dict[str, int]:
    """``num_decodes`` and ``decode_len`` for :func:`gdn2core.gdn2_ragged` when it takes them
    (the decodes then run on the backend's decode op), else nothing."""
    from gdn2core import gdn2_ragged

    params = inspect.signature(gdn2_ragged).parameters
    if "num_decodes" in params and "decode_len" in params:
        return {"num_decodes": scenario.n_decodes, "decode_len": scenario.decode_len}
    return {}


def make_step(kind: str, scenario: Scenario, every: int | None, backend: str):
    """``step(q, k, v, w, b, g, pool, cu, idx, flags, ctx, ckpt) -> (o, pool)``.

    ``kind``: ``"ragged"`` (one :func:`gdn2core.gdn2_ragged` call, with ``num_decodes`` where the
    op takes it), ``"packed"`` (the same without ``num_decodes``: every request on the packed
    forward), ``"separate"`` (the calls a step without checkpoints replaces: ``gdn2_decode`` for
    the decodes, ``gdn2_forward`` per group of prompts, new ones, their final states written into
    the pool) or ``"reference"`` (:func:`gdn2core.gdn2_ragged_reference`). The backend gets the
    default config by name: ``gdn2_ragged`` hands ``config=None`` on to the decode op, which
    pallas_tpu refuses.
    """
    import jax.numpy as jnp

    from gdn2core import (
        DEFAULT_CONFIG,
        gdn2_decode,
        gdn2_forward,
        gdn2_ragged,
        gdn2_ragged_reference,
    )

    extra = decode_keywords(scenario) if kind == "ragged" else {}
    run = dict(config=DEFAULT_CONFIG, backend=backend)

    def ragged(q, k, v, w, b, g, pool, cu, idx, flags, ctx, ckpt):
        kw = dict(cu_seqlens=cu, state_indices=idx, has_initial_state=flags)
        if every:
            kw.update(checkpoint_every=every, context_lens=ctx, checkpoint_slots=ckpt)
        if kind == "reference":
            return gdn2_ragged_reference(q, k, v, w, b, g, pool, **kw)
        return gdn2_ragged(q, k, v, w, b, g, pool, **kw, **extra, **run)

    def separate(q, k, v, w, b, g, pool, cu, idx, flags, ctx, ckpt):
        del cu, flags, ctx, ckpt  # static here: the scenario's groups
        outs, start, first = [], 0, 0
        for i, (count, n) in enumerate(scenario.groups):
            span = slice(start, start + count * n)
            xs = [x[span].reshape(count, n, *x.shape[1:]) for x in (q, k, v, w, b, g)]
            slots = idx[first : first + count]
            if i < scenario.decode_groups:
                o, pool = gdn2_decode(*xs, pool, state_indices=slots, **run)
            else:
                o, h = gdn2_forward(*xs, **run)
                pool = pool.at[slots].set(h.astype(pool.dtype))
            outs.append(o.reshape(count * n, *o.shape[2:]))
            start, first = start + count * n, first + count
        return jnp.concatenate(outs), pool

    return separate if kind == "separate" else ragged


def token_inputs(scenario: Scenario, heads: Heads, pool_size: int, seed: int, *, kit: bool):
    """``(q, k, v, w, b, g, pool)`` of a step: b and g on ``heads.gate_heads``.

    ``kit``: drawn by the conformance kit's generator (``Decay.MODEL``, float64 NumPy first: for
    the gate's small sizes); else the same distributions drawn by ``jax.random`` in the target
    dtype (the full sizes, whose float64 copies would not fit; values do not change the time)."""
    import jax
    import jax.numpy as jnp

    t, dt = scenario.tokens, jnp.dtype(heads.dtype)
    if kit:
        from gdn2_conformance import Decay, DecodeCase, make_decode_inputs

        case = DecodeCase(
            N=1, S=t, H=heads.H, HV=heads.HV, gate_heads=heads.gate_heads, dk=heads.dk,
            dv=heads.dv, P=pool_size, decay=Decay.MODEL, seed=seed,
        )  # fmt: skip
        x = make_decode_inputs(case, dt, jnp.dtype(heads.pool_dtype))
        return (*scalar_gates(tuple(a[0] for a in x.args), heads), x.state)
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    key_shape, val_shape = (t, heads.H, heads.dk), (t, heads.HV, heads.dv)
    gate_shape = (t, heads.gate_heads, heads.dk)

    def unit(key):
        x = jax.random.normal(key, key_shape)
        return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

    a = jax.random.uniform(ks[6], (heads.gate_heads, 1), minval=1.0, maxval=16.0)
    xs = (
        unit(ks[0]), unit(ks[1]), jax.random.normal(ks[2], val_shape),
        jax.nn.sigmoid(jax.random.normal(ks[3], val_shape)),
        jax.nn.sigmoid(jax.random.normal(ks[4], gate_shape)),
        -a * jax.nn.softplus(jax.random.normal(ks[5], gate_shape) - 3.0),
    )  # fmt: skip
    pool_shape = (pool_size, heads.HV, heads.dk, heads.dv)
    pool = 0.5 * jax.random.normal(ks[7], pool_shape)
    return (*scalar_gates(tuple(x.astype(dt) for x in xs), heads), pool.astype(heads.pool_dtype))


def scalar_gates(x: tuple, heads: Heads) -> tuple:
    """``(q, k, v, w, b, g)`` with the gates ``heads.scalar`` names as their first channel, one
    value per head and token."""
    return tuple(a[..., 0] if n in heads.scalar else a for n, a in zip("qkvwbg", x, strict=True))


# -------------------------------------------------------------------------------------------------
# Gate and timing on this machine
# -------------------------------------------------------------------------------------------------
_REFERENCES: dict = {}


def _reference(small: Scenario, every: int | None, heads: Heads, seed: int):
    """The gate's inputs and the reference's ``(o, pool)`` for them (kept for the next row)."""
    import jax
    import numpy as np

    key = (small, every, heads, seed)
    if key not in _REFERENCES:
        step = Step.build(small, every, seed)
        x = (*token_inputs(small, heads, step.pool_size, seed, kit=True), *step.metadata())
        with jax.default_matmul_precision("highest"):
            want = jax.jit(make_step("reference", small, every, "reference"))(*x)
        _REFERENCES.clear()
        _REFERENCES[key] = (x, step.stored, [np.asarray(a) for a in want])
    return _REFERENCES[key]


def gate(program, small: Scenario, every: int | None, heads: Heads, seed: int) -> dict[str, Any]:
    """``program`` (jitted, the pool donated) on ``small`` against the ragged reference, with the
    kit's metric and tolerances: ``{"ok", "errors", "failures", "scenario", "stored"}``."""
    import jax.numpy as jnp

    from gdn2_conformance.metrics import rel_err, tolerance

    x, stored, (o_ref, pool_ref) = _reference(small, every, heads, seed)
    x = list(x)
    x[6] = jnp.array(x[6], copy=True)  # donated
    o, pool = program(*x)
    pool_dt = "bfloat16" if heads.pool_dtype == "bfloat16" else heads.dtype
    errors, failures = {}, []
    pairs = (("o", o, o_ref, heads.dtype), ("h_final (pool)", pool, pool_ref, pool_dt))
    for name, got, want, dt in pairs:
        err, tol = rel_err(got, want), tolerance(dt, name)
        errors[name] = err
        if not err <= tol:
            failures.append(f"{name}: rel err {err:.2e} > tol {tol:.0e}")
    return {"ok": not failures, "errors": errors, "failures": failures, "scenario": small.text,
            "stored": stored}  # fmt: skip


def time_step(program, args, repeats: int) -> dict[str, Any]:
    """Time ``program`` (jitted, the pool argument 6 donated): a first call (compile, unless the
    gate compiled the same shapes, and one run), then ``repeats`` calls, each fed the pool the
    last one returned: ``{"first_call_s", "times_s", "median_s"}``."""
    import jax

    args = list(args)
    start = time.perf_counter()
    _, args[6] = jax.block_until_ready(program(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _, args[6] = jax.block_until_ready(program(*args))
        times.append(time.perf_counter() - start)
    return {"first_call_s": first, "times_s": times, "median_s": statistics.median(times)}


def time_row(kind: str, scenario: Scenario, every: int | None, heads: Heads, backend: str, args):
    """Gate, then time, one program at the scenario's full size; a failure is reported, never
    fatal."""
    import jax

    step = Step.build(scenario, every, args.seed)
    row: dict[str, Any] = {
        "kind": kind, "scenario": scenario.text, "label": scenario.label, "every": every,
        "backend": backend, "requests": len(scenario.lens), "tokens": scenario.tokens,
        "pool_size": step.pool_size, "stored": step.stored,
        "decode_keywords": decode_keywords(scenario) if kind == "ragged" else {},
    }  # fmt: skip
    small = scenario.small(every)
    try:
        program = jax.jit(make_step(kind, small, every, backend), donate_argnums=(6,))
        row["gate"] = gate(program, small, every, heads, args.seed)
        if not row["gate"]["ok"]:
            return {**row, "status": "rejected", "reason": "; ".join(row["gate"]["failures"])}
        if small != scenario:
            program = jax.jit(make_step(kind, scenario, every, backend), donate_argnums=(6,))
        x = token_inputs(scenario, heads, step.pool_size, args.seed, kit=False)
        row.update(time_step(program, (*x, *step.metadata()), args.repeats))
    except Exception as err:  # a row that fails is reported, never fatal
        return {**row, "status": "error", "reason": f"{type(err).__name__}: {err}"[:300]}
    return {**row, "status": "ok", "reason": ""}


# -------------------------------------------------------------------------------------------------
# TPU: deviceless compile and static profile
# -------------------------------------------------------------------------------------------------
def hbm_bound_us(scenario: Scenario, step: Step, heads: Heads, tpu: str) -> float:
    """The named slots read (requests with an initial state) and written (every request and
    checkpoint) once, plus the tokens' bytes (q, k, v, w, b, g in, o out), at the HBM rate."""
    import jax.numpy as jnp

    slot = heads.HV * heads.dk * heads.dv * jnp.dtype(heads.pool_dtype).itemsize
    n_slots = int(step.has_initial_state.sum()) + len(scenario.lens) + step.stored
    per_token = sum(math.prod(shape) for shape in heads.token_shapes(1))  # q, k, v, w, b, g
    per_token = (per_token + heads.HV * heads.dv) * jnp.dtype(heads.dtype).itemsize  # and o
    return (n_slots * slot + scenario.tokens * per_token) / HBM_BYTES_PER_S[tpu] * 1e6


#: Bytes of one vector register (8 x 128 x 4): staging a state into its DMA buffer loads and
#: stores it one register at a time, one per cycle (:func:`state_dma_us`).
VREG_BYTES: Final = 4096


def state_dma_us(
    kind: str, scenario: Scenario, step: Step, heads: Heads, tpu: str, kernel_us: float
) -> float:
    """The packed forward's per-request state DMAs, which the static profile does not see: it
    simulates the kernels with a chunk table of zeros, which moves no state (pooled.py), so they
    are priced here and added to the kernels' ``kernel_us``:

    - reads (a prompt's start slot): synchronous, the chunk waits for it: its bytes at the HBM rate;
    - writes (final states, checkpoints): asynchronous (state_writes.py), each staged first (the
      float32 state through the vector registers, one ``VREG_BYTES`` register per cycle), its
      DMA then running behind the next chunks: it costs HBM time only where the step's HBM
      bound (:func:`hbm_bound_us`: every slot and token once) exceeds ``kernel_us``, plus the
      last write of each head group, which the kernel's end waits for (one state of all heads).

    Slots move in the pool's dtype. Checked against the profile of the kernel forced to write
    every chunk (docs/results.md, section Serving). The separate calls move no state by DMA (their final states
    are the forward's outputs and an XLA scatter, both in the profile): 0."""
    import jax.numpy as jnp

    from gdn2_tools.static_profile import CLOCK_HZ

    if kind == "separate":
        return 0.0
    bw = HBM_BYTES_PER_S[tpu] / 1e6  # bytes per us
    state = heads.HV * heads.dk * heads.dv
    slot = state * jnp.dtype(heads.pool_dtype).itemsize
    first = 0 if kind == "packed" else scenario.n_decodes  # the packed forward's requests
    reads = int(step.has_initial_state[first:].sum())
    stored = 0 if step.checkpoint_slots is None else int((step.checkpoint_slots[first:] >= 0).sum())
    writes = len(scenario.lens) - first + stored  # the decodes' checkpoints: XLA's, profiled
    # The step's HBM bound (every slot and token once) beyond the kernels' profiled time, and
    # each head group's last write
    behind = 0.0
    if writes:
        behind = max(0.0, hbm_bound_us(scenario, step, heads, tpu) - kernel_us) + slot / bw
    staging = writes * state * 4 / VREG_BYTES / CLOCK_HZ[tpu] * 1e6
    return reads * slot / bw + staging + behind


def _compile_main(argv: Sequence[str]) -> int:
    """``python -m gdn2_tools.bench.serve JOB_JSON TPU WORKDIR``: compile one program for the TPU
    and write ``hlo.txt`` and ``meta.json`` (libtpu writes the profile)."""
    import jax
    import jax.numpy as jnp

    from gdn2_tools.tpu import TOPOLOGIES, compile_for_tpu, topology_mesh

    job, tpu, work = json.loads(argv[0]), argv[1], argv[2]
    scenario = Scenario.parse(job["scenario"], job["decode_len"])
    heads, every = Heads(**job["heads"]), job["every"]
    step = Step.build(scenario, every, job["seed"])
    rep = jax.sharding.NamedSharding(topology_mesh(TOPOLOGIES[tpu]), jax.sharding.PartitionSpec())
    t, dt = scenario.tokens, jnp.dtype(heads.dtype)

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=rep)

    x = [spec(shape, dt) for shape in heads.token_shapes(t)]
    pool = spec((step.pool_size, heads.HV, heads.dk, heads.dv), heads.pool_dtype)
    meta = [spec(a.shape, a.dtype) if a is not None else None for a in (
        step.cu_seqlens, step.state_indices, step.has_initial_state, step.context_lens,
        step.checkpoint_slots,
    )]  # fmt: skip
    fn = make_step(job["kind"], scenario, every, job["backend"])
    compiled = compile_for_tpu(fn, *x, pool, *meta, donate_argnums=(6,))
    hlo = compiled.as_text()
    Path(work, "hlo.txt").write_text(hlo)
    kernels = mosaic_kernels(hlo)
    memory = compiled.memory_analysis()
    temp = memory.temp_size_in_bytes if memory else None
    Path(work, "meta.json").write_text(json.dumps({"kernels": kernels, "temp_bytes": temp}))
    return 0


def _compile(job: dict, tpu: str, work: str, flags: list[str], timeout_s: float, max_rss_gb: float):
    """Run :func:`_compile_main` in a child with ``flags`` in ``LIBTPU_INIT_ARGS``:
    ``(exit code or why it was stopped, its log)``."""
    from gdn2_tools.static_profile import _rss_gb

    os.makedirs(os.path.join(work, "logs"), exist_ok=True)
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_LOG_DIR=os.path.join(work, "logs"),
        TMPDIR=work, LIBTPU_INIT_ARGS=" ".join([env.get("LIBTPU_INIT_ARGS", ""), *flags]).strip(),
    )  # fmt: skip
    cmd = [sys.executable, "-m", "gdn2_tools.bench.serve", json.dumps(job), tpu, work]
    start = time.time()
    with open(os.path.join(work, "stderr.txt"), "w+") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
        while (code := proc.poll()) is None:
            time.sleep(0.5)
            if _rss_gb(proc.pid) > max_rss_gb or time.time() - start > timeout_s:
                proc.kill()
                proc.wait()
                code = f"stopped (over {max_rss_gb} GB or {timeout_s} s)"
                break
        log.seek(0)
        return code, log.read()


def static_estimate(
    job: dict,
    tpu: str,
    *,
    xla_only: bool = False,
    timeout_s: float = 1800,
    max_rss_gb: float = 12.0,
):
    """The static cycle estimate of one program, XLA's memory-space assignment off (as
    ``gdn2 bench --decode`` does, so that the profiler models the scalar-prefetch copies): one
    compile with every op profiled, or (``xla_only``) a plain compile that names the ops, then one
    profiling all but the Pallas kernels. Ops the profiler aborts on are dropped and the rest
    profiled again.

    Returns:
        A :class:`gdn2_tools.static_profile.Estimate` (its ``program`` is the job dict).
    """
    from gdn2_tools.static_profile import (
        NO_MSA_FLAG,
        ONLY_FLAG,
        PROFILE_FLAG,
        Estimate,
        profiled_ops,
        read_profiles,
        run_counts,
    )  # fmt: skip

    work = tempfile.mkdtemp(prefix="gdn2_serve_")
    profile_dir = os.path.join(work, "profile")

    def names() -> list[str]:
        return re.findall(r"^\s*(?:ROOT )?%(\S+) = ", Path(work, "hlo.txt").read_text(), re.M)

    try:
        only, unprofiled, code, log = None, {}, None, ""
        if xla_only:
            code, log = _compile(job, tpu, work, [NO_MSA_FLAG], timeout_s, max_rss_gb)
            if code == 0:
                kernels = set(json.loads(Path(work, "meta.json").read_text())["kernels"])
                only = ";".join(f"{n}=true" for n in names() if n not in kernels)
        for _ in range(6 if code in (None, 0) else 0):
            flags = [NO_MSA_FLAG, PROFILE_FLAG + profile_dir] + ([ONLY_FLAG + only] if only else [])
            code, log = _compile(job, tpu, work, flags, timeout_s, max_rss_gb)
            crashed = dict(re.findall(r"Static LLO profiling of (\S+) failed: ([^\n]*)", log))
            check = re.search(r"LLO_CHECK failure[^\n]*", log)
            if check:
                crashed.update(
                    (n, check.group(0)) for n in re.findall(r" in HLO \[([^\]]+)\]", log)
                )
            if code == 0 or not crashed:
                break
            unprofiled.update(crashed)
            if not os.path.exists(os.path.join(work, "hlo.txt")):
                code, log = _compile(job, tpu, work, [NO_MSA_FLAG], timeout_s, max_rss_gb)
                if code != 0:
                    break
            done = read_profiles(profile_dir)
            todo = [n for n in names() if n not in done and n not in unprofiled]
            if only is not None:
                todo = [n for n in todo if f"{n}=true" in only.split(";")]
            if not todo:
                code = 0
                break
            only = ";".join(f"{n}=true" for n in todo)
        if code != 0 or not os.path.exists(os.path.join(work, "meta.json")):
            lines = [ln for ln in log.splitlines() if ln.strip() and "TPU_WORKER" not in ln]
            error = f"compile child exit {code}: " + " | ".join(lines[-4:])
            return Estimate(job, tpu, [], None, unprofiled, [], error=error)
        hlo = Path(work, "hlo.txt").read_text()
        meta = json.loads(Path(work, "meta.json").read_text())
        _, unknown = run_counts(hlo)
        ops = profiled_ops(profile_dir, hlo, meta["kernels"])
        profiled = {op.name for op in ops}
        unprofiled = {k: v for k, v in unprofiled.items() if k not in profiled}
        return Estimate(job, tpu, ops, meta["temp_bytes"], unprofiled, unknown)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def prompt_tokens(scenario: Scenario) -> int:
    """The tokens of the scenario's prompts (all but the leading decodes)."""
    return sum(c * n for c, n in scenario.groups[scenario.decode_groups :])


def scaled(scenario: Scenario, tokens: int) -> Scenario:
    """The scenario with each prompt shortened in proportion, to about ``tokens`` prompt tokens
    in all (the decodes as they are)."""
    whole = prompt_tokens(scenario)
    return Scenario(
        tuple(
            (c, n) if i < scenario.decode_groups else (c, max(1, n * tokens // whole))
            for i, (c, n) in enumerate(scenario.groups)
        ),
        scenario.decode_len,
    )


def fitted_estimate(job: dict, scenario: Scenario, tpu: str):
    """The estimate of a program whose prompts are longer than the simulation can hold: its XLA
    ops profiled at the full size, its Pallas kernels simulated with the prompts shortened to
    :data:`FIT_TOKENS` in all and extrapolated linearly in the prompt tokens (the kernels' grids
    are linear in them, the checkpoints' pieces included), as ``gdn2 tpu-report --estimate``
    does.

    Returns:
        The :class:`gdn2_tools.static_profile.Estimate`; each kernel's ``fit`` holds its points
        and largest relative residual.
    """
    from gdn2_tools.static_profile import OpCycles, fit_line

    target = static_estimate(job, tpu, xla_only=True)
    if target.error:
        return target
    points = []
    for tokens in FIT_TOKENS:
        small = scaled(scenario, tokens)
        e = static_estimate({**job, "scenario": small.text}, tpu)
        if e.error:
            target.error = f"fit point {small.text}: {e.error}"
            return target
        target.unprofiled.update(e.unprofiled)
        points.append((prompt_tokens(small), {op.name: op.total for op in e.ops if op.kernel}))
    for name in sorted({n for _, ks in points for n in ks}):
        pts = [(x, ks[name]) for x, ks in points if name in ks]
        if len(pts) < len(points):
            target.error = f"kernel {name}: not in every fit point"
            return target
        xs, ys = [x for x, _ in pts], [c for _, c in pts]
        cycles, per_token, resid = fit_line(xs, ys, prompt_tokens(scenario))
        fit = {"points": pts, "cycles_per_token": per_token, "max_rel_residual": resid}
        target.ops.append(OpCycles(name, round(cycles), 1, True, fit=fit))
    return target


def auto_backend(heads: Heads, platform: str | None = None) -> str | None:
    """The backend ``auto`` picks for the ragged op's packed forward of these heads on
    ``platform`` (None: this machine's), or None when none would run it."""
    from gdn2core.config import DEFAULT_CONFIG
    from gdn2core.ops.forward.spec import OpSpec
    from gdn2core.options import SegmentMode
    from gdn2core.platform import default_platform
    from gdn2core.registry import BackendNotFoundError
    from gdn2core.selection import resolve_backend

    spec = OpSpec(
        1, 1024, heads.H, heads.dk, heads.dv, heads.dtype, heads.dk**-0.5, value_heads=heads.HV,
        segments=SegmentMode.CU_SEQLENS, n_seqs=4,
    )  # fmt: skip
    where = platform or default_platform()
    try:
        return resolve_backend(spec, DEFAULT_CONFIG, "auto", trainable=False, platform=where).name
    except BackendNotFoundError:
        return None


def static_row(
    kind: str,
    scenario: Scenario,
    every: int | None,
    heads: Heads,
    backend: str,
    tpu: str,
    seed: int,
) -> dict[str, Any]:
    """One program's estimate on ``tpu``: kernels, XLA ops, whole call (us), the HBM bound."""
    job = {
        "kind": kind, "scenario": scenario.text, "decode_len": scenario.decode_len,
        "every": every, "heads": dataclasses.asdict(heads), "backend": backend, "seed": seed,
    }  # fmt: skip
    step = Step.build(scenario, every, seed)
    row: dict[str, Any] = {
        "kind": kind, "scenario": scenario.text, "label": scenario.label, "every": every,
        "backend": backend, "tpu": tpu, "stored": step.stored, "pool_size": step.pool_size,
        "bound_us": hbm_bound_us(scenario, step, heads, tpu), "estimate": LABEL,
        "decode_keywords": decode_keywords(scenario) if kind == "ragged" else {},
    }  # fmt: skip
    start = time.time()
    row["fitted"] = prompt_tokens(scenario) > FIT_TOKENS[-1]
    e = fitted_estimate(job, scenario, tpu) if row["fitted"] else static_estimate(job, tpu)
    row["compile_s"] = time.time() - start
    if e.error:
        return {**row, "error": e.error}
    us = lambda cycles: e.ms(cycles) * 1e3  # noqa: E731
    row["state_dma_us"] = state_dma_us(kind, scenario, step, heads, tpu, us(e.kernel_cycles))
    row["kernel_us"] = us(e.kernel_cycles) + row["state_dma_us"]
    row["xla_ops_us"] = us(sum(op.total for op in e.ops if not op.kernel))
    row["total_us"] = row["kernel_us"] + row["xla_ops_us"]
    row["kernels"] = {op.name: us(op.total) for op in e.ops if op.kernel}
    row["fit_residual"] = max((op.fit["max_rel_residual"] for op in e.ops if op.fit), default=None)
    xla = sorted((op for op in e.ops if not op.kernel), key=lambda op: -op.total)
    row["largest_xla_ops"] = {op.name: us(op.total) for op in xla[:8]}
    row["unprofiled"] = sorted(e.unprofiled)
    row["unmodelled"] = [op.name for op in e.unmodelled]
    row["temp_mib"] = e.temp_bytes / 2**20 if e.temp_bytes is not None else None
    return row


# -------------------------------------------------------------------------------------------------
# Report
# -------------------------------------------------------------------------------------------------
#: How the report names each program.
CALLS: Final = {"ragged": "gdn2_ragged", "packed": "gdn2_ragged, num_decodes=0"}


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _value(rows, key: str, kind: str, scenario: str, every, tpu=None) -> float | None:
    """``key`` of the row of that program, or None (absent, failed, not run)."""
    for r in rows:
        if (r["kind"], r["scenario"], r["every"], r.get("tpu")) == (kind, scenario, every, tpu):
            return r.get(key)
    return None


def _checkpoints(r) -> str:
    return f"every {r['every']} ({r['stored']} stored)" if r["every"] else "none"


def _cpu_table(rows) -> list[str]:
    lines = [
        "| scenario | call | checkpoints | backend | status | ms | tokens/s | separate calls ms "
        "| / separate | / no checkpoints |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["kind"] not in CALLS:
            continue
        ms = r.get("median_s") and r["median_s"] * 1e3
        sep = _value(rows, "median_s", "separate", r["scenario"], None) if not r["every"] else None
        sep_ms = sep and sep * 1e3
        plain = _value(rows, "median_s", r["kind"], r["scenario"], None) if r["every"] else None
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason']}"[:120]
        lines.append(
            f"| {r['label']} | {CALLS[r['kind']]} | {_checkpoints(r)} | {r['backend']} | "
            f"{status} | "
            + (f"{ms:.1f} | {r['tokens'] / ms * 1e3:,.0f}" if ms else "- | -")
            + f" | {f'{sep_ms:.1f}' if sep_ms else '-'} | {_ratio(ms, sep_ms)} | "
            + f"{_ratio(ms, plain and plain * 1e3)} |"
        )
    failed = [r for r in rows if r["kind"] == "separate" and r["status"] != "ok"]
    lines += [f"\nSeparate calls of {r['label']}: {r['status']}: {r['reason']}" for r in failed]
    return lines


def _tpu_table(static) -> list[str]:
    lines = [
        "| TPU | scenario | call | checkpoints | backend | kernels us | whole us | HBM bound us | "
        "whole / bound | separate calls us | whole / separate | whole / no checkpoints |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in static:
        if r["kind"] not in CALLS:
            continue
        key = (r["scenario"], None, r["tpu"])
        sep = None if r["every"] else _value(static, "total_us", "separate", *key)
        plain = _value(static, "total_us", r["kind"], *key) if r["every"] else None
        total = r.get("total_us")
        cells = [
            (f"{r['kernel_us']:.1f}" + " (fit)" * bool(r.get("fitted")))
            if "kernel_us" in r
            else "error (below)",
            f"{total:.1f}" if total else "-", f"{r['bound_us']:.1f}", _ratio(total, r["bound_us"]),
            f"{sep:.1f}" if sep else "-", _ratio(total, sep), _ratio(total, plain),
        ]  # fmt: skip
        lines.append(
            f"| {r['tpu']} | {r['label']} | {CALLS[r['kind']]} | {_checkpoints(r)} | "
            f"{r['backend']} | " + " | ".join(cells) + " |"
        )
    notes = []
    for r in static:
        what = f"{r['tpu']} {r['kind']} {r['label']} (checkpoints {r['every'] or 'none'})"
        if "error" in r:
            notes.append(f"{what}: {r['error'][:300]}")
        if r.get("unprofiled"):
            notes.append(f"{what}: unprofiled (counted 0): {r['unprofiled']}")
        if r.get("unmodelled"):
            notes.append(f"{what}: priced 0 by the profiler (remote DMA): {r['unmodelled']}")
        if r.get("fitted") and "kernel_us" in r:
            points = "/".join(map(str, FIT_TOKENS))
            notes.append(
                f"{what}: kernels extrapolated from {points} prompt tokens "
                f"(largest fit residual {100 * (r['fit_residual'] or 0):.1f}%)"
            )
    return lines + (["\nNotes:\n", *(f"- {n}" for n in notes)] if notes else [])


def markdown(results: dict[str, Any]) -> str:
    """The report: CPU timings (when run), then the TPU estimates (when asked)."""
    lines = [
        f"# gdn2 bench --serve\n\n`{results['command']}`\n",
        f"{results['heads']}. {results['decode_keywords_note']}.\n",
    ]
    if results["rows"]:
        lines += [
            f"## This machine ({results['host']}): median ms per step, compile excluded\n",
            "Every program gated first at a small size against `gdn2_ragged_reference` (the kit's "
            "metric and tolerances). Separate calls: `gdn2_decode` for the decodes and "
            "`gdn2_forward` per group of prompts, states written into the pool, one jitted step.\n",
            *_cpu_table(results["rows"]),
        ]
    if results["static"]:
        lines += [
            f"\n## TPU: {LABEL}\n",
            "us per step. Kernels: the Pallas kernels, plus the packed forward's state DMAs, which "
            "the profile does not see (it simulates a chunk table that moves no state): reads at "
            "their bytes' HBM time, writes (overlapped with the next chunks) at their staging "
            "cost, the HBM bound's excess over the kernels and one state waited at the end "
            "(`state_dma_us`); whole: kernels plus the XLA ops around them (gathers, layout, "
            "scatters). HBM bound: the slots read and written once plus the "
            "tokens' bytes at the chip's HBM bandwidth (the bound of a decode step; prompts are "
            "bound by their FLOPs as well, which it leaves out). Separate calls: as above, "
            "estimated the same way. The v6e profile leaves HBM time out: its figures are lower "
            "bounds.\n",
            *_tpu_table(results["static"]),
        ]
    return "\n".join(lines) + "\n"


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    summary = " ".join(__doc__.split("\n\n")[0].split())
    p = argparse.ArgumentParser(prog="gdn2 bench --serve", description=summary)
    p.add_argument(
        "--scenario",
        action="append",
        default=None,
        metavar="COUNTxLEN[+...]",
        help=f"a step's requests, repeatable (default {' '.join(SCENARIOS)})",
    )
    p.add_argument("--decode-len", type=int, default=1, help="most tokens of a decode (default 1)")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=64,
        help="the checkpoint rows' interval (default 64; 0: no checkpoint rows)",
    )
    p.add_argument("--heads", "-H", type=int, default=16, help="key heads (default 16)")
    p.add_argument("--value-heads", type=int, default=32, help="value heads HV (default 32)")
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--pool-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--gates",
        choices=("kda", "gdn"),
        default="",
        help="pass KDA's (w, b) or GDN's (w, b, g) gates as one value per head and token",
    )
    p.add_argument(
        "--value-gates",
        action="store_true",
        help="b and g on the value heads (fla's and Qwen3-Next's layout; default: the key heads)",
    )
    p.add_argument("--backend", default=None, help="the timed backend (default: auto's pick here)")
    p.add_argument(
        "--tpu-backend", default=None, help="estimated backend (default: auto's on a TPU)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed calls per program (default 3)")
    p.add_argument("--no-separate", action="store_true", help="skip the separate calls")
    p.add_argument(
        "--packed-decodes",
        action="store_true",
        help="also run each step with decodes without num_decodes (on the packed forward)",
    )
    p.add_argument("--tpu", default="", help="e.g. v5e,v6e: static cycle estimates (libtpu)")
    p.add_argument("--no-timing", action="store_true", help="only the --tpu estimates")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="report folder")
    args = p.parse_args(list(argv))
    try:
        args.scenarios = [Scenario.parse(s, args.decode_len) for s in args.scenario or SCENARIOS]
    except ValueError as err:
        p.error(f"--scenario: {err}")
    args.tpu = [t.strip() for t in args.tpu.split(",") if t.strip()]
    bad = [t for t in args.tpu if t not in HBM_BYTES_PER_S]
    if bad:
        p.error(f"--tpu: expected {sorted(HBM_BYTES_PER_S)}, got {bad}")
    if args.value_heads % args.heads:
        p.error(f"--value-heads {args.value_heads} must be a multiple of --heads {args.heads}")
    if args.repeats < 1 or args.decode_len < 1 or args.checkpoint_every < 0:
        p.error("--repeats and --decode-len must be >= 1, --checkpoint-every >= 0")
    return args


def serve_main(argv: Sequence[str]) -> int:
    """Run ``gdn2 bench --serve``.

    Args:
        argv: the arguments after ``gdn2 bench --serve`` (``--help`` lists them).

    Returns:
        0; 1 when a program was rejected by the gate or failed (a TPU compile included); 2 for a
        usage error.
    """
    import platform

    args = _parse(argv)
    heads = Heads(
        args.heads, args.value_heads, args.dk, args.dv, args.dtype, args.pool_dtype, args.gates,
        args.value_gates,
    )  # fmt: skip
    everies = [None] + ([args.checkpoint_every] if args.checkpoint_every else [])
    takes = bool(decode_keywords(args.scenarios[0]))
    note = (
        "gdn2_ragged takes num_decodes and decode_len: passed (the leading decodes run on the "
        "backend's decode op)"
        if takes
        else "gdn2_ragged takes no num_decodes/decode_len here: not passed (every request, a "
        "one-token decode included, runs on the packed forward)"
    )
    results: dict[str, Any] = {
        "schema": "gdn2-bench-serve/1", "command": "gdn2 bench --serve " + " ".join(argv),
        "heads": heads.label, "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "decode_keywords_passed": takes, "decode_keywords_note": note, "rows": [], "static": [],
    }  # fmt: skip
    print(note, flush=True)

    def programs():
        for scenario in args.scenarios:
            for every in everies:
                yield "ragged", scenario, every
                if args.packed_decodes and takes and scenario.n_decodes:
                    yield "packed", scenario, every
                if every is None and not args.no_separate:
                    yield "separate", scenario, every

    if not args.no_timing:
        backend = args.backend or auto_backend(heads)
        for kind, scenario, every in programs():
            r = time_row(kind, scenario, every, heads, backend, args)
            results["rows"].append(r)
            ms = f"{r['median_s'] * 1e3:.1f} ms" if r.get("median_s") else r["reason"]
            what = f"{scenario.label}, checkpoints {every}, {kind} on {backend}"
            print(f"{what}: {r['status']} {ms}", flush=True)
    if args.tpu:
        backend = args.tpu_backend or auto_backend(heads, "tpu")
        if backend is None:
            print("--tpu: no backend would run this call on a TPU", file=sys.stderr)
            return 1
        for tpu in args.tpu:
            for kind, scenario, every in programs():
                r = static_row(kind, scenario, every, heads, backend, tpu, args.seed)
                results["static"].append(r)
                got = r.get("error") or f"{r['total_us']:.1f} us (kernels {r['kernel_us']:.1f})"
                print(f"{tpu} {scenario.label}, checkpoints {every}, {kind} on {backend}: {got}; "
                      f"compiled in {r['compile_s']:.0f} s", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve.json").write_text(json.dumps(results, indent=2) + "\n")
    md = markdown(results)
    (args.out / "serve.md").write_text(md)
    print(md)
    print(f"wrote {args.out / 'serve.json'} and {args.out / 'serve.md'}")
    bad = [r for r in results["rows"] if r["status"] != "ok"]
    return 1 if bad or any("error" in r for r in results["static"]) else 0


if __name__ == "__main__":
    sys.exit(_compile_main(sys.argv[1:]))
