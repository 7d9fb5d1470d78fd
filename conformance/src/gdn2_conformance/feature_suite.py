"""The conformance tests of the model features (grouped value heads, fused activations, packed
sequences), against the token-serial reference, which implements each of them independently of
the core. :class:`FeatureTests` is a mixin of :class:`~gdn2_conformance.ConformanceSuite`.

Packing (chunk length C = the target's ``bt``, T = 2C + 7): with ``segment_ids`` row 0 holds
sequences of lengths 3, 1, 1, 2 (four starts in the first chunk, two of length 1), C + 1 (across
a chunk boundary), 1 and C - 2; row 1 starts sequences exactly at the chunk boundaries (C, C, 7)
with ids that alternate between two values. With ``cu_seqlens``: lengths 3, 0, 1, C + 2, 1, 2,
C - 2, 0 (two empty sequences, one of them last).

Tolerances, beyond the kit's table (:mod:`gdn2_conformance.metrics`):

- :data:`TOL_UNFUSED` (float32, relative): the fused op on raw inputs against the same backend's
  unfused op on inputs activated in float64 NumPy. Both run the same recurrence on inputs that
  differ by the rounding of the activation to float32 (an ulp, 6e-8); the recurrence amplifies
  that a few-fold: 1e-5 (the issue's bound). A missing or wrong activation is O(1). On a GPU or
  TPU a fused kernel computes the activations with the chip's own exp, log1p, rsqrt and division,
  which need not be correctly rounded as XLA's on a CPU are: a TPU v5e gave 8.3e-5 (o, with the
  l2 norm, the softplus gate and the sigmoids; docs/results.md, "A first run on a TPU v5e").
  There the bound is multiplied by the kit's ``ACCELERATOR_FLOAT32_FACTOR``
  (:func:`unfused_tolerance`), as the float32 entries of its table are; the same test checks the
  fused op against the reference at the table's tolerance too.
- :data:`TOL_GVA_PLAIN` (float32, relative): a grouped call against the same backend's plain call
  on q, k (and b, g) repeated to HV heads. The same arithmetic per value column; only the
  blocking of the matmuls over value columns may differ: 1e-5. A wrong head mapping is O(1).
- no leakage: exact. A result of one sequence must not depend on another's tokens by an ulp.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_conformance.checks import (
    check_central_differences,
    cotangent_loss,
    op_function,
    outputs_and_grads,
    reference_outputs,
    reference_outputs_and_grads,
)
from gdn2_conformance.feature_inputs import (
    FeatureCase,
    GateHeads,
    activate_numpy,
    make_feature_inputs,
)
from gdn2_conformance.inputs import Inputs
from gdn2_conformance.metrics import ACCELERATOR_FLOAT32_FACTOR, assert_close, rel_err
from gdn2_conformance.target import Feature, Target, capability
from gdn2core.ops.forward.api import gdn2_forward, gdn2_forward_trainable
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.options import Activations, GateMode
from gdn2core.platform import default_platform
from gdn2core.registry import get_backend
from gdn2core.verdict import judge

TOL_UNFUSED = 1e-5
TOL_GVA_PLAIN = 1e-5


def unfused_tolerance(platform: str) -> float:
    """:data:`TOL_UNFUSED` where the backend ran: times ``ACCELERATOR_FLOAT32_FACTOR`` off a CPU.

    Args:
        platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``.

    Returns:
        The relative tolerance of the fused op against the unfused one on activated inputs.
    """
    return TOL_UNFUSED * (1.0 if platform == "cpu" else ACCELERATOR_FLOAT32_FACTOR)


#: The activations the suite checks: every option, in two calls. The bounded gate's inputs have a
#: ``dt_bias`` (fla's safe gate ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``:
#: :attr:`FeatureCase.gate_bias`, on by default).
ACTIVATION_CASES: tuple[Activations, ...] = (
    Activations(qk_l2norm=True, gate=GateMode.SOFTPLUS, bw_sigmoid=True),
    Activations(gate=GateMode.LOWER_BOUND, lower_bound=-3.0, bw_sigmoid=True, neg_eigval=True),
)
#: What the fused-activation checks run, as ``(activations, gate_bias)``: every case of
#: :data:`ACTIVATION_CASES` (the bounded gate with dt_bias), and the bounded gate without one
#: (dt_bias is optional there: absent means 0).
FUSED_CASES: tuple[tuple[Activations, bool], ...] = (
    *((act, True) for act in ACTIVATION_CASES),
    (ACTIVATION_CASES[1], False),
)


# --- inputs ----------------------------------------------------------------------------------


def _chunk(target: Target) -> int:
    return max(8, target.config.bt)


def segment_rows(C: int) -> tuple[tuple[int, ...], ...]:
    """The two rows of the segment_ids cases (see the module docstring); T = 2C + 7."""
    return ((3, 1, 1, 2, C + 1, 1, C - 2), (C, C, 7))


def varlen_lengths(C: int) -> tuple[int, ...]:
    """The sequence lengths of the cu_seqlens cases (see the module docstring); T = 2C + 7."""
    return (3, 0, 1, C + 2, 1, 2, C - 2, 0)


def _head_sizes(target: Target, groups: int, gate_heads: GateHeads) -> tuple[int, int]:
    """The first of the target's head sizes whose grouped call the backend accepts (the shared-key
    form runs value heads of ``groups * dv``)."""
    backend = get_backend(target.backend)
    reasons = []
    for dk, dv in target.head_sizes:
        hv = 2 * groups
        spec = OpSpec(1, 16, 2, dk, dv, "float32", 1.0, hv, 2 if gate_heads == "key" else hv)
        answer = judge(backend, spec, target.config, trainable=False, auto=False, platform=None)
        if answer:
            return dk, dv
        reasons.append(f"(dk={dk}, dv={dv}): {answer.reason}")
    pytest.fail(f"no head size of the target runs a grouped call: {'; '.join(reasons)}")


def _case(target: Target, T: int | None = None, **kw) -> FeatureCase:
    """A case at the target's first head sizes that run it; T = C + 5 unless given."""
    groups = kw.get("groups", 1)
    gate_heads = kw.get("gate_heads", GateHeads.KEY)
    dk, dv = _head_sizes(target, groups, gate_heads)
    return FeatureCase(T=T or _chunk(target) + 5, dk=dk, dv=dv, **kw)


