"""The jax_ref custom VJP against jax.grad of the token-serial reference, and its transformations.

Errors are ``rel = max|actual - expected| / max|expected|`` (gdn2_conformance.rel_err).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_conformance import Case, make_inputs, rel_err
from gdn2_jax_ref import chunk
from gdn2_jax_ref.backend import JaxRefBackend
from gdn2_jax_ref.config import JaxRefConfig
from gdn2_jax_ref.forward import gdn2_chunk_forward
from gdn2_jax_ref.params import ChunkParams
from gdn2_jax_ref.vjp import Residuals, _fwd, gdn2_chunk_trainable
from gdn2core import OpSpec, gdn2_token_serial_reference

NAMES = ("q", "k", "v", "w", "b", "g", "h0")


def params_for(inp, config, dtype):
    spec = OpSpec.from_inputs(*inp.args, None, inp.h0)
    return ChunkParams.from_spec(spec, config), spec


def apply(kind, params, *args):
    """``(o, h_final)`` of jax_ref ("jax_ref"), of its forward differentiated by plain autodiff
    ("plain"), or of the token-serial reference ("serial")."""
    if kind == "jax_ref":
        return gdn2_chunk_trainable(*args, params)
    if kind == "plain":
        o, h, _ = gdn2_chunk_forward(*args, params)
        return o, h
    return gdn2_token_serial_reference(*args[:6], params.scale, args[6])


@functools.cache
def fwd_and_grad(kind, params):
    """One jitted function (cached, so equal shapes compile once): ``(args, do, dh) -> (grads,
    (o, h_final))`` with loss = sum(o * do) + sum(h_final * dh)."""

    def loss(args, do, dh):
        o, h = apply(kind, params, *args)
        return jnp.sum(o.astype(do.dtype) * do) + jnp.sum(h * dh), (o, h)

    return jax.jit(jax.grad(loss, has_aux=True))


def run(kind, params, inp):
    """``((o, h_final), grads)`` for the inputs ``inp``."""
    grads, out = fwd_and_grad(kind, params)((*inp.args, inp.h0), inp.do, inp.dh)
    return out, grads


def jax_ref_and_reference(inp, params):
    ours, g_ours = run("jax_ref", params, inp)
    ref, g_ref = run("serial", params, inp)
    return ours, ref, g_ours, g_ref


def with_blocks_of_minus_30(inp, start, stop):
    """g = -30 on every channel of tokens [start, stop): whole chunks at the strongest decay."""
    return type(inp)(**{**inp.__dict__, "g": inp.g.at[:, start:stop].set(-30.0)})


# (case, config, GROUP_BYTES or None): T never a multiple of bt; dk != dv both ways; h0; b up to
# 2; 10% of tokens at g = -30 ("strong") plus whole runs of g = -30 below. Small GROUP_BYTES
# split the sequence into several groups (and, in the second case, a group with a chunk that is
# padding only).
F64_CASES = [
    (Case(B=2, T=37, H=2, dk=8, dv=12, b_max=2.0, decay="strong", seed=1), (8, 4, 2), 1),
    (Case(B=1, T=45, H=1, dk=12, dv=6, decay="strong", seed=2), (16, 8, 4), 3072),
    (Case(B=1, T=70, H=2, dk=8, dv=8, b_max=2.0, decay="strong", seed=3), (64, 32, 16), None),
]


@pytest.mark.parametrize(
    ("case", "blocking", "group_bytes"),
    F64_CASES,
    ids=[f"{c.id}-bt{blk[0]}-groups{gb}" for c, blk, gb in F64_CASES],
)
def test_custom_vjp_matches_autodiff_of_reference_f64(
    x64, monkeypatch, case, blocking, group_bytes
):
    if group_bytes is not None:
        monkeypatch.setattr(chunk, "GROUP_BYTES", group_bytes)
    inp = with_blocks_of_minus_30(make_inputs(case, jnp.float64), 3, 12)
    bt, bc, wy_block = blocking
    params, _ = params_for(inp, JaxRefConfig(bt=bt, bc=bc, wy_block=wy_block), jnp.float64)
    (o, h), (o_ref, h_ref), g_ours, g_ref = jax_ref_and_reference(inp, params)
    # float64: the same operator summed in another order; docs/algorithm.md 8 measures <= 2.5e-14 for
    # all of these. 1e-10 leaves room for T's growth with b up to 2, while any wrong term in
    # the derivation is O(1e-2) or worse.
    tol = 1e-10
    assert rel_err(o, o_ref) < tol
    assert rel_err(h, h_ref) < tol
    for name, a, e in zip(NAMES, g_ours, g_ref, strict=True):
        assert a.dtype == e.dtype, name
        assert rel_err(a, e) < tol, (name, rel_err(a, e))


def test_wy_eps_forward_bias_and_backward_consistency(x64):
    """wy_eps acts on the WY diagonal only: the forward moves away from the exact operator by
    O(eps), and the custom backward is the exact gradient of that damped forward (autodiff of
    the plain-JAX chunked forward)."""
    inp = make_inputs(Case(B=1, T=21, H=1, dk=6, dv=5, decay="strong", seed=4), jnp.float64)
    eps = 1e-2
    params, _ = params_for(inp, JaxRefConfig(bt=8, bc=4, wy_block=2, wy_eps=eps), jnp.float64)
    (o, _), g_custom = run("jax_ref", params, inp)
    o_ref, _ = gdn2_token_serial_reference(*inp.args, params.scale, inp.h0)
    bias = rel_err(o, o_ref)
    # docs/algorithm.md 5.3 measures a relative bias ~ eps; allow 1e-4 .. 1e-1 around eps = 1e-2.
    assert 1e-4 < bias < 1e-1
    _, g_plain = run("plain", params, inp)
    for name, a, e in zip(NAMES, g_custom, g_plain, strict=True):
        # float64 rounding only (docs/algorithm.md 5.3 measures 1.6e-15); 1e-10 as above.
        assert rel_err(a, e) < 1e-10, name


def test_float32_and_bfloat16(x64):
    """float32 against the float64 reference; bfloat16 against the float32 result of the same
    (bf16-rounded) inputs, as docs/operator.md prescribes."""
    case = Case(B=1, T=50, H=2, dk=16, dv=8, b_max=2.0, decay="strong", seed=5)
    inp64 = make_inputs(case, jnp.float64)
    cfg = JaxRefConfig(bt=16, bc=8, wy_block=4)
    params64, _ = params_for(inp64, cfg, jnp.float64)
    (o_ref, h_ref), g_ref = run("serial", params64, inp64)

    inp32 = make_inputs(case, jnp.float32)
    params32, _ = params_for(inp32, cfg, jnp.float32)
    assert params32.acc == "float32"
    (o, h), g32 = run("jax_ref", params32, inp32)
    assert o.dtype == jnp.float32 and h.dtype == jnp.float32
    # float32: docs/algorithm.md 5.4 measures 2e-6 .. 1e-5 for the chunked algorithm; strong decay and
    # b up to 2 amplify rounding a few-fold: 1e-4 forward, 3e-4 gradients (as the conformance
    # suite).
    assert rel_err(o, o_ref) < 1e-4 and rel_err(h, h_ref) < 1e-4
    for name, a, e in zip(NAMES, g32, g_ref, strict=True):
        assert rel_err(a, e) < 3e-4, name

    inp16 = inp32.astype(jnp.bfloat16)
    (o16, h16), grads16 = run("jax_ref", params32, inp16)
    assert o16.dtype == jnp.bfloat16 and h16.dtype == jnp.float32
    (o_same, h_same), _ = run("jax_ref", params32, inp16.astype(jnp.float32))
    # Everything runs in float32 after the cast; only o's final rounding to bf16 (2^-9 relative)
    # separates the two, and h_final is identical up to float32 rounding.
    assert rel_err(o16, o_same) < 8e-3
    assert rel_err(h16, h_same) < 1e-6
    for name, gr, x in zip(NAMES, grads16, (*inp16.args, inp16.h0), strict=True):
        assert gr.dtype == x.dtype, name
        assert bool(jnp.all(jnp.isfinite(gr.astype(jnp.float32)))), name


def test_g_minus_50_float32_is_finite_and_correct(x64):
    """Per-token g = -50 on whole runs of tokens: |gamma_cum| reaches 1600 inside a 32-token chunk,
    far past float32's exp overflow at 88; outputs and gradients must stay finite and correct."""
    case = Case(B=1, T=40, H=1, dk=8, dv=8, seed=6)
    inp64 = make_inputs(case, jnp.float64)
    inp64 = type(inp64)(**{**inp64.__dict__, "g": inp64.g.at[:, 2:34:2].set(-50.0)})
    cfg = JaxRefConfig(bt=32, bc=16, wy_block=8)
    params64, _ = params_for(inp64, cfg, jnp.float64)
    (o_ref, h_ref), g_ref = run("serial", params64, inp64)
    inp32 = inp64.astype(jnp.float32)
    inp32 = type(inp32)(
        **{
            **inp32.__dict__,
            "h0": inp32.h0.astype(jnp.float32),
            "do": inp32.do.astype(jnp.float32),
            "dh": inp32.dh.astype(jnp.float32),
        }
    )
    params32, _ = params_for(inp32, cfg, jnp.float32)
    (o, h), g32 = run("jax_ref", params32, inp32)
    # Same float32 tolerances as test_float32_and_bfloat16.
    assert rel_err(o, o_ref) < 1e-4 and rel_err(h, h_ref) < 1e-4
    for name, a, e in zip(NAMES, g32, g_ref, strict=True):
        assert rel_err(a, e) < 3e-4, name


