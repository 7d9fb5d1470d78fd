"""``chunk_kda`` and ``chunk_gated_delta_rule`` (fla's signatures on the GDN-2 operator) against
their own token-serial recurrences (``naive_recurrent_kda``, ``naive_recurrent_gated_delta_rule``,
written from the KDA and GDN definitions, not through the GDN-2 reference): outputs, final states
and every gradient, fla's options one by one, packed sequences, grouped value heads, float64
central differences of the gate parameters and beta, and errors that name fla's arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_conformance import rel_err
from gdn2_conformance.checks import check_central_differences
from gdn2core import (
    KernelConfig,
    chunk_gated_delta_rule,
    chunk_kda,
    naive_recurrent_gated_delta_rule,
    naive_recurrent_kda,
)

B, T, H, K, V = 2, 37, 2, 8, 12
#: float32 at "highest" matmul precision on both sides: the chunked GDN-2 computation and the
#: token-serial scan differ by rounding (about 1e-6 relative here); 1e-5 leaves 10x.
TOL = 1e-5
OPS = {
    "kda": (chunk_kda, naive_recurrent_kda, False),
    "gdn": (chunk_gated_delta_rule, naive_recurrent_gated_delta_rule, True),
}
#: fla's options, one combination per case (the gate, beta's activations, the norm).
OPTIONS = {
    "plain": {},
    "l2norm": {"use_qk_l2norm_in_kernel": True},
    "softplus-gate": {"use_gate_in_kernel": True},
    "lower-bound-gate": {"use_gate_in_kernel": True, "lower_bound": -3.0},
    "beta-sigmoid-neg-eigval": {"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True},
}


def _inputs(op: str, heads_v: int, gate_heads: int, options: dict, dtype=jnp.float32, seed=0,
            b=B, t=T):  # fmt: skip
    rng = np.random.default_rng(seed)

    def arr(*shape, lo=-1.0, hi=1.0):
        return jnp.asarray(rng.uniform(lo, hi, shape), dtype)

    scalar = OPS[op][2]
    gate_shape = (b, t, gate_heads) if scalar else (b, t, gate_heads, K)
    raw_gate = options.get("use_gate_in_kernel", False)
    g = arr(*gate_shape, lo=-2.0, hi=2.0) if raw_gate else arr(*gate_shape, lo=-1.0, hi=0.0)
    raw_beta = options.get("use_beta_sigmoid_in_kernel", False)
    beta = arr(b, t, gate_heads, lo=-2.0 if raw_beta else 0.0, hi=2.0 if raw_beta else 1.0)
    args = (arr(b, t, H, K), arr(b, t, H, K), arr(b, t, heads_v, V), g, beta)
    kw = dict(options)
    if raw_gate:
        kw["A_log"] = arr(gate_heads, lo=-1.0, hi=0.5)
        kw["dt_bias"] = arr(gate_heads) if scalar else arr(gate_heads * K)
    h0 = arr(b, heads_v, K, V)
    cot = (arr(b, t, heads_v, V), arr(b, heads_v, K, V))
    return args, h0, kw, cot


def _loss(fn, cot, **call_kw):
    do, dh = cot

    def loss(q, k, v, g, beta, h0, *params):
        named = dict(zip(("A_log", "dt_bias"), params, strict=False))
        o, h = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **named, **call_kw)
        return jnp.sum(o.astype(h.dtype) * do) + jnp.sum(h * dh), (o, h)

    return loss


def _params(kw):
    return tuple(kw.pop(n) for n in ("A_log", "dt_bias") if n in kw)


CASES = [(op, option) for op in OPS for option in OPTIONS if op == "kda" or "lower" not in option]


@pytest.mark.parametrize("gate_heads", ["key", "value"])
@pytest.mark.parametrize("op, option", CASES)
def test_op_matches_its_own_recurrence(op, option, gate_heads):
    """jax_ref, grouped value heads (HV = 2 H; beta and g on the key or the value heads): o, the
    final state and the gradients of q, k, v, g, beta, h0 (and A_log, dt_bias) against the
    independent recurrence's autodiff (GDN has no lower-bound gate in fla)."""
    chunked, naive, _ = OPS[op]
    Hg = H if gate_heads == "key" else 2 * H
    args, h0, kw, cot = _inputs(op, 2 * H, Hg, OPTIONS[option], seed=len(option))
    params = _params(kw)
    argnums = tuple(range(6 + len(params)))
    run = _loss(chunked, cot, backend="jax_ref", config=KernelConfig(bt=16), **kw)
    ref = _loss(naive, cot, **kw)
    with jax.default_matmul_precision("highest"):
        (_, (o, h)), grads = jax.value_and_grad(run, argnums, has_aux=True)(*args, h0, *params)
        (_, (o_r, h_r)), grads_r = jax.value_and_grad(ref, argnums, has_aux=True)(
            *args, h0, *params
        )
    assert o.shape == (B, T, 2 * H, V) and o.dtype == jnp.float32
    assert rel_err(o, o_r) <= TOL and rel_err(h, h_r) <= TOL
    names = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
    for name, gx, gr in zip(names, grads, grads_r, strict=False):
        assert gx.shape == gr.shape and rel_err(gx, gr) <= TOL, (name, rel_err(gx, gr))


