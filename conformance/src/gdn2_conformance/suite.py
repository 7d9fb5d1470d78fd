"""The conformance suite: what every gdn2 backend must get right, checked against the token-serial
reference, per capability.

Run it against an installed backend with ``gdn2 conformance NAME`` (or ``pytest --gdn2-backend
NAME``): each test checks one :class:`Feature`, and the run ends with pass/fail per capability.
A project runs it on its own targets with one-line subclasses::

    class TestMine(ConformanceSuite):
        targets = (Target("mine", KernelConfig(bt=16)),)

Adding a case is one line in :data:`CASES`; adding a capability is one :class:`Feature` member
and the tests tagged with it (``@capability(Feature.X)``). A target that lacks a feature does not
run its tests (they are deselected, not skipped) and the summary lists it as not claimed. The
targets, features and cases are in :mod:`gdn2_conformance.target`; the tests of the model
features (grouped value heads, fused activations, packed sequences) in
:mod:`gdn2_conformance.feature_suite`; those of the serving ops (decode, chunk states) in
:mod:`gdn2_conformance.decode_suite`; that of a float32 ``g`` beside bfloat16 inputs in
:mod:`gdn2_conformance.decay_suite`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from gdn2_conformance.checks import (
    check_central_differences,
    cotangent_loss,
    outputs_and_grads,
    reference_outputs_and_grads,
)
from gdn2_conformance.decay_suite import DecayDtypeTests
from gdn2_conformance.decode_suite import DecodeTests
from gdn2_conformance.feature_suite import FeatureTests
from gdn2_conformance.inputs import GRAD_NAMES, Case, Decay, Inputs, make_inputs
from gdn2_conformance.metrics import assert_close, rel_err
from gdn2_conformance.numpy_ref import gated_deltanet_numpy_loop, kda_numpy_loop
from gdn2_conformance.target import (
    CASES,
    CONFIG_CANDIDATES,
    SMALL_CONFIG,
    CaseSpec,
    Feature,
    Target,
    capability,
)
from gdn2core.ops.forward.api import gdn2_forward, gdn2_forward_trainable


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


def _scalar_gate_inputs(target: Target, scalar_decay: bool, seed: int) -> Inputs:
    """Inputs whose ``b = w = beta`` are ``(B, T, H)`` scalar gates (as ``chunk_kda`` passes
    them), and with ``scalar_decay`` also ``g`` (``chunk_gated_delta_rule``)."""
    dk, dv = target.head_sizes[0]
    bt = target.config.bt
    case = Case(B=2, T=2 * bt + 5, H=2, dk=dk, dv=dv, decay=Decay.MIXED, seed=seed)
    x = make_inputs(case)
    rng = np.random.default_rng(seed + 200)
    beta = jnp.asarray(rng.uniform(0.05, 1.0, (case.B, case.T, case.H)), x.b.dtype)
    g = x.g[..., 0] if scalar_decay else x.g  # [B, T, H]: one decay per head and token
    return dataclasses.replace(x, w=beta, b=beta, g=g)


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


class ConformanceSuite(FeatureTests, DecodeTests, DecayDtypeTests):
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
        if Feature.TRAINABLE in gdn2_target.claimed():
            _check_grads(gdn2_target, x, "bfloat16")

    @capability(Feature.FLOAT64)
    def test_float64_central_differences(self, gdn2_target: Target, gdn2_x64):
        """float64 outputs, and directional derivatives of the backend's own loss against
        central differences (derivation-independent)."""
        case = CASES[1].build(gdn2_target)  # strong decay, dk != dv, h0
        x = make_inputs(case, jnp.float64)
        _check_forward(gdn2_target, x, "float64")
        if Feature.TRAINABLE not in gdn2_target.claimed():
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

    @capability(Feature.FORWARD)
    def test_scalar_gates(self, gdn2_target: Target):
        """b, w as ``(B, T, H)`` scalar gates (KDA), and g too (GDN): the NumPy KDA and GDN loops'
        o and h_final. A backend that declares ``Capabilities.scalar_gates`` reads them itself;
        any other gets them broadcast by the core."""
        for scalar_decay, loop in ((False, kda_numpy_loop), (True, gated_deltanet_numpy_loop)):
            x = _scalar_gate_inputs(gdn2_target, scalar_decay, 23)
            o, h = gdn2_forward(
                *x.args, 0.5, x.h0, config=gdn2_target.config, backend=gdn2_target.backend
            )
            o_np, h_np = loop(x.q, x.k, x.v, x.g, x.b, 0.5, x.h0)
            assert_close("o", o, o_np, "float32")
            assert_close("h_final", h, h_np, "float32")

    @capability(Feature.TRAINABLE)
    def test_scalar_gates_gradients(self, gdn2_target: Target):
        """The same calls' seven gradients as the reference's: a scalar gate's is the sum over
        its channels (the reference's autodiff through its broadcast)."""
        for scalar_decay in (False, True):
            _check_grads(gdn2_target, _scalar_gate_inputs(gdn2_target, scalar_decay, 24),
                         "float32")  # fmt: skip

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
        trainable = Feature.TRAINABLE in gdn2_target.claimed()
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


class TestInstalledBackends(ConformanceSuite):
    """The suite against the backends named by ``--gdn2-backend`` (``targets = None``)."""


__all__ = [
    "CASES",
    "CONFIG_CANDIDATES",
    "SMALL_CONFIG",
    "TOL_DG_OWN_SIZE",
    "CaseSpec",
    "ConformanceSuite",
    "Feature",
    "Target",
    "assert_close",
    "capability",
]
