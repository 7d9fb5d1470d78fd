"""docs/operator.md, section "Edges": every backend at the edges (T = 0, T = 1, empty and one-token
sequences, g = ±inf, b and w at ±inf with and without the fused sigmoids, NaN inputs), checked row
by row against the table of that section.

The table is read from the docs (:func:`edge_table` parses the markdown), so the docs and this test
hold the same rows: :data:`EDGES` says what each row's inputs are (a row without an entry here, or
an entry without a row there, fails :func:`test_every_row_has_inputs_and_every_cell_a_check`), and
:data:`CHECKS` turns each word of a cell into assertions. Every backend runs every row
(pallas_tpu in TPU interpret mode, with its head sizes).

Ground truth: the token-serial reference (``gdn2_token_serial_reference``) on the same float32
inputs, outputs and gradients of ``sum(o * do) + sum(h_final * dh)`` by ``jax.grad``; the
``empty`` word is checked against its definition (shapes, ``h_final == h0`` and
``dh0 == dh_final`` bit for bit), ``saturated`` gradients against exact zeros.

Tolerances: the conformance kit's float32 ones (``gdn2_conformance.tolerance``: 1e-4 on o and
h_final, 3e-4 on gradients, ``rel_err = max|a - e| / max|e|``; gdn2_conformance/metrics.py gives
the reasons: the chunked algorithm's float32 rounding, measured 2e-6 to 1e-5, amplified a few-fold
by b up to 2). The exact checks (``empty``, empty sequences, saturated gradients, chunk state 0)
have none: they are copies or products with an exact zero.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn2core
from gdn2_conformance import ReferenceBackend, rel_err, tolerance
from gdn2core import (
    BackendUnsupportedError,
    KernelConfig,
    gdn2_forward,
    gdn2_forward_trainable,
    gdn2_token_serial_reference,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operator.md"
BACKENDS = ("jax_ref", "scan_baseline", "pallas_tpu")
BT = 16  # the chunk length of every row (the docs' "chunks of bt = 16")
POISON = (1, 21, 1)  # (batch row, token, head) of the poisoned rows: inside the second chunk
TOL_OUT = tolerance("float32", "o")  # o and h_final
TOL_GRAD = tolerance("float32", "dq")  # every gradient
INPUT_NAMES = ("q", "k", "v", "w", "b", "g")


# --- the table of the docs --------------------------------------------------------------------


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def edge_table() -> dict[str, dict[str, str]]:
    """The rows of the table in docs/operator.md, section "Edges": ``{edge: {backend: word}}``."""
    text = DOCS.read_text()
    match = re.search(r"^## Edges\n(.*?)(?=^## )", text, flags=re.S | re.M)
    assert match, f"{DOCS}: no section '## Edges'"
    lines = [line for line in match.group(1).splitlines() if line.startswith("|")]
    header = _cells(lines[0])
    assert header == ["edge", "given", *BACKENDS], header
    rows = {}
    for line in lines[2:]:
        cells = _cells(line)
        assert len(cells) == len(header), line
        assert cells[0] not in rows, f"edge {cells[0]!r} twice"
        rows[cells[0]] = {be: cell.strip("`") for be, cell in zip(BACKENDS, cells[2:], strict=True)}
    return rows


# --- the inputs of each row -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Edge:
    """The inputs of one row (dk and dv come from the backend: :func:`head_sizes`)."""

    T: int = 40
    B: int = 2
    H: int = 2
    HV: int = 0  # value heads (0: H)
    h0: bool = True
    segment_ids: tuple[tuple[int, ...], ...] | None = None
    cu_seqlens: tuple[int, ...] | None = None
    flags: tuple[str, ...] = ()  # boolean feature keywords set True
    gate: bool = False  # use_gate_in_kernel, with A_log and dt_bias (differentiated)
    #: ``(input, batch row, token, head, value)``: every channel of that token of that head.
    values: tuple[tuple[str, int, int, int, float], ...] = ()
    chunk_states: bool = False
    diag: bool = False

    @property
    def value_heads(self) -> int:
        return self.HV or self.H

    @property
    def state_rows(self) -> int:
        return self.B if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    def features(self) -> dict:
        kw = {flag: True for flag in self.flags}
        if self.segment_ids is not None:
            kw["segment_ids"] = np.asarray(self.segment_ids, np.int32)
        if self.cu_seqlens is not None:
            kw["cu_seqlens"] = np.asarray(self.cu_seqlens, np.int32)
        if self.gate:
            kw["use_gate_in_kernel"] = True
        return kw


def poisoned(name: str, value: float, T: int = 40) -> Edge:
    return Edge(T=T, values=((name, *POISON, value),))


def ids_with_starts(T: int, starts: tuple[int, ...], B: int = 2) -> tuple[tuple[int, ...], ...]:
    """Segment ids of B rows with a new id at each of ``starts`` (and at token 0)."""
    row = np.cumsum(np.isin(np.arange(T), starts)).tolist()
    return tuple(tuple(row) for _ in range(B))


INF = float("inf")
NAN = float("nan")
SATURATE = (("b", 0, 5, 0, INF), ("b", 1, 21, 1, -INF), ("w", 1, 9, 1, -INF), ("w", 0, 30, 0, INF))
EVERY_FEATURE = ("use_qk_l2norm_in_kernel", "use_bw_sigmoid_in_kernel", "allow_neg_eigval")

#: The inputs of every row of the docs' table, by its "edge" cell.
EDGES: dict[str, Edge] = {
    "T = 0": Edge(T=0),
    "T = 0, no h0": Edge(T=0, h0=False),
    "T = 0, segment_ids": Edge(T=0, segment_ids=((), ())),
    "T = 0, cu_seqlens": Edge(T=0, B=1, cu_seqlens=(0, 0, 0)),
    "T = 0, every feature": Edge(T=0, H=1, HV=2, flags=EVERY_FEATURE, gate=True),
    "T = 0, chunk states": Edge(T=0, chunk_states=True),
    "T = 1": Edge(T=1),
    "T = 1, segment_ids": Edge(T=1, segment_ids=((7,), (3,))),
    "T = 1, cu_seqlens": Edge(T=1, B=1, cu_seqlens=(0, 1)),
    "T = 1, chunk states": Edge(T=1, chunk_states=True),
    "empty sequences": Edge(B=1, cu_seqlens=(0, 0, 7, 7, 40, 40)),
    "one-token sequences, cu_seqlens": Edge(B=1, cu_seqlens=(0, 1, 2, 17, 18, 40)),
    "one-token sequences, segment_ids": Edge(segment_ids=ids_with_starts(40, (1, 2, 16, 17, 39))),
    "g = -inf": Edge(values=(("g", 0, 0, 0, -INF), ("g", *POISON, -INF), ("g", 0, 39, 1, -INF))),
    "g = +inf": poisoned("g", INF),
    "b = +inf": poisoned("b", INF),
    "b = -inf": poisoned("b", -INF),
    "w = +inf": poisoned("w", INF),
    "w = -inf": poisoned("w", -INF),
    "b, w = ±inf, use_bw_sigmoid_in_kernel": Edge(
        flags=("use_bw_sigmoid_in_kernel",), values=SATURATE
    ),
    "b = ±inf, allow_neg_eigval": Edge(
        flags=("use_bw_sigmoid_in_kernel", "allow_neg_eigval"), values=SATURATE[:2]
    ),
    "NaN in q": poisoned("q", NAN),
    "NaN in k": poisoned("k", NAN),
    "NaN in v": poisoned("v", NAN),
    "NaN in w": poisoned("w", NAN),
    "NaN in b": poisoned("b", NAN),
    "NaN in g": poisoned("g", NAN),
    "NaN in raw b, use_bw_sigmoid_in_kernel": dataclasses.replace(
        poisoned("b", NAN), flags=("use_bw_sigmoid_in_kernel",)
    ),
    "NaN in v, GDN2_FWD_DIAG=1": dataclasses.replace(poisoned("v", NAN, T=23), diag=True),
}


def head_sizes(backend: str) -> tuple[int, int]:
    """``(dk, dv)`` of a backend's rows: pallas_tpu takes 64, 128 or 256."""
    return (64, 64) if backend == "pallas_tpu" else (8, 8)


