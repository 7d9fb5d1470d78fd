"""The core's side of the model features: the GVA transform and the XLA activation path against
the reference (which implements both natively), validation, the extras contract with backends,
and refusals that name the argument."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_conformance import (
    FeatureCase,
    GateHeads,
    ReferenceBackend,
    activate_numpy,
    check_central_differences,
    cotangent_loss,
    make_feature_inputs,
    outputs_and_grads,
    rel_err,
)
from gdn2_conformance.checks import op_function
from gdn2_conformance.feature_inputs import np_gate, np_sigmoid
from gdn2_conformance.feature_suite import ACTIVATION_CASES, FUSED_CASES
from gdn2core import (
    Activations,
    BackendUnsupportedError,
    Capabilities,
    GateMode,
    OpExtras,
    OpSpec,
    SegmentMode,
    estimate_memory,
    gdn2_forward,
    gdn2_forward_trainable,
    gdn2_token_serial_reference,
    get_recommended_config,
    register_backend,
    unregister_backend,
    which_backend,
)
from gdn2core.features.activations import apply_activations
from gdn2core.features.gva import group_call, resolve_spec, ungroup_outputs
from gdn2core.features.segments import as_int32_ids, segment_starts, shard_boundary_starts
from gdn2core.ops.forward.reference import token_serial
from gdn2core.options import A_LOG_RANGE
from gdn2core.plugin import Backend


@pytest.mark.parametrize("gate_heads", list(GateHeads))
@pytest.mark.parametrize("varlen", [False, True])
def test_gva_transform_equals_native_reference(gate_heads, varlen, x64):
    """Grouping (shared keys: reshape of v, w, h0; repeated keys: jnp.repeat of q, k), a plain
    reference call, ungrouping: the reference's native GVA, in float64 (reassociation only)."""
    packing = {"seqlens": (3, 0, 6)} if varlen else {"B": 2}
    case = FeatureCase(T=9, H=2, dk=4, dv=3, groups=3, gate_heads=gate_heads, seed=1, **packing)
    x = make_feature_inputs(case, jnp.float64)
    spec = OpSpec.from_inputs(*x.args, None, x.h0, **x.options)
    plain = resolve_spec(spec)
    assert plain.value_heads == plain.gate_heads == plain.heads
    assert (plain.heads, plain.dv) == ((2, 9) if gate_heads == "key" else (6, 3))
    q, k, v, w, h0 = group_call(spec, x.q, x.k, x.v, x.w, x.h0)
    extras = OpExtras(cu_seqlens=x.options.get("cu_seqlens"))
    o, h = ungroup_outputs(spec, *token_serial(plain, q, k, v, w, x.b, x.g, h0, extras))
    o_ref, h_ref = gdn2_token_serial_reference(*x.args, None, x.h0, **x.options)
    assert rel_err(o, o_ref) < 1e-12 and rel_err(h, h_ref) < 1e-12


@pytest.mark.parametrize(("act", "bias"), FUSED_CASES, ids=lambda v: str(v)[:60])
def test_xla_activation_path_equals_numpy(act, bias):
    """float32: the core's activations (computed in float32) against float64 NumPy rounded to
    float32: an ulp or two of the activation (1e-6 relative). The bounded gate with and without
    dt_bias (fla's safe gate: ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``)."""
    x = make_feature_inputs(FeatureCase(T=7, groups=2, activations=act, gate_bias=bias, seed=2))
    assert (x.dt_bias is not None) == (bias or act.gate == GateMode.SOFTPLUS)
    got = apply_activations(act, x.q, x.k, x.w, x.b, x.g, x.A_log, x.dt_bias)
    want = activate_numpy(x, act)
    for name, a in zip("qkwbg", got, strict=True):
        assert a.dtype == jnp.float32
        assert rel_err(a, getattr(want, name)) < 1e-6, name
    if x.dt_bias is not None:  # the bias is used: without it the gate differs by O(1)
        unbiased = apply_activations(act, x.q, x.k, x.w, x.b, x.g + x.dt_bias, x.A_log, None)
        assert rel_err(got[4], unbiased[4]) < 1e-6  # g + dt_bias, the same rounding
        plain = apply_activations(act, x.q, x.k, x.w, x.b, x.g, x.A_log, None)
        assert rel_err(got[4], plain[4]) > 1e-2