def test_jit_vmap_and_grad():
    """jit, vmap over an extra leading axis, and grad of a loss using o and h_final compose; the
    batched result equals the per-example one."""
    cfg = JaxRefConfig(bt=8, bc=4, wy_block=2)
    inps = [make_inputs(Case(B=1, T=19, H=2, dk=4, dv=6, seed=s)) for s in (7, 8)]
    params, _ = params_for(inps[0], cfg, jnp.float32)
    stacked = [
        jnp.stack([getattr(i, n) for i in inps]) for n in ("q", "k", "v", "w", "b", "g", "h0")
    ]

    def fwd_and_grads(*a):
        def loss(*a):
            o, h = gdn2_chunk_trainable(*a, params)
            return jnp.sum(jnp.sin(o)) + jnp.sum(h * h), (o, h)

        return jax.grad(loss, argnums=tuple(range(7)), has_aux=True)(*a)

    grads_b, (o_b, h_b) = jax.jit(jax.vmap(fwd_and_grads))(*stacked)
    single = jax.jit(fwd_and_grads)
    for j, inp in enumerate(inps):
        grads, (o, h) = single(*inp.args, inp.h0)
        # Same float32 arithmetic, batched or not: equal up to rounding differences of the
        # batched matmuls (1e-5 relative).
        assert rel_err(o_b[j], o) < 1e-5 and rel_err(h_b[j], h) < 1e-5
        for name, gb, gs in zip(NAMES, grads_b, grads, strict=True):
            assert rel_err(gb[j], gs) < 1e-5, name


