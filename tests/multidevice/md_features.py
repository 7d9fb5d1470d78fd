"""Multi-device checks of the model features, run in the 8-device child process of
``test_multidevice.py`` (skipped when fewer devices exist).

Every check compares the sharded call under ``jax.jit`` with the single-device token-serial
reference in float32: o, h_final and every gradient (A_log and dt_bias included) of
``sum(o * do) + sum(h_final * dh)``, with the kit's float32 tolerances. Two backends: the
reference backend (packed sequences and fused activations, so the raw inputs, A_log and dt_bias
are split per shard) and scan_baseline (packed sequences; the core applies the activations in
XLA before the shards); pallas_tpu in interpret mode for context parallelism on scalar gates.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from gdn2_conformance import (
    FeatureCase,
    GateHeads,
    ReferenceBackend,
    make_feature_inputs,
    op_function,
    outputs_and_grads,
    rel_err,
    tolerance,
)
from gdn2_conformance.feature_suite import ACTIVATION_CASES
from gdn2core import (
    gdn2_forward,
    gdn2_forward_trainable,
    gdn2_token_serial_reference,
    register_backend,
)

if jax.device_count() < 8:
    pytest.skip("needs 8 devices (run through test_multidevice.py)", allow_module_level=True)

REF = ReferenceBackend.name
register_backend(ReferenceBackend(), replace=True)


class GroupedKeys(ReferenceBackend):
    """The reference declaring grouped keys: on a mesh the core repeats q, k for it all the same
    (``seen``: the ``key_groups`` of its calls; ``value_groups``: theirs, which a per-shard call
    never gets)."""

    name = "grouped_keys_ref"
    capabilities = ReferenceBackend.capabilities.model_copy(update={"grouped_keys": True})
    seen: list = []  # noqa: RUF012
    value_groups: list = []  # noqa: RUF012

    def forward(self, *args, spec, **kw):
        GroupedKeys.seen.append(spec.key_groups)
        GroupedKeys.value_groups.append(spec.value_groups)
        return super().forward(*args, spec=spec, **kw)


GROUPED = GroupedKeys.name
register_backend(GroupedKeys(), replace=True)


class ScalarGatesSpy(ReferenceBackend):
    """The reference recording the shapes of the gates each per-shard call receives."""

    name = "scalar_gates_spy_ref"
    seen: list = []  # noqa: RUF012

    def forward(self, q, k, v, w, b, g, *args, spec, **kw):
        ScalarGatesSpy.seen.append((spec.scalar_gates, w.shape, b.shape, g.shape))
        return super().forward(q, k, v, w, b, g, *args, spec=spec, **kw)


register_backend(ScalarGatesSpy(), replace=True)


class NarrowScalarGatesSpy(ScalarGatesSpy):
    """The spy refusing value sizes but 4 and 8, so never context parallelism's widened dv + dk
    = 12: it is called twice per shard (value sizes 4 and 8, ``value_sizes``)."""

    name = "narrow_scalar_gates_spy_ref"
    capabilities = ScalarGatesSpy.capabilities.model_copy(update={"dv": (4, 8)})
    value_sizes: list = []  # noqa: RUF012

    def forward(self, *args, spec, **kw):
        NarrowScalarGatesSpy.value_sizes.append(spec.dv)
        return super().forward(*args, spec=spec, **kw)


register_backend(NarrowScalarGatesSpy(), replace=True)
BACKENDS = [REF, "scan_baseline"]


def mesh_of(shape, names):
    devs = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devs, names, axis_types=(AxisType.Auto,) * len(names))


def place(x, mesh, tok):
    """x's token arrays (and o's cotangent) on ``tok``; the state arrays on (batch, heads)."""
    st = NamedSharding(mesh, PartitionSpec(tok[0], tok[2], None, None))
    put = {n: jax.device_put(getattr(x, n), NamedSharding(mesh, tok)) for n in "qkvwbg"}
    put["do"] = jax.device_put(x.do, NamedSharding(mesh, tok))
    put["h0"] = jax.device_put(x.h0, st)
    put["dh"] = jax.device_put(x.dh, st)
    return dataclasses.replace(x, **put)


def check_sharded(x, backend, **sharding):
    """The sharded trainable call (under jit) against the single-device reference."""
    got = outputs_and_grads(op_function(gdn2_forward_trainable, x, backend=backend, **sharding), x)
    want = outputs_and_grads(op_function(gdn2_token_serial_reference, x), x)
    o, h, grads = got
    o_r, h_r, grads_r = want
    errs = {"o": rel_err(o, o_r), "h_final": rel_err(h, h_r)}
    errs |= {n: rel_err(a, e) for n, a, e in zip(x.grad_names, grads, grads_r, strict=True)}
    bad = {n: e for n, e in errs.items() if e > tolerance("float32", n)}
    assert not bad, f"errors above tolerance: {bad} (all: {errs})"


@pytest.mark.parametrize("backend", [*BACKENDS, GROUPED])
def test_batch_head_sharding_with_all_features(backend):
    """Batch over x (2), heads over y (4): segment_ids split by batch; H = 4 key heads and
    HV = 8 value heads split alike (b, g shared: 1 key head, 2 value heads per device); A_log and
    dt_bias split by heads. The per-shard calls get the plain view (``value_groups = 1``)."""
    case = FeatureCase(B=2, T=24, H=4, dk=8, dv=4, groups=2, rows=((3, 1, 9, 11), (12, 12)),
                       activations=ACTIVATION_CASES[0], seed=1)  # fmt: skip
    mesh = mesh_of((2, 4), ("x", "y"))
    x = place(make_feature_inputs(case), mesh, PartitionSpec("x", None, "y", None))
    GroupedKeys.value_groups.clear()
    check_sharded(x, backend, batch_axes="x", head_axes="y")
    if backend == GROUPED:
        assert set(GroupedKeys.value_groups) == {1}, GroupedKeys.value_groups


def _scalar_gates(x):
    """``x`` with w, b, g as scalar gates ``(B, T, heads)`` (their first channel)."""
    return dataclasses.replace(x, w=x.w[..., 0], b=x.b[..., 0], g=x.g[..., 0])


def test_scalar_gates_reach_the_shards_as_they_are():
    """KDA's and GDN's scalar gates (w, b, g as ``(B, T, H)``) under batch (2) and head (4)
    sharding with packed sequences: each shard's backend call receives them unbroadcast, its
    ``(B / 2, T, H / 4)`` part; o, h_final and every gradient match the single-device
    reference. Under context parallelism (4 shards of time, 2 of batch) too: its one call per
    shard widens the value axis to dv + dk, and w, which enters as ``w * v`` with ``v = 0`` on the
    added columns, stays ``(B / 2, T / 4, H)`` there; so in the two calls per shard of a backend
    that refuses the widened axis."""
    case = FeatureCase(B=2, T=24, H=4, dk=8, dv=4, rows=((3, 1, 9, 11), (12, 12)), seed=5)
    mesh = mesh_of((2, 4), ("x", "y"))
    x = _scalar_gates(make_feature_inputs(case))
    tok, gate = PartitionSpec("x", None, "y", None), PartitionSpec("x", None, "y")
    put = {n: jax.device_put(getattr(x, n), NamedSharding(mesh, tok)) for n in "qkv"}
    put |= {n: jax.device_put(getattr(x, n), NamedSharding(mesh, gate)) for n in "wbg"}
    ScalarGatesSpy.seen.clear()
    check_sharded(dataclasses.replace(x, **put), ScalarGatesSpy.name, batch_axes="x",
                  head_axes="y")  # fmt: skip
    assert ScalarGatesSpy.seen, "the backend was not called"
    assert set(ScalarGatesSpy.seen) == {(("w", "b", "g"), (1, 24, 1), (1, 24, 1), (1, 24, 1))}

    case = FeatureCase(B=2, T=48, H=1, dk=8, dv=4, rows=CP_ROWS, seed=6)
    x = _scalar_gates(make_feature_inputs(case))
    ScalarGatesSpy.seen.clear()
    check_sharded(x, ScalarGatesSpy.name, mesh=mesh_of((4, 2), ("c", "d")), context_axis="c",
                  batch_axes="d")  # fmt: skip
    assert ScalarGatesSpy.seen, "the backend was not called"
    assert set(ScalarGatesSpy.seen) == {(("w", "b", "g"), (1, 12, 1), (1, 12, 1), (1, 12, 1))}

    ScalarGatesSpy.seen.clear()
    NarrowScalarGatesSpy.value_sizes.clear()
    check_sharded(x, NarrowScalarGatesSpy.name, mesh=mesh_of((4, 2), ("c", "d")),
                  context_axis="c", batch_axes="d")  # fmt: skip
    assert set(NarrowScalarGatesSpy.value_sizes) == {4, 8}, NarrowScalarGatesSpy.value_sizes
    assert set(ScalarGatesSpy.seen) == {(("w", "b", "g"), (1, 12, 1), (1, 12, 1), (1, 12, 1))}


def test_pallas_context_parallel_on_scalar_gates():
    """pallas_tpu's kernels (TPU interpret mode) under context parallelism (2 shards of time,
    2 of batch) on scalar gates: the widened call reads w, b, g as ``(B, T, H)`` blocks over its
    dv + dk value columns; o, h_final and every gradient match the single-device reference."""
    from gdn2core import KernelConfig

    case = FeatureCase(B=2, T=64, H=1, dk=64, dv=64, rows=((5, 30, 29), (64,)), seed=6)
    x = _scalar_gates(make_feature_inputs(case))
    check_sharded(x, "pallas_tpu", config=KernelConfig(bt=16, interpret=True),
                  mesh=mesh_of((2, 2), ("c", "d")), context_axis="c", batch_axes="d")  # fmt: skip


class DecayDtypeSpy(ReferenceBackend):
    """The reference recording g's dtype in each per-shard call."""

    name = "decay_dtype_spy_ref"
    seen: list = []  # noqa: RUF012

    def forward(self, q, k, v, w, b, g, *args, spec, **kw):
        DecayDtypeSpy.seen.append((spec.float32_decay, g.dtype.name))
        return super().forward(q, k, v, w, b, g, *args, spec=spec, **kw)