def segments_case(target: Target, **kw) -> FeatureCase:
    """B = 2 rows packed by segment_ids (see :func:`segment_rows`)."""
    C = _chunk(target)
    return _case(target, 2 * C + 7, B=2, rows=segment_rows(C), **kw)


def varlen_case(target: Target, **kw) -> FeatureCase:
    """One row packed by cu_seqlens (see :func:`varlen_lengths`)."""
    C = _chunk(target)
    return _case(target, 2 * C + 7, B=1, seqlens=varlen_lengths(C), **kw)


# --- checks ----------------------------------------------------------------------------------


def _arrays(x: Inputs) -> dict:
    return {n: a for n, a in x.options.items() if hasattr(a, "shape")}


def forward_function(target: Target, x: Inputs):
    """``gdn2_forward`` of the target under ``jax.jit``, every array (segment_ids, cu_seqlens
    too) traced: ``f(x.diff_args, arrays) -> (o, h_final)``, for any inputs shaped like ``x``."""
    arrays = _arrays(x)
    flags = {n: a for n, a in x.options.items() if n not in arrays}

    def run(diff, arrays):
        q, k, v, w, b, g, h0, *params = diff
        gate = dict(zip(x.param_names, params, strict=True))
        return gdn2_forward(
            q, k, v, w, b, g, h0=h0, config=target.config, backend=target.backend,
            **arrays, **flags, **gate,
        )  # fmt: skip

    return jax.jit(run)


def _forward(target: Target, x: Inputs) -> tuple[jax.Array, jax.Array]:
    return forward_function(target, x)(x.diff_args, _arrays(x))


def _trainable(target: Target, x: Inputs):
    return op_function(gdn2_forward_trainable, x, config=target.config, backend=target.backend)


def check_forward(target: Target, x: Inputs) -> tuple[jax.Array, jax.Array]:
    """o and h_final of the target against the reference (float32 tolerances); returns them."""
    o, h = _forward(target, x)
    o_ref, h_ref = reference_outputs(x)
    assert o.dtype == x.v.dtype, f"o: dtype {o.dtype}, expected v's {x.v.dtype}"
    assert_close("o", o, o_ref, "float32")
    assert_close("h_final", h, h_ref, "float32")
    return o, h


def check_grads(target: Target, x: Inputs) -> None:
    """Every gradient (raw inputs, h0, A_log, dt_bias) against the reference's autodiff."""
    _, _, grads = outputs_and_grads(_trainable(target, x), x)
    _, _, expected = reference_outputs_and_grads(x)
    for name, got, want in zip(x.grad_names, grads, expected, strict=True):
        assert_close(name, got, want, "float32")


