"""The conformance suite: what every gdn2 backend must get right, checked against the token-serial
reference, per capability.

Run it against an installed backend with ``gdn2 conformance NAME`` (or ``pytest --gdn2-backend
NAME``): each test checks one :class:`Feature`, and the run ends with pass/fail per capability.
A project runs it on its own targets with one-line subclasses::

    class TestMine(ConformanceSuite):
        targets = (Target("mine", KernelConfig(bt=16, bc=8, mb=4)),)

Adding a case is one line in :data:`CASES`; adding a capability is one :class:`Feature` member
and the tests tagged with it (``@capability(Feature.X)``). A target that lacks a feature does not
run its tests (they are deselected, not skipped) and the summary lists it as not claimed.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from gdn2core.api import gdn2_forward, gdn2_forward_trainable
from gdn2core.config import DEFAULT_CONFIG, KernelConfig
from gdn2core.decode import gdn2_decode
from gdn2core.decode_reference import gdn2_decode_reference
from gdn2core.decode_spec import expand_heads
from gdn2core.platform import default_platform
from gdn2core.spec import OpSpec
from gdn2core.testing.checks import (
    check_central_differences,
    cotangent_loss,
    decode_reference_outputs,
    outputs_and_grads,
    reference_outputs_and_grads,
)
from gdn2core.testing.inputs import (
    GRAD_NAMES,
    Case,
    Decay,
    DecodeCase,
    DecodeInputs,
    Inputs,
    make_decode_inputs,
    make_inputs,
)
from gdn2core.testing.metrics import rel_err, tolerance
from gdn2core.testing.numpy_ref import gated_deltanet_numpy_loop, kda_numpy_loop

#: Small chunks: several chunks at tiny T, fast on a CPU.
SMALL_CONFIG = KernelConfig(bt=16, bc=8, mb=4)


class Feature(enum.StrEnum):
    """A capability the suite checks; a target claims the ones its backend has."""

    FORWARD = "forward"  # float32 o and h_final; the KDA and Gated DeltaNet reductions
    TRAINABLE = "trainable"  # float32 gradients of all seven arguments
    BFLOAT16 = "bfloat16"  # bfloat16 inputs against float32 arithmetic on the same values
    FLOAT64 = "float64"  # float64 outputs and central-difference gradients
    VMAP = "vmap"  # jit(vmap(...)) and grad of the call compose
    DECODE = "decode"  # gdn2_decode: outputs, pool, token states, untouched slots, skipped ones
    CHUNK_STATES = "chunk-states"  # gdn2_forward(..., return_chunk_states=True)


#: What a :class:`Target` claims unless told otherwise: the chunked operator's features. The
#: serving features (decode, chunk states) are claimed explicitly, or from the capabilities
#: (:meth:`Target.for_backend`).
BASE_FEATURES: frozenset[Feature] = frozenset(Feature) - {Feature.DECODE, Feature.CHUNK_STATES}


def capability(feature: Feature, *also: Feature) -> Callable:
    """Tag a suite test with the feature it checks (and any others it needs as well).

    Args:
        feature: the feature the test's result counts for.
        *also: further features a target must claim for the test to run (e.g. bfloat16 decode).

    Returns:
        A decorator that records the features on the test function.
    """

    def tag(fn):
        fn.gdn2_feature = feature
        fn.gdn2_requires = frozenset((feature, *also))
        return fn

    return tag


@dataclasses.dataclass(frozen=True)
class CaseSpec:
    """A case relative to a target: its length from the chunk length C, its head sizes by index
    into the target's ``head_sizes``. ``quick``: also in the subset of a quick target."""

    id: str
    T: Callable[[int], int]
    heads: int = 0
    B: int = 1
    H: int = 1
    h0: bool = True
    b_max: float = 1.0
    decay: Decay = Decay.MIXED
    seed: int = 0
    quick: bool = False

    def build(self, target: Target) -> Case:
        """The concrete :class:`Case` for ``target``."""
        sizes = target.head_sizes
        dk, dv = sizes[min(self.heads, len(sizes) - 1)]
        return Case(
            B=self.B, T=self.T(target.config.bt), H=self.H, dk=dk, dv=dv, h0=self.h0,
            b_max=self.b_max, decay=self.decay, seed=self.seed,
        )  # fmt: skip