#: Raw values at which the gates saturate (and some at which they do not).
EXTREMES = np.array([np.inf, -np.inf, 1e4, -1e4, 1e30, -1e30, 3e38, -3e38, 110.0, -110.0, 30.0,
                     -30.0, 1.0, 0.0], np.float32)  # fmt: skip
BOUNDED = Activations(gate=GateMode.LOWER_BOUND, lower_bound=-2.5, bw_sigmoid=True)


@pytest.mark.parametrize("act", [ACTIVATION_CASES[0], BOUNDED], ids=["softplus", "lower_bound"])
def test_xla_gates_are_exact_at_any_input(act):
    """float32: the XLA path at raw b, w, g of EXTREMES against every A_log of a clip-crossing
    set (one per gate head), dt_bias included. Values as float64 NumPy (np_gate, np_sigmoid)
    within 4 float32 ulps + 1.2e-7 (what 1 + t and a float32 underflow lose), after raising g to
    -128 (a decay floor: below it every backend erases; float64 values past float32's range are
    -inf in float32); the limits exactly (sigmoid(+-inf) = 1, 0; a raw g of -inf is no decay; a
    raw g of +inf under softplus a full erase, exp(g) = 0); and the gradients of every raw input,
    A_log and dt_bias finite, exactly 0 where the function is flat."""
    A_log = np.array([-np.inf, -1e4, -85.0, -30.0, 0.7, 30.0, 85.0, 1e4, np.inf], np.float32)
    Hg, dk, n = A_log.size, 4, EXTREMES.size
    raw = jnp.asarray(np.broadcast_to(EXTREMES[None, :, None, None], (1, n, Hg, dk)))
    dt = jnp.full((Hg, dk), -0.5, jnp.float32)
    q = k = jnp.ones((1, n, Hg, dk), jnp.float32)
    A = jnp.asarray(A_log)

    def activated(b, w, g, A, dt):
        return apply_activations(act, q, k, w, b, g, A, dt)[2:]

    w_act, b_act, g_act = (np.asarray(a) for a in activated(raw, raw, raw, A, dt))
    r = np.asarray(raw, np.float64)
    want_g = np_gate(act, r, A_log, np.asarray(dt))
    assert _ulp_close(np.maximum(g_act, -128.0), np.maximum(want_g, -128.0)).all()
    for got in (w_act, b_act):
        assert _ulp_close(got, np_sigmoid(r)).all()
        assert np.all(got[r == np.inf] == 1.0) and np.all(got[r == -np.inf] == 0.0)
    assert np.all(g_act[r == -np.inf] == 0.0)  # no decay (the padding of packed sequences)
    if act.gate == GateMode.SOFTPLUS:
        with np.errstate(under="ignore"):  # a full erase: exp(g) = 0 in float32
            assert np.all(np.exp(g_act[r == np.inf]) == 0.0)
    # d/d(all) of sum(b + w + max(g, -128)) (the floor: what a backend's clamp hands down).
    grads = jax.grad(
        lambda *a: (
            sum(jnp.sum(x) for x in activated(*a)[:2])
            + jnp.sum(jnp.maximum(activated(*a)[2], -128.0))
        ),
        argnums=range(5),
    )(raw, raw, raw, A, dt)
    for name, d in zip(("db", "dw", "dg", "dA_log", "ddt_bias"), grads, strict=True):
        assert np.isfinite(np.asarray(d)).all(), name
    db, dw, dg, dA = (np.asarray(d) for d in grads[:4])
    flat = np.abs(r) >= 1e4
    assert np.all(db[flat] == 0.0) and np.all(dw[flat] == 0.0)  # saturated sigmoids
    assert np.all(dg[np.isinf(r)] == 0.0)  # saturated gate, or a full erase
    clipped = (A_log < A_LOG_RANGE[0]) | (A_log > A_LOG_RANGE[1])
    assert np.all(dA[clipped] == 0.0)  # the rate is constant outside the clip