def _check_target(target: Target, x: Inputs) -> None:
    check_forward(target, x)
    if Feature.TRAINABLE in target.claimed():
        check_grads(target, x)


def _replace_tokens(x: Inputs, fresh: Inputs, rows, tokens) -> Inputs:
    """``x`` with the token inputs (and o's cotangent) of ``rows``/``tokens`` from ``fresh``."""
    mask = np.zeros(x.q.shape[:2], bool)
    mask[rows, tokens] = True
    m = jnp.asarray(mask)[:, :, None, None]
    names = ("q", "k", "v", "w", "b", "g", "do")
    return dataclasses.replace(
        x, **{n: jnp.where(m, getattr(fresh, n), getattr(x, n)) for n in names}
    )


def _assert_same(name: str, a, b, keep) -> None:
    a, b = np.asarray(a)[keep], np.asarray(b)[keep]
    same = a == b
    if not np.all(same):
        diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
        pytest.fail(
            f"{name}: {np.count_nonzero(~same)} entries of the other sequences changed when one "
            f"sequence's tokens did (max difference {diff:.3e}); expected identical bits"
        )


def check_no_leakage(target: Target, x: Inputs, fresh: Inputs, row: int, span, state_keep):
    """Perturb the tokens ``span`` of ``row`` (one sequence): every output and gradient of the
    other tokens and sequences is identical bit for bit.

    ``state_keep``: the mask over the leading axis of h_final and h0 of the entries that must not
    change (the sequences other than the perturbed one).
    """
    y = _replace_tokens(x, fresh, row, span)
    keep = np.ones(x.q.shape[:2], bool)
    keep[row, span] = False
    forward = forward_function(target, x)  # one program for both
    o_x, h_x = forward(x.diff_args, _arrays(x))
    o_y, h_y = forward(y.diff_args, _arrays(y))
    assert not np.array_equal(np.asarray(o_x)[~keep], np.asarray(o_y)[~keep]), "no perturbation"
    _assert_same("o", o_x, o_y, keep)
    _assert_same("h_final", h_x, h_y, state_keep)
    if Feature.TRAINABLE not in target.claimed():
        return
    trainable = _trainable(target, x)  # y has x's options: one program for both
    _, _, gx = outputs_and_grads(trainable, x)
    _, _, gy = outputs_and_grads(trainable, y)
    for name, a, b in zip(x.grad_names, gx, gy, strict=False):
        if name in ("dA_log", "ddt_bias"):  # shared by every sequence: not per sequence
            continue
        _assert_same(name, a, b, state_keep if name == "dh0" else keep)


def _expect_error(exc, pattern: str, target: Target, x: Inputs, **override) -> None:
    kwargs = {**x.options, **override}
    gate = {n: getattr(x, n) for n in x.param_names}
    gate.update({n: kwargs.pop(n) for n in ("A_log", "dt_bias") if n in kwargs})
    args = [kwargs.pop(n) if n in kwargs else a for n, a in zip("qkvwbg", x.args, strict=True)]
    h0 = kwargs.pop("h0", x.h0)
    with pytest.raises(exc, match=pattern):
        gdn2_forward(*args, h0=h0, config=target.config, backend=target.backend, **kwargs, **gate)


def _assert_within(tol: float, what: str, outputs, expected) -> None:
    """``(o, h_final)`` against ``expected`` within the relative ``tol``."""
    for name, a, e in zip(("o", "h_final"), outputs, expected, strict=True):
        err = rel_err(a, e)
        assert err <= tol, f"{name} ({what}): relative error {err:.2e} > {tol:.0e}"


def _gate_heads(target: Target) -> tuple[GateHeads, ...]:
    """Both layouts of b and g; a quick target only the shared one (the repeated one is the core's
    ``jnp.repeat``, the same for every backend)."""
    return (GateHeads.KEY,) if target.quick else tuple(GateHeads)


