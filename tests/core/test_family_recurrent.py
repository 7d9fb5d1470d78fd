"""``fused_recurrent_kda`` and ``fused_recurrent_gated_delta_rule`` (fla's recurrent entry points)
against the family's own token-serial recurrences (``naive_recurrent_kda``,
``naive_recurrent_gated_delta_rule``, written from the KDA and GDN definitions): both paths (the
decode op for short rows, the chunked op for long or packed ones), fla's options, grouped value
heads, the state layout, a state pool with ``state_indices`` (named slots advanced, the others bit
for bit), GDN's ``g`` / ``gk`` decays and defaults, and the refused arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_conformance import rel_err
from gdn2core import (
    KernelConfig,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
    naive_recurrent_gated_delta_rule,
    naive_recurrent_kda,
)
from gdn2core.ops.family import recurrent

H, HV, K, V = 2, 4, 8, 12
#: float32 at "highest" matmul precision on both sides: the decode op is a token-serial scan of
#: the GDN-2 form, the chunked op a WY computation; both differ from the family recurrence by
#: rounding only (about 1e-6 relative here); 1e-5 leaves 10x.
TOL = 1e-5
CFG = KernelConfig(bt=16)


def _arr(rng, *shape, lo=-1.0, hi=1.0):
    return jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32)


def _kda_inputs(b, t, gate_heads, raw=False, seed=0):
    rng = np.random.default_rng(seed)
    g = (
        _arr(rng, b, t, gate_heads, K, lo=-2.0, hi=2.0)
        if raw
        else _arr(rng, b, t, gate_heads, K, lo=-1.0, hi=0.0)
    )
    beta = _arr(rng, b, t, gate_heads, lo=-2.0 if raw else 0.0, hi=2.0 if raw else 1.0)
    args = (_arr(rng, b, t, H, K), _arr(rng, b, t, H, K), _arr(rng, b, t, HV, V), g, beta)
    params = (_arr(rng, gate_heads, lo=-1.0, hi=0.5), _arr(rng, gate_heads * K))
    return args, _arr(rng, b, HV, K, V), params


@pytest.mark.parametrize("t", [5, 70], ids=["decode-op", "chunked-op"])
@pytest.mark.parametrize("options", ["plain", "fused-gates"])
def test_kda_matches_its_recurrence(t, options, monkeypatch):
    """Grouped value heads with gates on the value heads; the fused gate (lower bound), beta's
    sigmoid (doubled) and the q/k norm; A_log, dt_bias by position as fla passes them. The short
    row runs on the decode op, the long one on the chunked op."""
    ran = []
    for name in ("gdn2_decode", "gdn2_forward"):
        op = getattr(recurrent, name)
        monkeypatch.setattr(recurrent, name, lambda *a, _op=op, _n=name, **kw: (
            ran.append(_n), _op(*a, **kw))[1])  # fmt: skip
    raw = options == "fused-gates"
    args, h0, (A_log, dt_bias) = _kda_inputs(2, t, HV, raw=raw, seed=t)
    kw = {}
    if raw:
        kw = dict(use_gate_in_kernel=True, lower_bound=-3.0, use_beta_sigmoid_in_kernel=True,
                  allow_neg_eigval=True, use_qk_l2norm_in_kernel=True)  # fmt: skip
    params = (A_log, dt_bias) if raw else (None, None)
    with jax.default_matmul_precision("highest"):
        o, h = fused_recurrent_kda(*args, *params, initial_state=h0, output_final_state=True,
                                   backend="jax_ref", config=CFG, **kw)  # fmt: skip
        named = dict(A_log=A_log, dt_bias=dt_bias) if raw else {}
        o_r, h_r = naive_recurrent_kda(*args, initial_state=h0, output_final_state=True, **kw,
                                       **named)  # fmt: skip
    assert ran == ["gdn2_decode" if t <= recurrent.DECODE_MAX_TOKENS else "gdn2_forward"]
    assert o.shape == (2, t, HV, V) and h.dtype == jnp.float32
    assert rel_err(o, o_r) <= TOL and rel_err(h, h_r) <= TOL


@pytest.mark.parametrize("t", [5, 70], ids=["decode-op", "chunked-op"])
@pytest.mark.parametrize("decay", ["g", "gk", "g-and-gk", "none"])
def test_gdn_decays_match_the_recurrence(t, decay):
    """``g`` (per head), ``gk`` (per key channel), both (their log decays add) or neither (no
    decay), against the KDA recurrence with that per-channel decay; gates on the key heads."""
    rng = np.random.default_rng(len(decay) + t)
    q, k, v = _arr(rng, 1, t, H, K), _arr(rng, 1, t, H, K), _arr(rng, 1, t, HV, V)
    g, gk = _arr(rng, 1, t, H, lo=-1.0, hi=0.0), _arr(rng, 1, t, H, K, lo=-1.0, hi=0.0)
    beta, h0 = _arr(rng, 1, t, H, lo=0.0), _arr(rng, 1, HV, K, V)
    given = {"g": {"g": g}, "gk": {"gk": gk}, "g-and-gk": {"g": g, "gk": gk}, "none": {}}[decay]
    per_channel = {
        "g": jnp.broadcast_to(g[..., None], gk.shape), "gk": gk, "g-and-gk": g[..., None] + gk,
        "none": jnp.zeros_like(gk),
    }[decay]  # fmt: skip
    with jax.default_matmul_precision("highest"):
        o, h = fused_recurrent_gated_delta_rule(q, k, v, **given, beta=beta, initial_state=h0,
                                                output_final_state=True, backend="jax_ref",
                                                config=CFG)  # fmt: skip
        o_r, h_r = naive_recurrent_kda(q, k, v, per_channel, beta, initial_state=h0,
                                       output_final_state=True)  # fmt: skip
    assert rel_err(o, o_r) <= TOL and rel_err(h, h_r) <= TOL, decay


def test_gdn_beta_defaults_to_ones_and_matches_its_own_recurrence():
    """No ``beta``: ones (fla's default); the scalar ``g`` path against the GDN recurrence."""
    rng = np.random.default_rng(3)
    q, k, v = _arr(rng, 2, 6, H, K), _arr(rng, 2, 6, H, K), _arr(rng, 2, 6, H, V)
    g = _arr(rng, 2, 6, H, lo=-1.0, hi=0.0)
    with jax.default_matmul_precision("highest"):
        o, none = fused_recurrent_gated_delta_rule(q, k, v, g, backend="jax_ref")
        o_r, _ = naive_recurrent_gated_delta_rule(q, k, v, g, jnp.ones((2, 6, H)))
    assert none is None and rel_err(o, o_r) <= TOL


def test_fla_return_convention_state_layout_and_packed_sequences():
    """``final_state`` None unless asked; no ``initial_state`` is zeros; ``state_v_first``
    transposes the state in and out; ``cu_seqlens`` (the chunked op) runs each sequence from its
    own state."""
    args, h0, _ = _kda_inputs(1, 9, H, seed=1)
    o, none = fused_recurrent_kda(*args, backend="jax_ref")
    o_z, _ = naive_recurrent_kda(*args)
    assert none is None and rel_err(o, o_z) <= TOL
    with jax.default_matmul_precision("highest"):
        o_t, h_t = fused_recurrent_kda(*args, initial_state=jnp.swapaxes(h0, -1, -2),
                                       output_final_state=True, state_v_first=True,
                                       backend="jax_ref")  # fmt: skip
        o_n, h_n = naive_recurrent_kda(*args, initial_state=h0, output_final_state=True)
    assert rel_err(o_t, o_n) <= TOL and rel_err(jnp.swapaxes(h_t, -1, -2), h_n) <= TOL
    cu = (0, 4, 9)
    starts = jnp.concatenate([h0, -h0])
    with jax.default_matmul_precision("highest"):
        o_p, h_p = fused_recurrent_kda(*args, initial_state=starts, output_final_state=True,
                                       cu_seqlens=jnp.asarray(cu), backend="jax_ref",
                                       config=CFG)  # fmt: skip
        for n in range(2):
            part = [x[:, cu[n] : cu[n + 1]] for x in args]
            o_n, h_n = naive_recurrent_kda(*part, initial_state=starts[n : n + 1],
                                           output_final_state=True)  # fmt: skip
            assert (
                rel_err(o_p[:, cu[n] : cu[n + 1]], o_n) <= TOL
                and rel_err(h_p[n : n + 1], h_n) <= TOL
            ), n


@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.bfloat16])
def test_state_pool_slots_advance_and_the_rest_stay_bit_for_bit(pool_dtype):
    """``state_indices``: sequence n starts from slot ``state_indices[n]`` of the pool and leaves
    its state there (rounded once to the pool's dtype); every other slot is returned as given."""
    args, _, _ = _kda_inputs(2, 3, HV, seed=4)
    pool = _arr(np.random.default_rng(5), 5, HV, K, V).astype(pool_dtype)
    idx = jnp.asarray([3, 1])
    with jax.default_matmul_precision("highest"):
        o, new = fused_recurrent_kda(*args, initial_state=pool, output_final_state=True,
                                     state_indices=idx, backend="jax_ref")  # fmt: skip
        o_r, h_r = naive_recurrent_kda(*args, initial_state=pool[idx].astype(jnp.float32),
                                       output_final_state=True)  # fmt: skip
    assert new.dtype == pool_dtype and new.shape == pool.shape
    # bfloat16 pool: the slot is rounded once (2^-8 relative), float32: rounding of the scan
    tol = 4e-3 if pool_dtype == jnp.bfloat16 else TOL
    assert rel_err(o, o_r) <= TOL and rel_err(new[idx], h_r.astype(pool_dtype)) <= tol
    for slot in (0, 2, 4):
        np.testing.assert_array_equal(np.asarray(new[slot]), np.asarray(pool[slot]))