register_backend(DecayDtypeSpy(), replace=True)


@pytest.mark.parametrize("sharding", ["batch-heads", "context"])
def test_float32_decay_reaches_the_shards(sharding):
    """bfloat16 inputs with a float32 g under batch and head sharding and under context
    parallelism: every per-shard call gets g in float32; o, h_final and the gradients match the
    single-device reference on the same values within the kit's bfloat16 bounds, dg in float32."""
    case = FeatureCase(B=2, T=48, H=4, dk=8, dv=4, rows=CP_ROWS, seed=7)
    x = make_feature_inputs(case)
    x = dataclasses.replace(x.astype(jax.numpy.bfloat16), g=x.g)
    if sharding == "batch-heads":
        sharded = dict(mesh=mesh_of((2, 4), ("x", "y")), batch_axes="x", head_axes="y")
    else:
        sharded = dict(mesh=mesh_of((4, 2), ("c", "d")), context_axis="c", batch_axes="d")
    DecayDtypeSpy.seen.clear()
    got = outputs_and_grads(op_function(gdn2_forward_trainable, x, backend=DecayDtypeSpy.name,
                                        **sharded), x)  # fmt: skip
    want = outputs_and_grads(op_function(gdn2_token_serial_reference, x), x)
    assert DecayDtypeSpy.seen and set(DecayDtypeSpy.seen) == {(True, "float32")}
    assert got[2][5].dtype == jax.numpy.float32
    names = ("o", "h_final", *x.grad_names)
    for name, a, e in zip(names, (*got[:2], *got[2]), (*want[:2], *want[2]), strict=True):
        assert rel_err(a, e) <= tolerance("bfloat16", name), (name, rel_err(a, e))


