"""Multi-device checks, run in a process of their own with 8 simulated CPU devices.

Started by ``test_multidevice.py`` (which sets ``XLA_FLAGS`` before JAX starts); running this file
directly in a process with fewer devices skips it. Every check compares the sharded call, under
``jax.jit``, with the single-device token-serial reference in float32: outputs, ``h_final`` and the
seven gradients of ``sum(o * do) + sum(h_final * dh)``, and reads the compiled HLO for collectives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from gdn2_conformance import (
    GRAD_NAMES,
    Case,
    ReferenceBackend,
    make_inputs,
    outputs_and_grads,
    reference,
    rel_err,
    tolerance,
)
from gdn2_tools.hlo import collective_summary
from gdn2_tools.train_step import train_step
from gdn2core import Capabilities, gdn2_forward, gdn2_token_serial_reference, register_backend

if jax.device_count() < 8:
    pytest.skip("needs 8 devices (run through test_multidevice.py)", allow_module_level=True)

REF = ReferenceBackend.name
register_backend(ReferenceBackend(), replace=True)
# Every case runs on the token-serial backend (fast to compile). The chunked jax_ref backend
# runs the context-parallel case that also shards batch (its compiles cost ~15 s each
# here), and pallas_tpu (in interpret mode) one context + batch case of its own.
CHUNKED = ["jax_ref"]


def with_backends(cases, chunked_case=None):
    extra = [] if chunked_case is None else [(cases[chunked_case], n) for n in CHUNKED]
    return [(c, REF) for c in cases] + extra


# Tolerances: the kit's float32 table (gdn2_conformance.metrics). Measured: batch/head sharding
# agrees at rounding level (0 to 1e-7: the same per-(b, h) computation); context parallelism
# re-associates the recurrence (S_out = A S_in + B, o = o0 + S_in^T a): up to 8e-7 on o/h_final
# and 2.3e-6 on the gradients (jax_ref, strong decay, 8 shards). A wrong orientation or a missing
# state term gives errors of order 1.
TOL_OUT = tolerance("float32", "o")


def auto_mesh(shape, names):
    devs = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devs, names, axis_types=(AxisType.Auto,) * len(names))


def explicit_mesh(shape, names):
    devs = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devs, names, axis_types=(AxisType.Explicit,) * len(names))


def ground_truth(x):
    """Single-device ground truth: outputs, final state and the seven gradients."""
    return outputs_and_grads(reference, x)


def put(x, mesh, tok_spec, st_spec):
    tok = NamedSharding(mesh, tok_spec)
    st = NamedSharding(mesh, st_spec)
    args = [jax.device_put(a, tok) for a in x.args]
    h0 = jnp.zeros_like(x.dh) if x.h0 is None else x.h0
    return (*args, jax.device_put(h0, st), jax.device_put(x.do, tok), jax.device_put(x.dh, st))


def check(got, ref):
    (o, h), grads = got
    o_ref, h_ref, g_ref = ref
    errs = {"o": rel_err(o, o_ref), "h_final": rel_err(h, h_ref)}
    errs.update({n: rel_err(a, e) for n, a, e in zip(GRAD_NAMES, grads, g_ref, strict=True)})
    bad = {n: e for n, e in errs.items() if e > tolerance("float32", n)}
    assert not bad, f"errors above tolerance: {bad} (all: {errs})"


def run_step(args, **kwargs):
    step = jax.jit(train_step(**kwargs))
    compiled = step.lower(*args).compile()
    _, aux, grads = compiled(*args)
    return (aux, grads), collective_summary(compiled.as_text())


# --- batch / head sharding -----------------------------------------------------------------------

BH_CASES = [
    # (mesh shape, axis names, mesh kind, B, H, token spec, kwargs, h0)
    ((8,), ("d",), "auto", 8, 2, PartitionSpec("d", None, None, None), {}, True),
    ((2, 4), ("x", "y"), "explicit", 8, 4, PartitionSpec("x", None, "y", None), {}, False),
    (
        (4, 2),
        ("x", "y"),
        "auto",
        2,
        4,
        PartitionSpec("y", None, "x", None),
        {"batch_axes": "y", "head_axes": "x"},
        True,
    ),
    # Mesh axis y unused (inputs replicated over it): the gradients must not be over-counted.
    (
        (2, 4),
        ("x", "y"),
        "auto",
        2,
        2,
        PartitionSpec("x", None, None, None),
        {"batch_axes": "x", "head_axes": ()},
        True,
    ),
]


def _bh_id(c):
    return f"{c[0]}-{c[2]}-h0{c[7]}" if isinstance(c, tuple) else c


@pytest.mark.parametrize(("case", "backend"), with_backends(BH_CASES), ids=_bh_id)
def test_batch_head_sharding(case, backend):
    shape, names, kind, B, H, tok_spec, kwargs, with_h0 = case
    mesh = (auto_mesh if kind == "auto" else explicit_mesh)(shape, names)
    x = make_inputs(Case(B=B, T=32, H=H, dk=8, dv=16, h0=with_h0, seed=1))
    st_spec = PartitionSpec(tok_spec[0], tok_spec[2], None, None)
    args = put(x, mesh, tok_spec, st_spec)
    got, collectives = run_step(args, backend=backend, **kwargs)
    check(got, ground_truth(x))
    # Each device ran its own shard: no all-gather (nor any other collective) of inputs, outputs
    # or gradients, forward or backward. The one collective left is the loss itself: a scalar
    # all-reduce of sum(o * do) + sum(h_final * dh), which is the test's, not the operator's.
    assert all(c.op == "all-reduce" and c.bytes <= 8 for c in collectives), [
        str(c) for c in collectives
    ]


def test_forward_only_sharded_matches():
    mesh = auto_mesh((2, 4), ("x", "y"))
    x = make_inputs(Case(B=2, T=32, H=4, dk=8, dv=8, seed=2))
    args = put(x, mesh, PartitionSpec("x", None, "y", None), PartitionSpec("x", "y", None, None))
    fwd = jax.jit(lambda *a: gdn2_forward(*a[:6], h0=a[6], backend=([REF, *CHUNKED])[-1]))
    o, h = fwd(*args[:7])
    o_ref, h_ref = gdn2_token_serial_reference(*x.args, None, x.h0)
    assert rel_err(o, o_ref) < TOL_OUT and rel_err(h, h_ref) < TOL_OUT
    assert o.sharding.spec == PartitionSpec("x", None, "y", None)
    # Eager (unjitted) call on sharded arrays routes the same way.
    o2, h2 = gdn2_forward(*args[:6], h0=args[6], backend=REF)
    assert rel_err(o2, o_ref) < TOL_OUT and rel_err(h2, h_ref) < TOL_OUT

    # Explicit mesh, no h0: the zero state made by the API is resharded onto the plan's layout.
    emesh = explicit_mesh((2, 4), ("x", "y"))
    eargs = [jax.device_put(a, NamedSharding(emesh, PartitionSpec("x", None, "y"))) for a in x.args]
    o3, h3 = jax.jit(lambda *a: gdn2_forward(*a, backend=REF))(*eargs)
    o_ref0, h_ref0 = gdn2_token_serial_reference(*x.args)
    assert rel_err(o3, o_ref0) < TOL_OUT and rel_err(h3, h_ref0) < TOL_OUT
    assert jax.typeof(o3).sharding.spec == PartitionSpec("x", None, "y", None)


# --- context parallelism -------------------------------------------------------------------------

CP_CASES = [
    # (mesh shape, names, context axis, batch axes, B, H, T, h0, input knobs)
    # b up to 2 (negative eigenvalues of the erase) and 10% of tokens at g = -30 (transitions that
    # underflow to zero) are in the mix.
    ((2,), ("c",), "c", None, 1, 2, 48, True, {"b_max": 2.0}),
    ((4, 2), ("c", "d"), "c", "d", 2, 2, 48, False, {}),
    ((8,), ("c",), "c", None, 1, 2, 64, True, {"decay": "strong"}),
]


def _cp_id(c):
    return f"cp{c[0]}-h0{c[7]}-{'-'.join(map(str, c[8].values()))}" if isinstance(c, tuple) else c


@pytest.mark.parametrize(("case", "backend"), with_backends(CP_CASES, chunked_case=1), ids=_cp_id)
def test_context_parallel(case, backend):
    shape, names, cax, bax, B, H, T, with_h0, knobs = case
    mesh = auto_mesh(shape, names)
    x = make_inputs(Case(B=B, T=T, H=H, dk=8, dv=16, h0=with_h0, seed=3, **knobs))
    tok_spec = PartitionSpec(bax, cax, None, None)
    st_spec = PartitionSpec(bax, None, None, None)
    kw = dict(backend=backend, context_axis=cax, batch_axes=bax or ())
    got, collectives = run_step(put(x, mesh, tok_spec, st_spec), **kw)
    check(got, ground_truth(x))
    P, dk, dv = shape[0], 8, 16
    bound = 4 * P * B * H * dk * (dk + dv)  # all (A_p, B_p) of all shards, float32
    assert any(c.op == "all-gather" for c in collectives)
    assert all(c.bytes <= bound for c in collectives), [str(c) for c in collectives]
    if backend != REF or P != 4:  # one case is enough for the (compile-costly) T-scaling check
        return

    # Only state summaries cross devices: the collectives do not grow with T (compile at 2T).
    x2 = make_inputs(Case(B=B, T=2 * T, H=H, dk=8, dv=16, h0=with_h0))
    _, collectives_2t = run_step(put(x2, mesh, tok_spec, st_spec), **kw)
    sizes = sorted((c.op, c.bytes) for c in collectives)
    assert sizes == sorted((c.op, c.bytes) for c in collectives_2t)


def NarrowReference():
    """The reference, refusing value sizes above 8 (so never the widened dv + dk = 16)."""
    return ReferenceBackend("narrow_ref", capabilities=Capabilities(dv=(8,), auto=False))


def test_context_parallel_forward_and_errors():
    mesh = auto_mesh((4,), ("c",))
    x = make_inputs(Case(B=1, T=32, H=2, dk=8, dv=8, seed=4))
    o, h = jax.jit(lambda *a: gdn2_forward(*a, h0=x.h0, backend=REF, mesh=mesh, context_axis="c"))(
        *x.args
    )
    o_ref, h_ref = gdn2_token_serial_reference(*x.args, None, x.h0)
    assert rel_err(o, o_ref) < TOL_OUT and rel_err(h, h_ref) < TOL_OUT

    # A backend that cannot take the widened value axis (dv + dk) is called twice per shard.
    register_backend(NarrowReference(), replace=True)
    o, h = jax.jit(
        lambda *a: gdn2_forward(*a, h0=x.h0, backend="narrow_ref", mesh=mesh, context_axis="c")
    )(*x.args)
    assert rel_err(o, o_ref) < TOL_OUT and rel_err(h, h_ref) < TOL_OUT

    bad = make_inputs(Case(B=1, T=30, H=2, dk=8, dv=8))
    with pytest.raises(ValueError, match="T=30 is not divisible by its 4 shards"):
        gdn2_forward(*bad.args, backend=REF, mesh=mesh, context_axis="c")
    sharded_t = [jax.device_put(a, NamedSharding(mesh, PartitionSpec(None, "c"))) for a in x.args]
    with pytest.raises(ValueError, match="pass context_axis='c'"):
        gdn2_forward(*sharded_t, backend=REF)
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        gdn2_forward(*x.args, backend=REF, mesh=mesh, context_axis="nope")


def test_pallas_interpret_context_and_batch():
    """The Pallas kernels (TPU interpret mode on the CPU) under shard_map: time over 2 shards,
    batch over 2; outputs, h_final and the seven gradients against the reference."""
    from gdn2core import KernelConfig

    cfg = KernelConfig(bt=16, interpret=True)
    mesh = auto_mesh((2, 2), ("c", "d"))
    x = make_inputs(Case(B=2, T=64, H=1, dk=64, dv=64, seed=5))
    args = put(x, mesh, PartitionSpec("d", "c", None, None), PartitionSpec("d", None, None, None))
    kw = dict(backend="pallas_tpu", config=cfg, context_axis="c", batch_axes="d")
    got, collectives = run_step(args, **kw)
    check(got, ground_truth(x))
    assert any(c.op == "all-gather" for c in collectives)