def test_refused_arguments_name_themselves():
    args, h0, _ = _kda_inputs(1, 4, H)
    q, k, v, g, beta = args
    with pytest.raises(ValueError, match=r"gv: a decay per value channel is not in the GDN-2"):
        fused_recurrent_gated_delta_rule(q, k, v, gv=jnp.zeros((1, 4, HV, V)))
    with pytest.raises(ValueError, match=r"beta: expected shape \(B, T, Hg\).*headwise"):
        fused_recurrent_gated_delta_rule(q, k, v, beta=jnp.ones((1, 4, HV, V)))
    with pytest.raises(ValueError, match=r"gk: expected shape \(B, T, Hg, dk\) as beta"):
        fused_recurrent_gated_delta_rule(q, k, v, gk=g[..., :-1], beta=beta)
    with pytest.raises(ValueError, match=r"g: expected shape \(B, T, Hg\) as beta"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta)
    with pytest.raises(ValueError, match="state_indices: a state pool needs the decode op"):
        fused_recurrent_kda(*args, initial_state=h0, output_final_state=True,
                            state_indices=jnp.asarray([0]), cu_seqlens=jnp.asarray([0, 4]))  # fmt: skip
    with pytest.raises(ValueError, match=r"expected initial_state \(the pool\) and "
                                         r"output_final_state=True"):  # fmt: skip
        fused_recurrent_kda(*args, initial_state=h0, state_indices=jnp.asarray([0]))
    with pytest.raises(ValueError, match=r"initial_state: expected shape \(B, HV, dk, dv\)"):
        fused_recurrent_kda(*args, initial_state=jnp.zeros((2, HV, K, V)))
    with pytest.raises(ValueError, match="allow_neg_eigval: expected use_beta_sigmoid_in_kernel"):
        fused_recurrent_kda(*args, allow_neg_eigval=True)
    with pytest.raises(TypeError, match="ssm_state_indices is vLLM's keyword; pass state_indices="):
        fused_recurrent_kda(*args, ssm_state_indices=jnp.asarray([0]))
    with pytest.raises(TypeError, match="num_accepted_tokens .* return_token_states=True"):
        fused_recurrent_gated_delta_rule(q, k, v, num_accepted_tokens=jnp.asarray([1]))