#: T below one chunk, T = 1, T not a multiple of the chunk; dk != dv both ways; with and without
#: h0; b in (0, 1) and (0, 2) (negative eigenvalues); weak, mixed and strong (g = -30) decay.
CASES: tuple[CaseSpec, ...] = (
    CaseSpec("chunks", lambda C: 2 * C + 3, B=2, H=2, b_max=2.0, seed=1, quick=True),
    CaseSpec("strong", lambda C: 2 * C + 1, heads=1, decay=Decay.STRONG, seed=2, quick=True),
    CaseSpec("short", lambda C: max(1, C // 2 - 1), H=2, h0=False, decay=Decay.WEAK, seed=3),
    CaseSpec("one-token", lambda C: 1, heads=1, seed=4),
    CaseSpec(
        "tall", lambda C: C + 5, heads=2, H=2, h0=False, b_max=2.0, decay=Decay.STRONG, seed=5
    ),
)


@dataclasses.dataclass(frozen=True)
class DecodeCaseSpec:
    """A decode case relative to a target: ``S`` from the chunk length C, head sizes by index into
    the target's ``head_sizes`` (as :class:`CaseSpec`)."""

    id: str
    S: Callable[[int], int]
    N: int = 2
    H: int = 1
    HV: int = 1
    gate_heads: int = 0
    heads: int = 0
    P: int = 0
    b_max: float = 1.0
    decay: Decay = Decay.MIXED
    seed: int = 0
    quick: bool = False

    def build(self, target: Target) -> DecodeCase:
        """The concrete :class:`DecodeCase` for ``target``."""
        sizes = target.head_sizes
        dk, dv = sizes[min(self.heads, len(sizes) - 1)]
        return DecodeCase(
            N=self.N, S=self.S(target.config.bt), H=self.H, HV=self.HV,
            gate_heads=self.gate_heads, dk=dk, dv=dv, P=self.P, b_max=self.b_max,
            decay=self.decay, seed=self.seed,
        )  # fmt: skip


#: One token against a larger pool (slots in a random order); grouped value heads with b, g per
#: key head and strong decay, b up to 2, no indices; b, g per value head, dk != dv; a whole chunk of
#: tokens (speculative verification).
DECODE_CASES: tuple[DecodeCaseSpec, ...] = (
    DecodeCaseSpec("one-token", lambda C: 1, N=3, H=2, HV=2, P=5, seed=11, quick=True),
    DecodeCaseSpec(
        "gva", lambda C: 5, N=2, H=1, HV=2, heads=1, b_max=2.0, decay=Decay.STRONG, seed=12,
        quick=True,
    ),
    DecodeCaseSpec(
        "gva-value-gates", lambda C: 3, N=2, H=1, HV=2, gate_heads=2, heads=2, P=4, seed=13
    ),
    DecodeCaseSpec("chunk", lambda C: C, N=1, H=1, HV=1, P=3, seed=14),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Target:
    """A backend as the suite runs it: the config, head sizes and claimed features.

    Attributes:
        backend: the backend name.
        config: the kernel config of every call.
        head_sizes: ``(dk, dv)`` pairs; the first square, then dk < dv, then dk > dv.
        features: the features the backend claims.
        quick: run only the cases marked quick (for expensive targets).
        name: the test-id prefix (default: the backend name).
    """

    backend: str
    config: KernelConfig = SMALL_CONFIG
    head_sizes: tuple[tuple[int, int], ...] = ((8, 8), (8, 12), (12, 6))
    features: frozenset[Feature] = BASE_FEATURES
    quick: bool = False
    name: str = ""

    @property
    def id(self) -> str:
        """The test-id prefix."""
        return self.name or self.backend

    def cases(self) -> list[Case]:
        """The concrete cases of this target."""
        return [spec.build(self) for spec in CASES if spec.quick or not self.quick]

    def decode_cases(self) -> list[DecodeCase]:
        """The concrete decode cases of this target."""
        return [spec.build(self) for spec in DECODE_CASES if spec.quick or not self.quick]

    @classmethod
    def for_backend(cls, name: str) -> Target:
        """The target of an installed backend, derived from its declared capabilities.

        Head sizes: the two smallest declared key and value sizes (8 and 12 when any size
        goes); config: the first of :data:`CONFIG_CANDIDATES` the backend accepts, in interpret
        mode when this host is not one of its platforms and it supports that; features: from the
        declared dtypes, trainability, decode and chunk states (vmap is not claimed in interpret
        mode: JAX's TPU interpret mode does not batch a ``pallas_call``).

        Args:
            name: the backend name.

        Returns:
            The target.

        Raises:
            BackendNotFoundError: the backend is not installed.
            ValueError: no candidate config is accepted here (the message says why).
        """
        from gdn2core.registry import get_backend
        from gdn2core.verdict import verdict

        backend = get_backend(name)
        caps = backend.capabilities
        ks = sorted(caps.dk) if caps.dk else [8, 12]
        k0, k1 = ks[0], ks[min(1, len(ks) - 1)]
        if caps.dv:
            vs = sorted(caps.dv)
            v0, v1 = vs[0], vs[min(1, len(vs) - 1)]
            square = (k0, k0 if k0 in vs else v0)
        else:
            v0, v1 = max(1, k1 // 2), k0 + 4
            square = (k0, k0)
        heads = tuple(dict.fromkeys((square, (k0, v1), (k1, v0))))
        here = default_platform()
        interpret = here not in caps.platforms and caps.interpret
        dtype = "float32" if "float32" in caps.dtypes else caps.dtypes[0]
        spec = OpSpec(1, 16, 1, heads[0][0], heads[0][1], dtype, 1.0)
        reasons = []
        for candidate in CONFIG_CANDIDATES:
            config = candidate.model_copy(update={"interpret": interpret})
            answer = verdict(backend, spec, config, trainable=False, auto=False, platform=here)
            if answer:
                break
            reasons.append(f"bt={config.bt} bc={config.bc} mb={config.mb}: {answer.reason}")
        else:
            raise ValueError(f"gdn2 backend {name!r} accepts no config here: {'; '.join(reasons)}")
        features = {Feature.FORWARD}
        features |= {Feature.TRAINABLE} if caps.trainable else set()
        features |= {Feature.BFLOAT16} if "bfloat16" in caps.dtypes else set()
        features |= {Feature.FLOAT64} if "float64" in caps.dtypes else set()
        features |= set() if interpret else {Feature.VMAP}
        features |= {Feature.DECODE} if caps.decode else set()
        features |= {Feature.CHUNK_STATES} if caps.chunk_states else set()
        return cls(name, config, heads, frozenset(features))


#: Configs :meth:`Target.for_backend` tries, in order.
CONFIG_CANDIDATES: tuple[KernelConfig, ...] = (
    SMALL_CONFIG,
    KernelConfig(bt=16, bc=8, mb=8),
    DEFAULT_CONFIG,
)


def assert_close(name: str, actual, expected, dtype: str) -> None:
    """Fail, naming the array, the error and the tolerance, when ``actual`` is off.

    Args:
        name: the array's label (``"o"``, ``"h_final"``, ``"dq"``, ``"o (decode)"``...; it
            selects the tolerance, :func:`~gdn2core.testing.metrics.quantity`).
        actual: the backend's array.
        expected: the reference's.
        dtype: the input dtype of the call (selects the tolerance).
    """
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    err, tol = rel_err(actual, expected), tolerance(dtype, name, default_platform())
    assert err <= tol, f"{name}: relative error {err:.2e} > tolerance {tol:.0e} ({dtype})"


def _check_forward(target: Target, x: Inputs, dtype: str) -> None:
    o, h = gdn2_forward(*x.args, h0=x.h0, config=target.config, backend=target.backend)
    o_ref, h_ref, _ = reference_outputs_and_grads(x)
    state = jnp.float64 if x.q.dtype == jnp.float64 else jnp.float32
    assert o.dtype == x.v.dtype, f"o: dtype {o.dtype}, expected v's {x.v.dtype}"
    assert h.dtype == state, f"h_final: dtype {h.dtype}, expected {jnp.dtype(state).name}"
    assert_close("o", o, o_ref, dtype)
    assert_close("h_final", h, h_ref, dtype)


def _trainable(target: Target):
    def fn(q, k, v, w, b, g, h0):
        return gdn2_forward_trainable(
            q, k, v, w, b, g, h0=h0, config=target.config, backend=target.backend
        )

    return fn


def _check_grads(target: Target, x: Inputs, dtype: str) -> None:
    _, _, grads = outputs_and_grads(_trainable(target), x)
    _, _, expected = reference_outputs_and_grads(x)
    for name, got, want in zip(GRAD_NAMES, grads, expected, strict=True):
        assert_close(name, got, want, dtype)


def _beta_gates(target: Target, scalar_decay: bool, decay: Decay, seed: int):
    """Inputs with ``b = w = beta`` (one scalar per token and head), optionally scalar ``g``."""
    dk, dv = target.head_sizes[0]
    case = Case(B=1, T=2 * target.config.bt + 3, H=2, dk=dk, dv=dv, decay=decay, seed=seed)
    x = make_inputs(case)
    rng = np.random.default_rng(seed + 100)
    beta = jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((case.B, case.T, case.H)))))
    b = jnp.broadcast_to(beta[..., None], x.b.shape).astype(jnp.float32)
    w = jnp.broadcast_to(beta[..., None], x.w.shape).astype(jnp.float32)
    g = jnp.broadcast_to(x.g[..., :1], x.g.shape) if scalar_decay else x.g
    o, h = gdn2_forward(
        x.q, x.k, x.v, w, b, g, 0.5, x.h0, config=target.config, backend=target.backend
    )
    return x, beta, g, o, h


#: Where :meth:`ConformanceSuite.test_forget_gates` sets g to "forget" (-inf, or below float32's
#: exp underflow): some channels of one token, every channel of a token in one head, a run of
#: three tokens on one channel, the first token, and the last token (T is no multiple of the
#: chunk, so a padded tail follows it).
def forget_mask(case: Case) -> np.ndarray:
    """[B, T, H, dk] bool: the entries of g set to "forget" (see above)."""
    m = np.zeros((case.B, case.T, case.H, case.dk), dtype=bool)
    m[:, min(5, case.T - 1), :, :3] = True
    m[0, case.T // 2, case.H - 1, :] = True
    m[case.B - 1, case.T // 3 : case.T // 3 + 3, 0, case.dk - 1] = True
    m[0, 0, 0, 1 % case.dk] = True
    m[case.B - 1, case.T - 1, case.H - 1, : max(1, case.dk // 2)] = True
    return m


#: dg relative to max |dg|, float32 inputs, uniformly strong and mixed decay: terms of dg whose
#: decay factor is exp(0) (a token paired with itself) are O(1) while the true dg is ~1e-8; an
#: implementation that adds and cancels them leaves an error of 2-10 x max |dg| (measured on
#: a chunked backend before it dropped them), one that does not stays below ~5e-5 (float32 rounding of the
#: cumulative decay). The float32 reference itself is within ~5e-7 of float64 here.
TOL_DG_OWN_SIZE = 1e-3


def _with_g(x: Inputs, g) -> Inputs:
    return dataclasses.replace(x, g=jnp.asarray(g, x.g.dtype))


def _forget_inputs(target: Target) -> list[tuple[Inputs, np.ndarray | None]]:
    """Inputs with g = -inf (and the mask of those entries) and with g = -3e38 (mask None: its
    exp underflows, but its gradient need not be exactly 0 in every formulation)."""
    dk, dv = target.head_sizes[1 % len(target.head_sizes)]
    case = Case(B=2, T=2 * target.config.bt + 13, H=2, dk=dk, dv=dv, b_max=2.0, seed=31)
    base, mask = make_inputs(case), forget_mask(case)
    return [
        (_with_g(base, jnp.where(mask, -np.inf, base.g)), mask),
        (_with_g(base, jnp.where(mask, -3e38, base.g)), None),
    ]


def _decode(target: Target, x: DecodeInputs, *, jit: bool = False, donate: bool = False):
    """``(o, new_state, token_states)`` of the target's decode on ``x`` (eager, or under
    ``jax.jit``, optionally with the pool donated)."""

    def run(q, k, v, w, b, g, state, idx):
        return gdn2_decode(
            q, k, v, w, b, g, state, state_indices=idx, return_token_states=True,
            config=target.config, backend=target.backend,
        )  # fmt: skip

    args = (*x.args, x.state, x.state_indices)
    if not jit:
        return run(*args)
    return jax.jit(run, donate_argnums=(6,) if donate else ())(*args)


def _bits(x) -> bytes:
    return np.asarray(x).tobytes()


def _slots(x: DecodeInputs) -> np.ndarray:
    n = x.q.shape[0]
    return np.arange(n) if x.state_indices is None else np.asarray(x.state_indices)


def _check_decode(x: DecodeInputs, dtype: str, outputs) -> None:
    """Outputs, pool and token states against the decode reference; dtypes; every slot not named
    bit for bit as given; the slot written back bit for bit the last token state."""
    o, pool, states = outputs
    o_ref, pool_ref, states_ref = decode_reference_outputs(x)
    pool_dtype = x.state.dtype
    assert o.dtype == x.v.dtype, f"o: dtype {o.dtype}, expected v's {x.v.dtype}"
    for name, arr in (("state", pool), ("token_states", states)):
        assert arr.dtype == pool_dtype, (
            f"{name}: dtype {arr.dtype}, expected the pool's {pool_dtype}"
        )
    # a bfloat16 pool rounds the state: judged at the bfloat16 tolerance
    state_dtype = "bfloat16" if pool_dtype == jnp.bfloat16 else dtype
    assert_close("o (decode)", o, o_ref, dtype)
    assert_close("state (decode)", pool, pool_ref, state_dtype)
    assert_close("token_states (decode)", states, states_ref, state_dtype)
    slots = _slots(x)
    others = np.setdiff1d(np.arange(x.state.shape[0]), slots)
    assert _bits(np.asarray(pool)[others]) == _bits(np.asarray(x.state)[others]), (
        f"state: slots {others.tolist()} were not named but changed"
    )
    assert _bits(np.asarray(pool)[slots]) == _bits(np.asarray(states)[:, -1]), (
        "state: the slots written back differ from the last token states"
    )


def _forward_from_slots(target: Target, x: DecodeInputs):
    """The chunked forward (the target's own) over the decode tokens, from the named slots."""
    heads = x.v.shape[2]
    q, k, b, g = (expand_heads(a, heads) for a in (x.q, x.k, x.b, x.g))
    h0 = jnp.asarray(np.asarray(x.state.astype(jnp.float32))[_slots(x)])
    return gdn2_forward(q, k, x.v, x.w, b, g, h0=h0, config=target.config, backend=target.backend)


#: The sequences of :meth:`ConformanceSuite.test_decode_skipped_sequences_under_jit`: slot 2, an
#: index past the pool, slot 5 twice, a negative index.
SKIP_INDICES = (2, 9, 5, 5, -1)


class ConformanceSuite:
    """The suite's tests. Subclass it with ``targets`` set (or leave None: the targets of
    ``--gdn2-backend``); the gdn2 pytest plugin parametrizes every test over them."""

    targets: ClassVar[tuple[Target, ...] | None] = None

    @capability(Feature.FORWARD)
    def test_forward(self, gdn2_target: Target, gdn2_case: Case):
        """float32 o and h_final against the reference; output dtypes."""
        _check_forward(gdn2_target, make_inputs(gdn2_case), "float32")

    @capability(Feature.TRAINABLE)
    def test_gradients(self, gdn2_target: Target, gdn2_case: Case):
        """float32 gradients of all seven arguments against the reference's autodiff."""
        _check_grads(gdn2_target, make_inputs(gdn2_case), "float32")

    @capability(Feature.BFLOAT16)
    def test_bfloat16(self, gdn2_target: Target, gdn2_case: Case):
        """bfloat16 inputs against float32 arithmetic on the same bfloat16 values."""
        x = make_inputs(gdn2_case).astype(jnp.bfloat16)
        _check_forward(gdn2_target, x, "bfloat16")
        if Feature.TRAINABLE in gdn2_target.features:
            _check_grads(gdn2_target, x, "bfloat16")

    @capability(Feature.FLOAT64)
    def test_float64_central_differences(self, gdn2_target: Target, gdn2_x64):
        """float64 outputs, and directional derivatives of the backend's own loss against
        central differences (derivation-independent)."""
        case = CASES[1].build(gdn2_target)  # strong decay, dk != dv, h0
        x = make_inputs(case, jnp.float64)
        _check_forward(gdn2_target, x, "float64")
        if Feature.TRAINABLE not in gdn2_target.features:
            return
        fn = _trainable(gdn2_target)

        def loss(*args):
            o, h = fn(*args)
            return cotangent_loss(o, h, x.do, x.dh)

        check_central_differences(loss, (*x.args, x.h0_or_zeros))

    @capability(Feature.FORWARD)
    def test_reduces_to_kimi_delta_attention(self, gdn2_target: Target):
        """b = w = beta: Kimi Delta Attention, written independently in NumPy."""
        x, beta, g, o, h = _beta_gates(gdn2_target, False, Decay.STRONG, 21)
        o_np, h_np = kda_numpy_loop(x.q, x.k, x.v, g, beta, 0.5, x.h0)
        assert_close("o", o, o_np, "float32")
        assert_close("h_final", h, h_np, "float32")

    @capability(Feature.FORWARD)
    def test_reduces_to_gated_deltanet(self, gdn2_target: Target):
        """Additionally scalar g: Gated DeltaNet in its own transposed convention."""
        x, beta, g, o, h = _beta_gates(gdn2_target, True, Decay.MIXED, 22)
        o_np, h_np = gated_deltanet_numpy_loop(x.q, x.k, x.v, g[..., 0], beta, 0.5, x.h0)
        assert_close("o", o, o_np, "float32")
        assert_close("h_final", h, h_np, "float32")

    @capability(Feature.VMAP)
    def test_jit_vmap_grad(self, gdn2_target: Target):
        """jit(vmap(...)) over an extra leading axis equals the per-slice calls; with gradients,
        grad of a loss that uses both o and h_final is finite."""
        dk, dv = gdn2_target.head_sizes[0]
        xs = [
            make_inputs(Case(B=1, T=gdn2_target.config.bt + 3, H=1, dk=dk, dv=dv, seed=s))
            for s in (0, 1, 2)
        ]
        stacked = [jnp.stack([(*x.args, x.h0)[i] for x in xs]) for i in range(7)]
        trainable = Feature.TRAINABLE in gdn2_target.features
        op = gdn2_forward_trainable if trainable else gdn2_forward

        def run(q, k, v, w, b, g, h0):
            return op(
                q, k, v, w, b, g, h0=h0, config=gdn2_target.config, backend=gdn2_target.backend
            )

        o, h = jax.jit(jax.vmap(run))(*stacked)
        for i, x in enumerate(xs):
            o_i, h_i = run(*x.args, x.h0)
            assert_close("o", o[i], o_i, "float32")
            assert_close("h_final", h[i], h_i, "float32")
        if not trainable:
            return

        def loss(*args):
            o, h = run(*args)
            return jnp.sum(o**2) + jnp.sum(h)

        grads = jax.grad(loss, argnums=tuple(range(7)))(*[s[0] for s in stacked])
        for name, gr in zip(GRAD_NAMES, grads, strict=True):
            assert bool(jnp.all(jnp.isfinite(gr))), f"{name}: non-finite gradient under vmap"

    @capability(Feature.FORWARD)
    def test_forget_gates(self, gdn2_target: Target):
        """g = -inf ("forget this channel entirely") and g = -3e38 on some entries: the
        reference's o and h_final (finite, not NaN)."""
        for x, _ in _forget_inputs(gdn2_target):
            _check_forward(gdn2_target, x, "float32")

    @capability(Feature.TRAINABLE)
    def test_forget_gates_gradients(self, gdn2_target: Target):
        """The same: all seven gradients as the reference's; dg exactly 0 where g = -inf, as in
        the reference (d/dg of exp(g) S is exp(g) S = 0)."""
        for x, mask in _forget_inputs(gdn2_target):
            _check_grads(gdn2_target, x, "float32")
            if mask is not None:
                _, _, grads = outputs_and_grads(_trainable(gdn2_target), x)
                dg = np.asarray(grads[5])[mask]
                assert np.all(dg == 0), f"dg: {np.count_nonzero(dg)} nonzero where g = -inf"

    @capability(Feature.TRAINABLE)
    def test_dg_relative_to_its_own_size(self, gdn2_target: Target):
        """Uniformly strong decay (g = -20 x U(0.9, 1.1) on every entry: true dg ~1e-8) and
        mixed decay: max |dg - dg_ref| <= TOL_DG_OWN_SIZE max |dg_ref|, with T no multiple of
        the chunk (a padded tail)."""
        dk, dv = gdn2_target.head_sizes[0]
        case = Case(B=1, T=3 * gdn2_target.config.bt + 5, H=2, dk=dk, dv=dv, b_max=2.0, seed=32)
        base = make_inputs(case)
        rng = np.random.default_rng(33)
        strong = _with_g(base, -20.0 * rng.uniform(0.9, 1.1, base.g.shape))
        for label, x in (("uniformly strong", strong), ("mixed", base)):
            _, _, grads = outputs_and_grads(_trainable(gdn2_target), x)
            _, _, expected = reference_outputs_and_grads(x)
            err = rel_err(grads[5], expected[5])
            assert err <= TOL_DG_OWN_SIZE, (
                f"dg ({label} decay): error {err:.2e} of max |dg| > {TOL_DG_OWN_SIZE:.0e}"
            )

    @capability(Feature.FORWARD)
    def test_x64_enabled(self, gdn2_target: Target, gdn2_x64):
        """float32 inputs with ``jax_enable_x64`` on (as users who need float64 elsewhere run):
        the call traces and compiles, and matches the reference."""
        _check_forward(gdn2_target, make_inputs(CASES[0].build(gdn2_target)), "float32")

    @capability(Feature.TRAINABLE)
    def test_x64_enabled_gradients(self, gdn2_target: Target, gdn2_x64):
        """The same, for the gradients."""
        _check_grads(gdn2_target, make_inputs(CASES[0].build(gdn2_target)), "float32")

    @capability(Feature.DECODE)
    def test_decode(self, gdn2_target: Target, gdn2_decode_case: DecodeCase):
        """float32: o, the pool and the per-token states against the decode reference; untouched
        slots bit-identical; and o and the final states against the target's chunked forward over
        the same tokens from the same states."""
        x = make_decode_inputs(gdn2_decode_case)
        outputs = _decode(gdn2_target, x)
        _check_decode(x, "float32", outputs)
        o_fwd, h_fwd = _forward_from_slots(gdn2_target, x)
        assert_close("o", outputs[0], o_fwd, "float32")
        assert_close("h_final", np.asarray(outputs[1])[_slots(x)], h_fwd, "float32")

    @capability(Feature.DECODE)
    def test_decode_bfloat16_pool(self, gdn2_target: Target):
        """A bfloat16 pool: float32 arithmetic from its values, rounded once when written back."""
        for spec in DECODE_CASES[:2]:
            x = make_decode_inputs(spec.build(gdn2_target), pool_dtype=jnp.bfloat16)
            _check_decode(x, "float32", _decode(gdn2_target, x))

    @capability(Feature.DECODE, Feature.BFLOAT16)
    def test_decode_bfloat16(self, gdn2_target: Target):
        """bfloat16 inputs with a float32 and with a bfloat16 pool."""
        case = DECODE_CASES[1].build(gdn2_target)
        for pool_dtype in (jnp.float32, jnp.bfloat16):
            x = make_decode_inputs(case, jnp.bfloat16, pool_dtype)
            _check_decode(x, "bfloat16", _decode(gdn2_target, x))

    @capability(Feature.DECODE, Feature.FLOAT64)
    def test_decode_float64(self, gdn2_target: Target, gdn2_x64):
        """float64 inputs and pool."""
        case = DECODE_CASES[0].build(gdn2_target)
        x = make_decode_inputs(case, jnp.float64, jnp.float64)
        _check_decode(x, "float64", _decode(gdn2_target, x))

    @capability(Feature.DECODE)
    def test_decode_in_jit_with_donated_pool(self, gdn2_target: Target, gdn2_x64):
        """Under ``jax.jit`` with the pool donated (``donate_argnums``) and ``jax_enable_x64`` on
        (int64 indices): the same results."""
        x = make_decode_inputs(DECODE_CASES[0].build(gdn2_target))
        x = dataclasses.replace(x, state_indices=x.state_indices.astype(jnp.int64))
        given = x.state.copy()
        outputs = _decode(gdn2_target, x, jit=True, donate=True)
        _check_decode(dataclasses.replace(x, state=given), "float32", outputs)

    @capability(Feature.DECODE)
    def test_decode_skipped_sequences_under_jit(self, gdn2_target: Target):
        """Under ``jax.jit`` an index out of range, or a slot named twice, skips those sequences:
        their outputs are NaN and no slot but the valid sequence's changes."""
        dk, dv = gdn2_target.head_sizes[0]
        case = DecodeCase(N=len(SKIP_INDICES), S=2, H=1, HV=2, dk=dk, dv=dv, P=6, seed=15)
        x = make_decode_inputs(case)
        x = dataclasses.replace(x, state_indices=jnp.asarray(SKIP_INDICES, jnp.int32))
        o, pool, states = _decode(gdn2_target, x, jit=True)
        assert bool(jnp.all(jnp.isnan(o[1:]))), "o: skipped sequences must be NaN"
        assert bool(jnp.all(jnp.isnan(states[1:]))), "token_states: skipped sequences: NaN"
        kept = [s for s in range(6) if s != 2]
        assert _bits(np.asarray(pool)[kept]) == _bits(np.asarray(x.state)[kept]), (
            "state: a slot no valid sequence owns changed"
        )
        first = dataclasses.replace(
            x, **{n: getattr(x, n)[:1] for n in ("q", "k", "v", "w", "b", "g")},
            state_indices=x.state_indices[:1],
        )  # fmt: skip
        _check_decode(first, "float32", (o[:1], pool, states[:1]))

    @capability(Feature.CHUNK_STATES)
    def test_chunk_states(self, gdn2_target: Target, gdn2_case: Case):
        """``return_chunk_states=True``: o and h_final as without it, and entry ``i`` the
        reference's state after the first ``i * bt`` tokens."""
        x = make_inputs(gdn2_case)
        C = gdn2_target.config.bt
        o, h, chunks = gdn2_forward(
            *x.args, h0=x.h0, config=gdn2_target.config, backend=gdn2_target.backend,
            return_chunk_states=True,
        )  # fmt: skip
        o_ref, h_ref, _ = reference_outputs_and_grads(x)
        assert_close("o", o, o_ref, "float32")
        assert_close("h_final", h, h_ref, "float32")
        n_chunks = -(-gdn2_case.T // C)
        B, H, dk, dv = gdn2_case.B, gdn2_case.H, gdn2_case.dk, gdn2_case.dv
        assert chunks.shape == (B, n_chunks, H, dk, dv), f"chunk_states: shape {chunks.shape}"
        assert chunks.dtype == h.dtype, f"chunk_states: dtype {chunks.dtype}, expected {h.dtype}"
        # the reference's state after every token: the decode reference over all T tokens
        with jax.default_matmul_precision("highest"):
            _, _, after = jax.jit(gdn2_decode_reference, static_argnums=(9,))(
                *x.args, x.h0_or_zeros, None, None, True
            )  # [B, T, H, dk, dv]
        for i in range(n_chunks):
            h_i = x.h0_or_zeros if i == 0 else after[:, i * C - 1]
            assert_close(f"h_final (chunk {i})", chunks[:, i], h_i, "float32")


class TestInstalledBackends(ConformanceSuite):
    """The suite against the backends named by ``--gdn2-backend`` (``targets = None``)."""


__all__ = [
    "BASE_FEATURES",
    "CASES",
    "CONFIG_CANDIDATES",
    "DECODE_CASES",
    "SMALL_CONFIG",
    "TOL_DG_OWN_SIZE",
    "CaseSpec",
    "ConformanceSuite",
    "DecodeCaseSpec",
    "Feature",
    "Target",
    "assert_close",
    "capability",
]