def config_of(backend: str) -> KernelConfig:
    return KernelConfig(bt=BT, interpret=backend == "pallas_tpu")


def make_inputs(e: Edge, dk: int, dv: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """``(x, do, dh)``: the differentiated inputs by name (q..g, h0 when given, A_log and
    dt_bias with the gate), float32, and the cotangents of o and h_final."""
    rng = np.random.default_rng(0)
    B, T, H, HV = e.B, e.T, e.H, e.value_heads
    raw_bw = "use_bw_sigmoid_in_kernel" in e.flags
    x = {
        "q": rng.normal(size=(B, T, H, dk)),
        "k": rng.normal(size=(B, T, H, dk)),
        "v": rng.normal(size=(B, T, HV, dv)),
        "w": rng.normal(size=(B, T, HV, dv)) if raw_bw else rng.uniform(0, 1, (B, T, HV, dv)),
        "b": rng.normal(size=(B, T, H, dk)) if raw_bw else rng.uniform(0, 1, (B, T, H, dk)),
        "g": rng.normal(size=(B, T, H, dk)) if e.gate else -rng.uniform(0.02, 1, (B, T, H, dk)),
    }
    x["k"] = x["k"] / np.maximum(np.linalg.norm(x["k"], axis=-1, keepdims=True), 1e-6)
    if e.h0:
        x["h0"] = 0.3 * rng.normal(size=(e.state_rows, HV, dk, dv))
    if e.gate:
        x["A_log"] = np.log(rng.uniform(1, 16, (H,)))
        x["dt_bias"] = 0.5 * rng.normal(size=(H, dk))
    for name, row, t, head, value in e.values:
        x[name][row, t, head] = value
    do = rng.normal(size=(B, T, HV, dv))
    dh = rng.normal(size=(e.state_rows, HV, dk, dv))
    x = {n: a.astype(np.float32) for n, a in x.items()}
    return x, do.astype(np.float32), dh.astype(np.float32)


# --- running a row ----------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    o_inf: jax.Array  # gdn2_forward
    h_inf: jax.Array
    o: jax.Array  # gdn2_forward_trainable (the reference: its only entry)
    h: jax.Array
    grads: dict[str, jax.Array]
    chunks: jax.Array | None = None


@functools.cache
def _compiled(backend: str, e: Edge):
    """jit(forward) and jit(grad) of ``backend`` ("reference": the token-serial reference) for a
    row; rows of the same shapes and features share them (an Edge's values are not part of it)."""
    kw = e.features()
    config = config_of(backend)

    def call(x, trainable):
        args = [x[n] for n in INPUT_NAMES]
        gate = {"A_log": x["A_log"], "dt_bias": x["dt_bias"]} if e.gate else {}
        if backend == "reference":
            return gdn2_token_serial_reference(*args, None, x.get("h0"), **kw, **gate)
        fn = gdn2_forward_trainable if trainable else gdn2_forward
        more = {"return_chunk_states": True} if e.chunk_states and not trainable else {}
        return fn(*args, None, x.get("h0"), config, backend, **kw, **gate, **more)

    def loss(x, do, dh):
        o, h = call(x, True)
        return jnp.sum(o * do) + jnp.sum(h * dh), (o, h)

    return jax.jit(lambda x: call(x, False)), jax.jit(jax.grad(loss, has_aux=True))


def _key(e: Edge) -> Edge:
    return dataclasses.replace(e, values=())


def run(backend: str, e: Edge, dims: tuple[int, int]) -> Result:
    x, do, dh = make_inputs(e, *dims)
    fwd, grad = _compiled(backend, _key(e))
    grads, (o, h) = grad(x, do, dh)
    if backend == "reference":
        return Result(o, h, o, h, grads)
    out = fwd(x)
    return Result(*out[:2], o, h, grads, out[2] if e.chunk_states else None)


@functools.cache
def reference(e: Edge, dims: tuple[int, int]) -> Result:
    return run("reference", e, dims)


# --- the words of the cells -------------------------------------------------------------------


def finite(x) -> bool:
    return bool(np.all(np.isfinite(np.asarray(x))))


def close(label: str, actual, expected, tol: float) -> None:
    assert finite(expected), f"{label}: the reference itself is not finite here"
    err = rel_err(actual, expected)
    assert err <= tol, f"{label}: rel_err {err:.2e} > {tol:.0e}"


def _outputs(res: Result):
    return (
        ("o", res.o_inf, "h_final", res.h_inf),
        ("o (trainable)", res.o, "h_final (trainable)", res.h),
    )


def check_empty(e: Edge, res: Result, ref: Result, x, do, dh) -> None:
    B, HV = e.B, e.value_heads
    dk, dv = x["q"].shape[-1], x["v"].shape[-1]
    h0 = x["h0"] if e.h0 else np.zeros((e.state_rows, HV, dk, dv), np.float32)
    for o_name, o, h_name, h in _outputs(res):
        assert o.shape == (B, 0, HV, dv) and o.dtype == jnp.float32, (o_name, o.shape, o.dtype)
        assert h.dtype == jnp.float32 and np.array_equal(h, h0), f"{h_name}: not h0 bit for bit"
    for name in INPUT_NAMES:
        assert res.grads[name].shape == x[name].shape, (name, res.grads[name].shape)
    for name in ("A_log", "dt_bias"):
        if name in x:
            assert np.array_equal(res.grads[name], np.zeros_like(x[name])), name
    if e.h0:
        assert np.array_equal(res.grads["h0"], dh), "dh0: not dh_final bit for bit"
    if e.chunk_states:
        assert res.chunks.shape == (B, 0, HV, dk, dv), res.chunks.shape


def check_reference(e: Edge, res: Result, ref: Result, x, do, dh, exact_zero=None) -> None:
    for o_name, o, h_name, h in _outputs(res):
        close(o_name, o, ref.o, TOL_OUT)
        close(h_name, h, ref.h, TOL_OUT)
    for name, grad in res.grads.items():
        expected = ref.grads[name]
        if exact_zero is not None and name in exact_zero:
            where = exact_zero[name]
            assert np.all(np.asarray(grad)[where] == 0), f"d{name}: not 0 where raw {name} = ±inf"
            grad, expected = np.where(where, 0, grad), np.where(where, 0, expected)
        close(f"d{name}", grad, expected, TOL_GRAD)
    if e.cu_seqlens is not None:  # an empty sequence keeps its h0 bit for bit
        cu = np.asarray(e.cu_seqlens)
        for n in np.flatnonzero(cu[1:] == cu[:-1]):
            for _, _, h_name, h in _outputs(res):
                assert np.array_equal(h[n], x["h0"][n]), f"{h_name}[{n}]: not h0[{n}] bit for bit"
            assert np.array_equal(res.grads["h0"][n], dh[n]), f"dh0[{n}]: not dh_final[{n}]"
    if e.chunk_states:
        assert res.chunks.shape == (e.B, -(-e.T // BT), *x["h0"].shape[1:]), res.chunks.shape
        assert np.array_equal(res.chunks[:, 0], x["h0"]), "chunk_states[:, 0]: not h0"


def check_saturated(e: Edge, res: Result, ref: Result, x, do, dh) -> None:
    where = {}
    for name, row, t, head, _ in e.values:
        mask = where.setdefault(name, np.zeros(x[name].shape, bool))
        mask[row, t, head] = True
    assert set(where) <= {"b", "w"} and all(np.isinf(x[n][m]).all() for n, m in where.items())
    check_reference(e, res, ref, x, do, dh, exact_zero=where)


def _split(a, row: int, head: int, head_axis: int) -> tuple[np.ndarray, np.ndarray]:
    """``(the poisoned (row, head) slice, every other (row, head) stacked)``."""
    a = np.moveaxis(np.asarray(a), head_axis, 1)  # [B, heads, ...]
    mask = np.ones(a.shape[:2], bool)
    mask[row, head] = False
    return a[row, head], a[mask]


def _check_poisoned(e: Edge, res: Result, ref: Result, x, do, dh, first: str) -> None:
    """The words ``non-finite from the token / the chunk / at the token``: ``first`` is
    "token", "chunk" or "at"."""
    assert len(e.values) == 1, f"a poisoned row sets one site, this one {len(e.values)}"
    ((_, row, t, head, _),) = e.values
    start = {"token": t, "chunk": t // BT * BT, "at": t}[first]
    for o_name, o, h_name, h in _outputs(res):
        o_bad, o_rest = _split(o, row, head, 2)  # [T, dv], [others, T, dv]
        r_bad, r_rest = _split(ref.o, row, head, 2)
        h_bad, h_rest = _split(h, row, head, 1)
        rh_bad, rh_rest = _split(ref.h, row, head, 1)
        nonfinite = ~np.isfinite(o_bad).all(axis=-1)  # [T] per token
        close(f"{o_name}, other heads and rows", o_rest, r_rest, TOL_OUT)
        close(f"{h_name}, other heads and rows", h_rest, rh_rest, TOL_OUT)
        if first == "at":
            assert nonfinite[t] and nonfinite.sum() == 1, (o_name, np.flatnonzero(nonfinite))
            keep = np.arange(e.T) != t
            close(f"{o_name}, other tokens", o_bad[keep], r_bad[keep], TOL_OUT)
            close(h_name, h_bad, rh_bad, TOL_OUT)
        else:
            assert nonfinite[t:].all(), (
                o_name,
                "finite at tokens",
                np.flatnonzero(~nonfinite[t:]) + t,
            )
            if start:
                close(f"{o_name}, tokens before {start}", o_bad[:start], r_bad[:start], TOL_OUT)
            assert not finite(h_bad), f"{h_name}: finite in the poisoned head"
    for name, grad in res.grads.items():
        axis = 1 if name == "h0" else 2
        close(f"d{name}, other heads and rows", _split(grad, row, head, axis)[1],
              _split(ref.grads[name], row, head, axis)[1], TOL_GRAD)  # fmt: skip


def check_refused(e: Edge, backend: str) -> None:
    x, _, _ = make_inputs(e, *head_sizes(backend))
    fwd, _ = _compiled(backend, _key(e))
    with pytest.raises(BackendUnsupportedError, match="return_chunk_states"):
        fwd(x)


CHECKS = {
    "empty": check_empty,
    "reference": check_reference,
    "saturated": check_saturated,
    "non-finite from the token": functools.partial(_check_poisoned, first="token"),
    "non-finite from the chunk": functools.partial(_check_poisoned, first="chunk"),
    "non-finite at the token": functools.partial(_check_poisoned, first="at"),
    "reported": functools.partial(_check_poisoned, first="chunk"),
}


def check_row(backend: str, edge: str, word: str, caplog) -> None:
    e = EDGES[edge]
    if word == "refused":
        check_refused(e, backend)
        return
    dims = head_sizes(backend)
    x, do, dh = make_inputs(e, *dims)
    if word == "reported":
        caplog.clear()
    res = run(backend, e, dims)
    CHECKS[word](e, res, reference(e, dims), x, do, dh)
    if word == "reported":
        jax.effects_barrier()
        for stage in ("o", "h_final"):
            counts = re.findall(rf"\[gdn2 diag\] {backend} {stage}: non-finite=(\d+)", caplog.text)
            assert counts and all(int(c) > 0 for c in counts), (stage, caplog.text[-2000:])


def in_part(edge: str, part: str) -> bool:
    """Whether a row belongs to ``part``: "quick" (`make test`) holds the rows that compile
    nothing of their own: T = 0 (the core answers) and the rows on the plain T = 40 inputs (one
    compile for all of them); "rest" (`make test-full`, tests/tiers.py: a function's later
    parametrizations) the rows with shapes or features of their own."""
    e = EDGES[edge]
    quick = e.T == 0 or _key(e) == Edge()
    return quick == (part == "quick")


def check_backend(backend: str, part: str, monkeypatch, caplog) -> None:
    """Every row of ``part`` of the table on ``backend``; the failures of all rows together."""
    caplog.set_level(logging.INFO, logger="gdn2core.diag")
    failures = []
    rows = {edge: words for edge, words in edge_table().items() if in_part(edge, part)}
    assert rows, part
    for edge, words in rows.items():
        if EDGES[edge].diag:
            monkeypatch.setenv("GDN2_FWD_DIAG", "1")
        else:
            monkeypatch.delenv("GDN2_FWD_DIAG", raising=False)
        try:
            check_row(backend, edge, words[backend], caplog)
        except Exception as err:  # collected, reported below by row
            failures.append(f"{edge!r} ({words[backend]}): {type(err).__name__}: {err}")
    monkeypatch.delenv("GDN2_FWD_DIAG", raising=False)
    assert not failures, f"{backend}: rows not as in docs/operator.md, 'Edges':\n" + "\n".join(
        failures
    )


# --- the tests ----------------------------------------------------------------------------------


def test_every_row_has_inputs_and_every_cell_a_check():
    """The docs' rows are exactly EDGES' keys, and every cell is a word with a check (a row added
    to the docs without inputs here, or a misspelt word, fails here)."""
    table = edge_table()
    assert list(table) == list(EDGES), set(table) ^ set(EDGES)
    words = {word for row in table.values() for word in row.values()}
    assert words <= {*CHECKS, "refused"}, words - {*CHECKS, "refused"}


# The first parametrization of each is in `make test`, the second in `make test-full`.
PARTS = pytest.mark.parametrize("part", ["quick", "rest"])


@PARTS
def test_jax_ref_edges(part, monkeypatch, caplog):
    check_backend("jax_ref", part, monkeypatch, caplog)


@PARTS
def test_scan_baseline_edges(part, monkeypatch, caplog):
    check_backend("scan_baseline", part, monkeypatch, caplog)


@PARTS
def test_pallas_tpu_edges_interpret(part, monkeypatch, caplog):
    check_backend("pallas_tpu", part, monkeypatch, caplog)


class CountingReference(ReferenceBackend):
    """The token-serial reference as a backend, counting its calls."""

    name = "edges_counting_reference"
    calls = 0

    def forward(self, *args, **kwargs):
        type(self).calls += 1
        return super().forward(*args, **kwargs)


@pytest.fixture
def counting():
    CountingReference.calls = 0
    gdn2core.register_backend(CountingReference(), replace=True)
    yield CountingReference
    gdn2core.unregister_backend(CountingReference.name)


def test_core_answers_no_token_without_a_backend(counting):
    """T = 0 never reaches a backend (the core answers it: o empty, h_final = h0 bit for bit),
    with h0, segment_ids, cu_seqlens and the fused activations; one token does reach it. Before
    the core answered, every such call ran the backend (and jax_ref and scan_baseline crashed)."""
    for edge in ("T = 0", "T = 0, segment_ids", "T = 0, cu_seqlens", "T = 0, every feature"):
        e = EDGES[edge]
        x = {n: jnp.asarray(a) for n, a in make_inputs(e, 8, 8)[0].items()}
        gate = {"A_log": x["A_log"], "dt_bias": x["dt_bias"]} if e.gate else {}
        args = [x[n] for n in INPUT_NAMES]
        o, h = gdn2_forward(*args, None, x["h0"], backend=counting.name, **e.features(), **gate)
        assert o.shape == (e.B, 0, e.value_heads, 8) and np.array_equal(h, x["h0"]), edge
    assert counting.calls == 0
    x, _, _ = make_inputs(EDGES["T = 1"], 8, 8)
    gdn2_forward(*[x[n] for n in INPUT_NAMES], None, x["h0"], backend=counting.name)
    assert counting.calls == 1


def test_jax_ref_chunk_states_of_no_token():
    """jax_ref's own chunk-state forward (below the core) gives ceil(T / bt) entries too: none for
    T = 0 (it gave one), one for T = 1 (h0 bit for bit)."""
    from gdn2_jax_ref.forward import gdn2_chunk_forward_chunk_states
    from gdn2_jax_ref.params import ChunkParams
    from gdn2core.ops.forward.spec import OpSpec

    for T, entries in ((0, 0), (1, 1)):
        x, _, _ = make_inputs(Edge(T=T), 8, 8)
        args = [jnp.asarray(x[n]) for n in INPUT_NAMES]
        params = ChunkParams.from_spec(
            OpSpec.from_inputs(*args, None, x["h0"]), KernelConfig(bt=BT)
        )
        _, _, chunks = gdn2_chunk_forward_chunk_states(*args, jnp.asarray(x["h0"]), params)
        assert chunks.shape == (2, entries, 2, 8, 8), (T, chunks.shape)
        assert np.array_equal(chunks[:, :1], np.asarray(x["h0"])[:, None][:, :entries])


@pytest.mark.parametrize("backend", ["jax_ref", "scan_baseline"])
def test_layer_one_token_with_segment_ids_and_attention_mask(backend):
    """The layer's generation-step shape, one token, through segment_ids and attention_mask: the
    same y (and, with segment_ids, gradient in x) as the same layer on the token-serial reference
    backend; a padded token gives y = 0 exactly. Tolerances: the kit's float32 ones (the layer
    adds projections and norms around the op, computed alike on both sides)."""
    from flax import nnx

    from gdn2core.layers import GDN2Layer

    gdn2core.register_backend(ReferenceBackend("edges_layer_reference"), replace=True)
    try:
        layer = GDN2Layer(32, 2, 8, backend=backend, rngs=nnx.Rngs(0))
        ref = GDN2Layer(32, 2, 8, backend="edges_layer_reference", rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(1), (2, 1, 32), jnp.float32)
        seg, mask = jnp.array([[4], [9]]), jnp.array([[1], [0]])
        close("y (segment_ids)", layer(x, segment_ids=seg), ref(x, segment_ids=seg), TOL_OUT)
        y = layer(x, attention_mask=mask)
        assert np.array_equal(y[1], np.zeros_like(y[1])), "a padded token: y is not 0"
        close("y (attention_mask)", y[0], ref(x, attention_mask=mask)[0], TOL_OUT)
        dx, dx_ref = (
            jax.grad(lambda x, m=m: jnp.sum(jnp.sin(m(x, segment_ids=seg))))(x)
            for m in (layer, ref)
        )
        close("dx (segment_ids)", dx, dx_ref, TOL_GRAD)
    finally:
        gdn2core.unregister_backend("edges_layer_reference")