@pytest.mark.parametrize("op", list(OPS))
def test_float32_gates_beside_bfloat16_inputs(op):
    """fla's layers pass g and beta in float32 beside bfloat16 q, k, v: g stays float32 (the
    call differs from the one on g rounded to bfloat16), beta is rounded to bfloat16 (the same
    call on beta rounded first, exactly), and both gradients come back in float32."""
    chunked, _, _ = OPS[op]
    (q, k, v, g, beta), h0, _, cot = _inputs(op, H, H, {}, b=1)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))

    def run(g, beta):
        o, h = chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                       backend="jax_ref")  # fmt: skip
        return jnp.sum(o.astype(jnp.float32) * cot[0]) + jnp.sum(h * cot[1]), (o, h)

    (_, (o, h)), (dg, dbeta) = jax.value_and_grad(run, argnums=(0, 1), has_aux=True)(g, beta)
    bf = jnp.bfloat16
    _, (o_b, h_b) = run(g, beta.astype(bf))
    assert o.dtype == bf and jnp.array_equal(o, o_b) and jnp.array_equal(h, h_b)
    _, (_, h_g) = run(g.astype(bf), beta)
    assert not jnp.array_equal(h, h_g), "g was rounded to bfloat16"
    assert dg.dtype == dbeta.dtype == jnp.float32
    assert float(jnp.abs(dg).max()) > 0 and float(jnp.abs(dbeta).max()) > 0


@pytest.mark.parametrize("op", list(OPS))
def test_fla_return_convention_state_layout_and_packed_sequences(op):
    """``final_state`` is None unless asked; ``state_v_first`` transposes the state in and out;
    ``cu_seqlens`` runs each sequence from its own state, as the recurrence run alone on it."""
    chunked, naive, _ = OPS[op]
    args, h0, _, _ = _inputs(op, H, H, {}, b=1)
    o, none = chunked(*args, initial_state=h0, backend="jax_ref")
    assert none is None and o.shape == (1, T, H, V)
    o_t, h_t = chunked(*args, initial_state=jnp.swapaxes(h0, -1, -2), output_final_state=True,
                       state_v_first=True, backend="jax_ref")  # fmt: skip
    o_n, h_n = naive(*args, initial_state=h0, output_final_state=True)
    assert rel_err(o_t, o_n) <= TOL and rel_err(jnp.swapaxes(h_t, -1, -2), h_n) <= TOL
    cu = (0, 10, 10, 37)  # an empty sequence in the middle
    starts = jnp.stack([h0[0], 0.5 * h0[0], -h0[0]])
    o_p, h_p = chunked(*args, initial_state=starts, output_final_state=True,
                       cu_seqlens=jnp.asarray(cu), backend="jax_ref")  # fmt: skip
    for n in range(3):
        part = [x[:, cu[n] : cu[n + 1]] for x in args]
        o_n, h_n = naive(*part, initial_state=starts[n : n + 1], output_final_state=True)
        assert rel_err(h_p[n : n + 1], h_n) <= TOL, n
        if cu[n + 1] > cu[n]:
            assert rel_err(o_p[:, cu[n] : cu[n + 1]], o_n) <= TOL, n