def _ulp_close(actual, expected, ulps: float = 4.0, absolute: float = 1.2e-7) -> np.ndarray:
    """Elementwise: equal (infinities included), or within ``ulps`` float32 ulps of the float64
    value plus ``absolute``."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    with np.errstate(invalid="ignore"):
        near = np.abs(a - e) <= ulps * 2.0**-23 * np.abs(e) + absolute
    return (a == e) | near


def test_plain_specs_unchanged():
    """Positional construction still describes a plain call; the feature fields follow."""
    spec = OpSpec(2, 16, 4, 8, 8, "float32", 0.5)
    assert (spec.value_heads, spec.gate_heads, spec.n_seqs, spec.groups) == (4, 4, 2, 1)
    assert spec.segments == SegmentMode.NONE and not spec.activations.any
    assert dataclasses.replace(spec, batch=3).n_seqs == 3
    x = make_feature_inputs(FeatureCase(B=2, T=16, H=4, dk=8, dv=8))
    assert OpSpec.from_inputs(*x.args, 0.5) == spec
    with pytest.raises(ValueError, match="v: expected HV .* multiple of H=4, got HV=6"):
        OpSpec(2, 16, 4, 8, 8, "float32", 0.5, value_heads=6)
    with pytest.raises(ValueError, match="b/g: expected H=4 or HV=8 heads, got 2"):
        OpSpec(2, 16, 4, 8, 8, "float32", 0.5, value_heads=8, gate_heads=2)


def test_activation_options_are_checked():
    assert Activations.from_options(use_gate_in_kernel=True).gate == GateMode.SOFTPLUS
    lb = Activations.from_options(use_gate_in_kernel=True, lower_bound=-5)
    assert lb.gate == GateMode.LOWER_BOUND and lb.lower_bound == -5.0
    with pytest.raises(TypeError, match="use_qk_l2norm_in_kernel: expected a bool, got int"):
        Activations.from_options(use_qk_l2norm_in_kernel=1)
    with pytest.raises(ValueError, match=r"lower_bound: expected a float in \[-5, 0\), got nan"):
        Activations.from_options(use_gate_in_kernel=True, lower_bound=float("nan"))
    x = make_feature_inputs(FeatureCase(T=5, activations=Activations(gate=GateMode.LOWER_BOUND,
                                                                       lower_bound=-2.0)))  # fmt: skip
    assert x.dt_bias is not None  # dt_bias is taken with lower_bound (fla's safe gate)
    with pytest.raises(ValueError, match=r"dt_bias: expected shape \(Hg, dk\) = \(2, 8\)"):
        gdn2_token_serial_reference(*x.args, A_log=x.A_log, dt_bias=jnp.zeros((2, 4)),
                                    **x.options)  # fmt: skip
    with pytest.raises(TypeError, match="A_log: expected a floating dtype, got int32"):
        gdn2_token_serial_reference(*x.args, A_log=jnp.zeros(2, jnp.int32), **x.options)


@pytest.mark.parametrize(
    "value",
    [jnp.float32(-2.0), np.float32(-2.0), np.array(-2.0), jnp.array(-2, jnp.int32), -2, jnp.bfloat16(-2)],
    ids=["jnp.float32", "np.float32", "np-0d", "jnp-int32", "int", "jnp.bfloat16"],
)  # fmt: skip
def test_lower_bound_takes_any_concrete_real_scalar(value):
    """A concrete NumPy or JAX 0-d real value is a static number (converted with float()): the
    same activations, and the same outputs, as the Python float."""
    act = Activations.from_options(use_gate_in_kernel=True, lower_bound=value)
    assert act == Activations(gate=GateMode.LOWER_BOUND, lower_bound=-2.0)
    assert type(act.lower_bound) is float and hash(act) == hash(Activations.from_options(
        use_gate_in_kernel=True, lower_bound=-2.0))  # fmt: skip
    x = make_feature_inputs(FeatureCase(T=5, activations=act))
    options = {**x.options, "lower_bound": value}
    o, _ = gdn2_token_serial_reference(*x.args, A_log=x.A_log, dt_bias=x.dt_bias, **options)
    o_ref, _ = gdn2_token_serial_reference(*x.args, A_log=x.A_log, dt_bias=x.dt_bias, **x.options)
    assert np.array_equal(o, o_ref)


def test_lower_bound_refuses_a_traced_or_non_scalar_value_naming_its_type():
    expected = r"lower_bound: expected a Python float \(a static number\) in \[-5, 0\), got "
    with pytest.raises(TypeError, match=expected + r"a traced float32\[\] \(it must be static: "
                       r"it selects the kernel's gate\)"):  # fmt: skip
        jax.jit(lambda lb: Activations.from_options(use_gate_in_kernel=True, lower_bound=lb))(
            jnp.float32(-2.0)
        )
    for value, what in (
        (jnp.full(3, -2.0), r"a float32\[3\] array \(not a scalar\)"),
        (np.full((1, 1), -2.0), r"a float64\[1,1\] array \(not a scalar\)"),
        (True, "the bool True"),
        (jnp.array(True), r"a bool\[\] \(not a real number\)"),
        (jnp.array(-2j), r"a complex64\[\] \(not a real number\)"),
        ("-2", "a str: '-2'"),
    ):
        with pytest.raises(TypeError, match=expected + what):
            Activations.from_options(use_gate_in_kernel=True, lower_bound=value)
    with pytest.raises(ValueError, match=r"lower_bound: expected a float in \[-5, 0\), got -7.0"):
        Activations.from_options(use_gate_in_kernel=True, lower_bound=jnp.float32(-7.0))


def test_segment_ids_of_any_integer_dtype_keep_their_starts(x64):
    ids = jnp.asarray(np.array([[5, 5, 2**40, 2**40, 5 + 2**32, 7]]), jnp.int64)
    starts = np.array([[1, 0, 1, 0, 1, 1]], bool)
    assert np.array_equal(segment_starts(ids), starts)
    as32 = as_int32_ids(ids)  # a cast would make 5 and 5 + 2**32 equal
    assert as32.dtype == jnp.int32 and np.array_equal(segment_starts(as32), starts)
    flags = shard_boundary_starts(jnp.asarray([[1, 1, 2, 2, 2, 3]]), 3)
    assert np.array_equal(flags, [[False, True, False]])


def test_cu_seqlens_values_are_not_checked_under_jit():
    """Concrete offsets are validated; traced ones cannot be (documented), and do not raise."""
    x = make_feature_inputs(FeatureCase(T=6, seqlens=(2, 4)))
    run = jax.jit(lambda cu: gdn2_token_serial_reference(*x.args, h0=x.h0, cu_seqlens=cu))
    o, _ = run(jnp.array([0, 2, 6]))
    assert bool(jnp.all(jnp.isfinite(o)))
    with pytest.raises(ValueError, match="cu_seqlens: expected cu_seqlens"):
        gdn2_token_serial_reference(*x.args, h0=x.h0, cu_seqlens=jnp.array([0, 2, 5]))


class PlainOnly(Backend):
    """A backend written before the model features: no extras argument, nothing declared."""

    name = "plain_only"
    priority = 0
    capabilities = Capabilities(auto=False, dv=(8,))  # float64 included
    seen: list = []  # noqa: RUF012 - what the calls received

    def forward(self, q, k, v, w, b, g, h0, *, spec, config):
        PlainOnly.seen.append(spec)
        return token_serial(spec, q, k, v, w, b, g, h0)


@pytest.fixture
def plain_only():
    register_backend(PlainOnly(), replace=True)
    register_backend(ReferenceBackend("fused_ref"), replace=True)
    yield PlainOnly
    unregister_backend("plain_only")
    unregister_backend("fused_ref")
    PlainOnly.seen.clear()


@pytest.mark.parametrize("act", ACTIVATION_CASES, ids=str)
def test_backend_without_extras_runs_gva_and_activations(act, plain_only):
    """The core resolves GVA and applies the activations in XLA for a backend that does not fuse
    them (the kit's FUSED_ACTIVATIONS tests, which only fusing backends claim, held against the
    XLA path): it gets a plain spec and no extras; the result equals the unfused op on inputs
    activated in NumPy and, with every gradient (A_log, dt_bias included), the reference. A
    backend that fuses them (the reference backend) gets them raw."""
    x = make_feature_inputs(FeatureCase(T=9, H=2, dk=8, dv=4, groups=2, activations=act, seed=7))
    o_ref, h_ref, want = outputs_and_grads(op_function(gdn2_token_serial_reference, x), x)
    unfused = gdn2_forward(*activate_numpy(x, act).args, h0=x.h0, backend="plain_only")
    for name in ("plain_only", "fused_ref"):
        o, h, grads = outputs_and_grads(op_function(gdn2_forward_trainable, x, backend=name), x)
        # float32, the same token-serial arithmetic; the XLA path rounds the activated inputs to
        # float32 (an ulp) and GVA regroups the value columns: 1e-5. A wrong one is O(1).
        pairs = (
            ("o", o, o_ref),
            ("h_final", h, h_ref),
            *zip(x.grad_names, grads, want, strict=True),
        )
        pairs += (("o (unfused)", o, unfused[0]), ("h_final (unfused)", h, unfused[1]))
        for label, a, e in pairs:
            assert rel_err(a, e) < 1e-5, (name, label)
    spec = plain_only.seen[-1]
    assert (spec.heads, spec.value_heads, spec.dv) == (2, 2, 8) and not spec.activations.any


@pytest.mark.parametrize("act", ACTIVATION_CASES, ids=str)
def test_xla_activation_gradients_match_central_differences(act, plain_only, x64):
    """float64: the gradients through the XLA path (A_log, dt_bias included, the bounded gate's
    too) of a backend that does not fuse the activations, against central differences."""
    x = make_feature_inputs(
        FeatureCase(T=6, H=1, dk=8, dv=4, groups=2, activations=act, seed=8), jnp.float64
    )
    fn = op_function(gdn2_forward_trainable, x, backend="plain_only")

    def loss(*args):
        o, h = fn(*args)
        return cotangent_loss(o, h, x.do, x.dh)

    check_central_differences(loss, x.diff_args, names=x.grad_names)


def test_refusals_name_the_argument(plain_only):
    x = make_feature_inputs(FeatureCase(B=2, T=9, dk=8, dv=8, rows=((4, 5), (9,))))
    with pytest.raises(
        BackendUnsupportedError, match="segment_ids: packed sequences not supported"
    ):
        gdn2_forward(*x.args, backend="plain_only", **x.options)
    y = make_feature_inputs(FeatureCase(T=9, dk=8, dv=8, seqlens=(4, 5)))
    with pytest.raises(BackendUnsupportedError, match="cu_seqlens: variable-length sequences"):
        gdn2_forward(*y.args, h0=y.h0, backend="plain_only", **y.options)
    assert which_backend(*y.args, h0=y.h0, backend="fused_ref", **y.options) == "fused_ref"
    z = make_feature_inputs(FeatureCase(T=9, dk=8, dv=8, groups=2))  # shared keys: dv 16
    with pytest.raises(BackendUnsupportedError, match=r"dv=16 not in \(8,\) \(grouped value heads"):
        gdn2_forward(*z.args, backend="plain_only")
    repeated = make_feature_inputs(FeatureCase(T=9, dk=8, dv=8, groups=2, gate_heads="value"))
    gdn2_forward(*repeated.args, backend="plain_only")  # repeated keys keep dv = 8


class GroupedKeysRef(ReferenceBackend):
    """The reference backend declaring ``grouped_keys`` (it repeats q, k itself), recording what
    it receives."""

    name = "grouped_keys_ref"
    capabilities = ReferenceBackend.capabilities.model_copy(update={"grouped_keys": True})
    seen: list = []  # noqa: RUF012 - (spec, q's heads) of every call

    def forward(self, q, k, v, w, b, g, h0, *, spec, config, extras=None):
        GroupedKeysRef.seen.append((spec, q.shape[2]))
        return super().forward(q, k, v, w, b, g, h0, spec=spec, config=config, extras=extras)


@pytest.mark.parametrize(
    ("gate_heads", "packing", "want"),
    [
        (GateHeads.VALUE, {"B": 2}, (3, 2, 1)),  # repeated keys: q, k as given, key_groups = G
        (GateHeads.VALUE, {"seqlens": (3, 0, 6)}, (1, 6, 1)),  # cu_seqlens: repeated by the core
        (GateHeads.KEY, {"B": 2}, (1, 2, 3)),  # shared keys: nothing to repeat, value_groups = G
    ],
    ids=["repeated-keys", "cu_seqlens", "shared-keys"],
)
def test_grouped_keys_reach_a_backend_that_reads_them(gate_heads, packing, want):
    """A backend with ``Capabilities.grouped_keys`` gets q, k of their own H heads under repeated
    keys (``spec.key_groups = G``), repeated ones with cu_seqlens; under shared keys its spec
    says how v, w were grouped (``spec.value_groups = G``, a hint); its dq, dk (summed over each
    group by autodiff of its own repeat) and outputs are the reference's (the same token-serial
    arithmetic in float32: 1e-5)."""
    register_backend(GroupedKeysRef(), replace=True)
    try:
        case = FeatureCase(T=9, H=2, dk=4, dv=3, groups=3, gate_heads=gate_heads, seed=3,
                           **packing)  # fmt: skip
        x = make_feature_inputs(case)
        got = outputs_and_grads(
            op_function(gdn2_forward_trainable, x, backend=GroupedKeysRef.name), x
        )
        ref = outputs_and_grads(op_function(gdn2_token_serial_reference, x), x)
        names = ("o", "h_final", *x.grad_names)
        flat = lambda r: (r[0], r[1], *r[2])  # noqa: E731
        for name, a, e in zip(names, flat(got), flat(ref), strict=True):
            assert rel_err(a, e) < 1e-5, name
        spec, heads = GroupedKeysRef.seen[-1]
        assert (spec.key_groups, heads, spec.value_groups) == want
    finally:
        unregister_backend(GroupedKeysRef.name)
        GroupedKeysRef.seen.clear()


def test_memory_estimate_of_a_grouped_call_is_that_of_the_plain_call():
    grouped = OpSpec(1, 256, 4, 64, 64, "float32", 0.125, value_heads=8)  # b, g on key heads
    plain = OpSpec(1, 256, 4, 64, 128, "float32", 0.125)
    config = get_recommended_config(grouped)
    assert estimate_memory(grouped, config) == estimate_memory(plain, config)


def test_capabilities_describe_the_features():
    caps = Capabilities(segments=True, fused_activations=True)
    assert "features: segment_ids, fused activations" in caps.describe()
    core = "features: grouped value heads (core), activations (core, XLA)"
    assert Capabilities().describe().endswith(core)
    grouped = "features: grouped value heads (core, keys read grouped)"
    assert grouped in Capabilities(grouped_keys=True).describe()


def test_op_extras_is_a_pytree():
    extras = OpExtras(segment_ids=jnp.zeros((1, 3), jnp.int32), A_log=jnp.ones(2))
    leaves = jax.tree_util.tree_leaves(extras)
    assert len(leaves) == 2
    doubled = jax.jit(lambda e: dataclasses.replace(e, A_log=2 * e.A_log))(extras)
    assert float(doubled.A_log[0]) == 2.0 and doubled.cu_seqlens is None


def test_per_head_dt_bias_with_a_scalar_decay():
    """With a scalar g, ``dt_bias`` may be ``(Hg,)``, one bias per head: the result is the call on
    it broadcast to ``(Hg, dk)`` (exactly, jax_ref and the reference), its gradient the sum of
    that call's over the channels, and the spec records the gate as uniform over the channels.
    With a full g it is refused, naming ``(Hg, dk)``."""
    rng = np.random.default_rng(3)
    B, T, H, K = 1, 20, 2, 8

    def arr(*shape):
        return jnp.asarray(rng.uniform(-1.0, 1.0, shape), jnp.float32)

    q, k, v, w, b, g = (
        arr(B, T, H, K),
        arr(B, T, H, K),
        arr(B, T, H, K),
        arr(B, T, H),
        arr(B, T, H),
        arr(B, T, H),
    )
    A_log, bias = arr(H), arr(H)
    full = jnp.broadcast_to(bias[:, None], (H, K))

    def loss(op, dt_bias, **kw):
        o, h = op(q, k, v, w, b, g, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, **kw)
        return jnp.sum(o) + jnp.sum(h * h)

    for op, kw in (
        (gdn2_forward_trainable, {"backend": "jax_ref"}),
        (gdn2_token_serial_reference, {}),
    ):
        run = functools.partial(loss, op, **kw)
        per_head, d_head = jax.value_and_grad(run)(bias)
        channels, d_full = jax.value_and_grad(run)(full)
        assert per_head == channels and d_head.shape == (H,)
        np.testing.assert_allclose(d_head, d_full.sum(axis=1), rtol=1e-6)
    act = Activations(gate=GateMode.SOFTPLUS)
    spec = OpSpec.from_inputs(q, k, v, w, b, g, activations=act, A_log=A_log, dt_bias=bias,
                              per_head_dt_bias=True)  # fmt: skip
    assert spec.uniform_gate
    with pytest.raises(ValueError, match=r"dt_bias: expected shape \(Hg, dk\)"):
        gdn2_forward(q, k, v, w, b, g[..., None] * jnp.ones(K), use_gate_in_kernel=True,
                     A_log=A_log, dt_bias=bias, backend="jax_ref")  # fmt: skip