def test_residuals_are_the_inputs_and_group_states(monkeypatch):
    monkeypatch.setattr(chunk, "GROUP_BYTES", 1)  # one chunk per group: the most states
    inp = make_inputs(Case(B=2, T=21, H=3, dk=4, dv=5, seed=9))
    params, _ = params_for(inp, JaxRefConfig(bt=8, bc=4, wy_block=2), jnp.float32)
    _, res = _fwd(*inp.args, inp.h0, params)
    assert isinstance(res, Residuals)
    leaves = jax.tree_util.tree_leaves(res)
    assert len(leaves) == 7  # q, k, v, w, b, g and the states, nothing else
    for name, x in zip(("q", "k", "v", "w", "b", "g"), inp.args, strict=True):
        assert getattr(res, name) is x
    assert res.states.shape == (3, 2, 3, 4, 5)  # [n_groups = ceil(21 / 8), B, H, dk, dv]
    np.testing.assert_array_equal(np.asarray(res.states[0]), np.asarray(inp.h0))


def test_backend_class():
    be = JaxRefBackend()
    assert (be.name, be.priority, bool(be.availability())) == ("jax_ref", 100, True)
    inp = make_inputs(Case(B=1, T=10, H=1, dk=4, dv=4, seed=10))
    spec = OpSpec.from_inputs(*inp.args, None, inp.h0)
    cfg = JaxRefConfig(bt=8, bc=4, wy_block=2)
    o, h = jax.jit(functools.partial(be.forward, spec=spec, config=cfg))(*inp.args, inp.h0)
    trainable = functools.partial(be.forward_trainable, spec=spec, config=cfg)
    o_t, h_t = jax.jit(trainable)(*inp.args, inp.h0)
    o_ref, h_ref = gdn2_token_serial_reference(*inp.args, spec.scale, inp.h0)
    # float32 tolerance as above; the two entry points run the same forward.
    assert rel_err(o, o_ref) < 1e-4 and rel_err(h, h_ref) < 1e-4
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_t))
    np.testing.assert_array_equal(np.asarray(h), np.asarray(h_t))


def test_stage_probes_report_under_gdn2_fwd_diag(monkeypatch, caplog):
    """GDN2_FWD_DIAG=1 (read at trace time) makes the forward report its named stages."""
    monkeypatch.setenv("GDN2_FWD_DIAG", "1")
    inp = make_inputs(Case(B=1, T=9, H=1, dk=4, dv=4, seed=11))
    params, _ = params_for(inp, JaxRefConfig(bt=8, bc=4, wy_block=2), jnp.float32)
    with caplog.at_level("INFO", logger="gdn2core.diag"):
        out = jax.jit(gdn2_chunk_forward, static_argnums=7)(*inp.args, inp.h0, params)
        jax.block_until_ready(out)
        jax.effects_barrier()
    stages = " ".join(r.getMessage() for r in caplog.records)
    for stage in ("jax_ref gamma_cum", "jax_ref A_kk", "jax_ref T", "jax_ref o"):
        assert stage in stages