@pytest.mark.parametrize("op", list(OPS))
def test_gate_parameters_and_beta_match_central_differences(op, x64):
    """float64: the gradients of the raw beta (sigmoid, doubled) and of A_log, dt_bias (the
    softplus gate; the lower-bound gate for KDA) through the op, against central differences."""
    options = {"use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True,
               "allow_neg_eigval": True}  # fmt: skip
    if op == "kda":
        options["lower_bound"] = -2.0
    args, h0, kw, cot = _inputs(op, 2 * H, H, options, dtype=jnp.float64, b=1, t=9)
    params = _params(kw)
    run = _loss(OPS[op][0], cot, backend="jax_ref", config=KernelConfig(bt=4), **kw)

    def loss(g, beta, *p):
        return run(*args[:3], g, beta, h0, *p)[0]

    check_central_differences(loss, (args[3], args[4], *params), names=("g", "beta", "A_log",
                                                                          "dt_bias"))  # fmt: skip


def test_errors_name_flas_arguments():
    args, _, _, _ = _inputs("kda", H, H, {})
    q, k, v, g, beta = args
    with pytest.raises(ValueError, match=r"beta: expected shape \(B, T, Hg\) with Hg = H = 2"):
        chunk_kda(q, k, v, g, beta[..., None])
    with pytest.raises(ValueError, match=r"g: expected shape \(B, T, Hg, dk\) as beta"):
        chunk_kda(q, k, v, g[..., 0], beta)
    with pytest.raises(ValueError, match=r"g: expected shape \(B, T, Hg\) as beta"):
        chunk_gated_delta_rule(q, k, v, g, beta)
    with pytest.raises(ValueError, match="safe_gate: expected lower_bound to be set"):
        chunk_kda(q, k, v, g, beta, safe_gate=True)
    with pytest.raises(ValueError, match="allow_neg_eigval: expected use_beta_sigmoid_in_kernel"):
        chunk_kda(q, k, v, g, beta, allow_neg_eigval=True)
    with pytest.raises(ValueError, match=r"return_intermediate_states is not supported; use "
                                         r"gdn2_forward\(\.\.\., return_chunk_states=True\)"):  # fmt: skip
        chunk_kda(q, k, v, g, beta, return_intermediate_states=True)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['gate_fn'\]"):
        chunk_kda(q, k, v, g, beta, gate_fn=None)
    with pytest.raises(TypeError, match="output_final_state: expected a bool, got str"):
        chunk_gated_delta_rule(q, k, v, g[..., 0], beta, output_final_state="yes")
    with pytest.raises(ValueError, match=r"dt_bias: expected shape \(Hg \* dk,\)"):
        chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, A_log=jnp.zeros(H),
                  dt_bias=jnp.zeros(H * K + 1))  # fmt: skip
    with pytest.raises(ValueError, match="A_log, dt_bias: expected only with use_gate_in_kernel"):
        chunk_kda(q, k, v, g, beta, A_log=jnp.zeros(H))
    # fla's hints are accepted and change nothing
    o, _ = chunk_kda(q, k, v, g, beta, backend="jax_ref", disable_recompute=True)
    o_h, _ = chunk_kda(q, k, v, g, beta, backend="jax_ref", cu_seqlens_cpu=None, chunk_size=64)
    np.testing.assert_array_equal(o, o_h)