#: Row 0: a sequence across the boundary at 12, starts exactly at the shard boundaries 24 and
#: 36, a sequence of one token; row 1: one sequence across two boundaries, a start at 30.
CP_ROWS = ((5, 14, 5, 12, 1, 11), (30, 18))


@pytest.mark.parametrize("backend", [*BACKENDS, GROUPED])
def test_context_parallel_with_segments(backend):
    """Time over c (4 shards of 12), batch over d (2): sequences cross shard boundaries and start
    exactly at them; with GVA (b, g on value heads) and the bounded gate; a backend declaring
    grouped keys gets them repeated per shard (the core's mesh path)."""
    case = FeatureCase(B=2, T=48, H=1, dk=8, dv=4, groups=2, gate_heads=GateHeads.VALUE,
                       rows=CP_ROWS, activations=ACTIVATION_CASES[1], seed=2)  # fmt: skip
    mesh = mesh_of((4, 2), ("c", "d"))
    x = place(make_feature_inputs(case), mesh, PartitionSpec("d", "c", None, None))
    check_sharded(x, backend, context_axis="c", batch_axes="d")
    if backend == GROUPED:
        assert GroupedKeys.seen and set(GroupedKeys.seen) == {1}, GroupedKeys.seen


def test_varlen_head_sharding_and_context_refusal():
    """cu_seqlens with heads over 4 devices (h0 and h_final per sequence, split by heads); with
    context parallelism it is refused, naming cu_seqlens."""
    case = FeatureCase(B=1, T=24, H=4, dk=8, dv=4, seqlens=(3, 0, 12, 9), seed=3)
    mesh = mesh_of((4,), ("y",))
    x = make_feature_inputs(case)
    put = {n: jax.device_put(getattr(x, n), NamedSharding(mesh, PartitionSpec(None, None, "y")))
           for n in "qkvwbg"}  # fmt: skip
    x = dataclasses.replace(x, **put)
    check_sharded(x, REF, head_axes="y")
    with pytest.raises(ValueError, match="cu_seqlens: context parallelism .* not supported"):
        gdn2_forward(*x.args, h0=x.h0, backend=REF, mesh=mesh_of((4,), ("c",)),
                     context_axis="c", **x.options)  # fmt: skip


def test_segments_without_sharding_keywords_follow_the_inputs():
    """Eager call on batch-sharded inputs with segment_ids: the plan comes from q's sharding."""
    case = FeatureCase(B=8, T=8, H=1, dk=4, dv=4, rows=((3, 5),) * 8, seed=4)
    mesh = mesh_of((8,), ("d",))
    x = make_feature_inputs(case)
    args = [jax.device_put(a, NamedSharding(mesh, PartitionSpec("d"))) for a in x.args]
    o, h = gdn2_forward(*args, h0=x.h0, backend="scan_baseline", **x.options)
    o_r, h_r = gdn2_token_serial_reference(*x.args, h0=x.h0, **x.options)
    assert rel_err(o, o_r) < tolerance("float32", "o") and rel_err(h, h_r) < 1e-4
    assert o.sharding.spec[0] == "d"