class FeatureTests:
    """The model-feature tests (a mixin of the conformance suite)."""

    # --- grouped value heads ---------------------------------------------------------------

    @capability(Feature.GVA)
    def test_gva(self, gdn2_target: Target):
        """HV = 2H, b and g on key heads (shared) and on value heads (a quick target: key heads):
        o and h_final as the reference (which maps value head j to key head j // G natively), and as the same
        backend's plain call on q, k (and b, g) repeated to HV heads."""
        for gate_heads in _gate_heads(gdn2_target):
            x = make_feature_inputs(_case(gdn2_target, groups=2, gate_heads=gate_heads, seed=41))
            o, h = check_forward(gdn2_target, x)
            G = 2
            rep = {n: jnp.repeat(getattr(x, n), G, axis=2) for n in ("q", "k")}
            if gate_heads == GateHeads.KEY:
                rep |= {n: jnp.repeat(getattr(x, n), G, axis=2) for n in ("b", "g")}
            o_plain, h_plain = _forward(gdn2_target, dataclasses.replace(x, **rep))
            what = f"b, g on {gate_heads} heads: grouped vs plain call on repeated inputs"
            _assert_within(TOL_GVA_PLAIN, what, (o, h), (o_plain, h_plain))

    @capability(Feature.GVA, Feature.TRAINABLE)
    def test_gva_gradients(self, gdn2_target: Target):
        """The gradients of a grouped call (q, k summed over their group; b, g on key heads
        likewise) against the reference's autodiff."""
        for gate_heads in _gate_heads(gdn2_target):
            x = make_feature_inputs(_case(gdn2_target, groups=2, gate_heads=gate_heads, seed=42))
            check_grads(gdn2_target, x)

    @capability(Feature.GVA)
    def test_gva_errors(self, gdn2_target: Target):
        """HV not a multiple of H, b/g heads neither H nor HV, h0 with H instead of HV heads."""
        x = make_feature_inputs(_case(gdn2_target, groups=2, seed=43))
        v3 = jnp.concatenate([x.v, x.v[:, :, :1]], axis=2)  # HV = 5, H = 2
        _expect_error(ValueError, r"v: expected HV .* multiple of H=2 .*got HV=5", gdn2_target, x,
                      v=v3, w=v3)  # fmt: skip
        b3 = jnp.concatenate([x.b, x.b[:, :, :1]], axis=2)
        _expect_error(ValueError, r"b: expected shape \(B, T, H, dk\) = .* or \(B, T, HV, dk\)",
                      gdn2_target, x, b=b3)  # fmt: skip
        _expect_error(ValueError, r"g: expected the heads of b", gdn2_target, x,
                      g=jnp.repeat(x.g, 2, axis=2))  # fmt: skip
        _expect_error(ValueError, r"h0: expected shape \(B, HV, dk, dv\)", gdn2_target, x,
                      h0=x.h0[:, :2])  # fmt: skip

    # --- fused activations -----------------------------------------------------------------

    @capability(Feature.FUSED_ACTIVATIONS)
    def test_fused_activations(self, gdn2_target: Target):
        """Every activation on raw inputs: as the same backend's unfused op on the inputs
        activated in float64 NumPy (:func:`unfused_tolerance`), and as the reference, which
        applies them token by token."""
        for seed, (act, bias) in enumerate(FUSED_CASES):
            case = _case(gdn2_target, activations=act, gate_bias=bias, seed=50 + seed)
            x = make_feature_inputs(case)
            o, h = check_forward(gdn2_target, x)
            unfused = _forward(gdn2_target, activate_numpy(x, act))
            what = f"{act} (dt_bias: {x.dt_bias is not None}): fused vs unfused on activated inputs"
            _assert_within(unfused_tolerance(default_platform()), what, (o, h), unfused)

    @capability(Feature.FUSED_ACTIVATIONS, Feature.TRAINABLE)
    def test_fused_activations_gradients(self, gdn2_target: Target):
        """Gradients with respect to the raw inputs, A_log and dt_bias against the reference's
        autodiff."""
        for seed, (act, bias) in enumerate(FUSED_CASES):
            case = _case(gdn2_target, activations=act, gate_bias=bias, seed=52 + seed)
            check_grads(gdn2_target, make_feature_inputs(case))

    @capability(Feature.FUSED_ACTIVATIONS, Feature.FLOAT64, Feature.TRAINABLE)
    def test_fused_activations_central_differences(self, gdn2_target: Target, gdn2_x64):
        """float64: directional derivatives of the backend's own loss in every argument (A_log
        and dt_bias included) against central differences (a quick target: the first
        activation case)."""
        for seed, act in enumerate(ACTIVATION_CASES[: 1 if gdn2_target.quick else None]):
            case = _case(gdn2_target, activations=act, seed=54 + seed)
            x = make_feature_inputs(
                dataclasses.replace(case, T=_chunk(gdn2_target) + 3), jnp.float64
            )
            fn = _trainable(gdn2_target, x)

            def loss(*args, fn=fn, x=x):
                o, h = fn(*args)
                return cotangent_loss(o, h, x.do, x.dh)

            check_central_differences(loss, x.diff_args, names=x.grad_names)

    @capability(Feature.FUSED_ACTIVATIONS)
    def test_fused_activation_errors(self, gdn2_target: Target):
        """A_log / dt_bias missing or misshaped with the fused gate, given without it;
        lower_bound outside [-5, 0) or without the gate; allow_neg_eigval without the sigmoid."""
        x = make_feature_inputs(_case(gdn2_target, activations=ACTIVATION_CASES[0], seed=56))
        _expect_error(ValueError, r"A_log: expected an array of shape \(Hg,\) = \(2,\)",
                      gdn2_target, x, A_log=None)  # fmt: skip
        _expect_error(ValueError, r"dt_bias: expected shape \(Hg, dk\)", gdn2_target, x,
                      dt_bias=x.dt_bias[:, :1])  # fmt: skip
        _expect_error(ValueError, r"lower_bound: expected a float in \[-5, 0\), got -6.0",
                      gdn2_target, x, lower_bound=-6.0, dt_bias=None)  # fmt: skip
        _expect_error(ValueError, r"lower_bound: expected a float in \[-5, 0\), got 0.0",
                      gdn2_target, x, lower_bound=0.0, dt_bias=None)  # fmt: skip
        _expect_error(ValueError, r"dt_bias: expected shape \(Hg, dk\) = \(2, \d+\)",
                      gdn2_target, x, lower_bound=-1.0, dt_bias=x.dt_bias[:, :1])  # fmt: skip
        plain = make_feature_inputs(_case(gdn2_target, seed=57))
        _expect_error(ValueError, r"lower_bound: given \(-1.0\) without use_gate_in_kernel",
                      gdn2_target, plain, lower_bound=-1.0)  # fmt: skip
        _expect_error(ValueError, r"A_log: given but use_gate_in_kernel=False", gdn2_target,
                      plain, A_log=x.A_log)  # fmt: skip
        _expect_error(ValueError, r"allow_neg_eigval: True needs use_bw_sigmoid_in_kernel",
                      gdn2_target, plain, allow_neg_eigval=True)  # fmt: skip

    # --- packed sequences: segment_ids -----------------------------------------------------

    @capability(Feature.SEGMENTS)
    def test_segments(self, gdn2_target: Target):
        """Two rows packed by segment_ids (starts inside chunks, on chunk boundaries, length-1
        sequences, four per chunk; ids any integers, one coming back): o and h_final as the
        reference (the state reset at every start, h0 into the first sequence)."""
        check_forward(gdn2_target, make_feature_inputs(segments_case(gdn2_target, seed=61)))

    @capability(Feature.SEGMENTS, Feature.TRAINABLE)
    def test_segments_gradients(self, gdn2_target: Target):
        """The same: all seven gradients against the reference's autodiff."""
        check_grads(gdn2_target, make_feature_inputs(segments_case(gdn2_target, seed=62)))

    @capability(Feature.SEGMENTS)
    def test_segments_no_leakage(self, gdn2_target: Target):
        """Perturb one sequence (one across a chunk boundary, then one of length 1): every
        output, h_final and gradient of the other sequences is identical bit for bit."""
        case = segments_case(gdn2_target, seed=63)
        x, fresh = (
            make_feature_inputs(case),
            make_feature_inputs(dataclasses.replace(case, seed=64)),
        )
        starts = np.cumsum((0, *case.rows[0]))
        for i in (4, 1):  # sequence 4 crosses a chunk boundary, sequence 1 has one token
            span = slice(int(starts[i]), int(starts[i + 1]))
            rows = np.ones(case.B, bool)  # h0 enters sequence 0, h_final leaves the last one
            check_no_leakage(gdn2_target, x, fresh, 0, span, rows)

    @capability(Feature.SEGMENTS)
    def test_segments_with_gva_and_activations(self, gdn2_target: Target):
        """segment_ids with grouped value heads (b, g shared) and every activation of the first
        activation case: outputs (and gradients, A_log and dt_bias included) as the reference."""
        case = segments_case(gdn2_target, groups=2, activations=ACTIVATION_CASES[0], seed=65)
        _check_target(gdn2_target, make_feature_inputs(case))

    @capability(Feature.SEGMENTS)
    def test_segments_errors(self, gdn2_target: Target):
        """segment_ids of the wrong shape or dtype; segment_ids with cu_seqlens."""
        x = make_feature_inputs(segments_case(gdn2_target, seed=66))
        ids = x.options["segment_ids"]
        _expect_error(ValueError, r"segment_ids: expected shape \(B, T\)", gdn2_target, x,
                      segment_ids=ids[:, :-1])  # fmt: skip
        _expect_error(TypeError, r"segment_ids: expected an integer dtype, got float32",
                      gdn2_target, x, segment_ids=ids.astype(jnp.float32))  # fmt: skip
        _expect_error(ValueError, r"segment_ids, cu_seqlens: expected at most one", gdn2_target,
                      x, cu_seqlens=jnp.array([0, x.q.shape[1]]))  # fmt: skip

    # --- packed sequences: cu_seqlens ------------------------------------------------------

    @capability(Feature.VARLEN)
    def test_varlen(self, gdn2_target: Target):
        """One row packed by cu_seqlens (traced under jit; empty sequences, one last): o, and
        h_final per sequence from h0 per sequence, as the reference."""
        check_forward(gdn2_target, make_feature_inputs(varlen_case(gdn2_target, seed=71)))

    @capability(Feature.VARLEN, Feature.TRAINABLE)
    def test_varlen_gradients(self, gdn2_target: Target):
        """The same: all seven gradients (dh0 per sequence) against the reference's autodiff."""
        check_grads(gdn2_target, make_feature_inputs(varlen_case(gdn2_target, seed=72)))

    @capability(Feature.VARLEN)
    def test_varlen_no_leakage(self, gdn2_target: Target):
        """Perturb one sequence (across a chunk boundary, then one of length 1): every output,
        h_final[n], dh0[n] and gradient of the other sequences is identical bit for bit."""
        case = varlen_case(gdn2_target, seed=73)
        x, fresh = (
            make_feature_inputs(case),
            make_feature_inputs(dataclasses.replace(case, seed=74)),
        )
        starts = np.cumsum((0, *case.seqlens))
        for i in (3, 2):  # sequence 3 crosses a chunk boundary, sequence 2 has one token
            span = slice(int(starts[i]), int(starts[i + 1]))
            others = np.arange(len(case.seqlens)) != i
            check_no_leakage(gdn2_target, x, fresh, 0, span, others)

    @capability(Feature.VARLEN)
    def test_varlen_with_gva_and_activations(self, gdn2_target: Target):
        """cu_seqlens with grouped value heads (b, g on value heads) and the second activation
        case: outputs (and gradients) as the reference."""
        case = varlen_case(
            gdn2_target, groups=2, gate_heads=GateHeads.VALUE, activations=ACTIVATION_CASES[1],
            seed=75,
        )  # fmt: skip
        _check_target(gdn2_target, make_feature_inputs(case))

    @capability(Feature.VARLEN)
    def test_varlen_errors(self, gdn2_target: Target):
        """cu_seqlens not 1-D integer, not starting at 0, decreasing, not ending at T, with
        B > 1; h0 with B instead of N rows."""
        x = make_feature_inputs(varlen_case(gdn2_target, seed=76))
        cu = np.asarray(x.options["cu_seqlens"])
        T = int(x.q.shape[1])
        cases = [
            (TypeError, r"cu_seqlens: expected an integer dtype, got float32",
             jnp.asarray(cu, jnp.float32)),
            (ValueError, r"cu_seqlens: expected shape \(N \+ 1,\)", jnp.asarray(cu)[None]),
            (ValueError, r"cu_seqlens: expected cu_seqlens\[0\] = 0, got 1",
             jnp.asarray(np.concatenate([[1], cu[1:]]))),
            (ValueError, r"cu_seqlens: expected non-decreasing offsets",
             jnp.asarray(np.array([0, 5, 4, T]))),
            (ValueError, rf"cu_seqlens: expected cu_seqlens\[-1\] = T = {T}, got {T - 1}",
             jnp.asarray(np.array([0, 3, T - 1]))),
        ]  # fmt: skip
        for exc, pattern, bad in cases:
            h0 = x.h0[: len(bad) - 1] if bad.ndim == 1 and len(bad) > 1 else x.h0
            _expect_error(exc, pattern, gdn2_target, x, cu_seqlens=bad, h0=h0)
        _expect_error(ValueError, r"h0: expected shape \(N, HV, dk, dv\)", gdn2_target, x,
                      h0=x.h0[:1])  # fmt: skip
        two = {n: jnp.concatenate([getattr(x, n)] * 2) for n in "qkvwbg"}
        _expect_error(ValueError, r"cu_seqlens: expected B = 1 .* got B=2", gdn2_target, x, **two)
