"""``chunk_kda`` and ``chunk_gated_delta_rule`` on pallas_tpu (TPU interpret mode) against their
own token-serial recurrences: outputs, final states and every gradient, with grouped value heads,
the fused gates (KDA's lower-bound gate takes the merged-levels path) and beta's sigmoid; and
``fused_recurrent_gated_delta_rule`` on pallas_tpu's decode kernel with a state pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_conformance import rel_err
from gdn2core import (
    KernelConfig,
    chunk_gated_delta_rule,
    chunk_kda,
    fused_recurrent_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
    naive_recurrent_kda,
)

B, T, H, HV, K, V = 1, 70, 2, 4, 64, 64
#: The conformance kit's float32 bounds: the kernels run float32 products as three bf16 passes
#: (1.7e-5 on outputs, 2.2e-5 on gradients measured, docs/algorithm.md section 10).
TOL_OUT, TOL_GRAD = 1e-4, 3e-4
CASES = {
    # op, gates on (key / value heads), options
    "kda-key-heads-lower-bound": (chunk_kda, naive_recurrent_kda, False, H,
                                  {"use_gate_in_kernel": True, "lower_bound": -5.0,
                                   "use_qk_l2norm_in_kernel": True}),
    "gdn-value-heads-softplus": (chunk_gated_delta_rule, naive_recurrent_gated_delta_rule, True,
                                 HV, {"use_gate_in_kernel": True,
                                      "use_beta_sigmoid_in_kernel": True,
                                      "use_qk_l2norm_in_kernel": True}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_family_on_pallas_tpu_matches_its_recurrence(case):
    chunked, naive, scalar, Hg, options = CASES[case]
    rng = np.random.default_rng(len(case))

    def arr(*shape, lo=-1.0, hi=1.0):
        return jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32)

    g = arr(B, T, Hg, lo=-2.0, hi=2.0) if scalar else arr(B, T, Hg, K, lo=-2.0, hi=6.0)
    args = (arr(B, T, H, K), arr(B, T, H, K), arr(B, T, HV, V), g, arr(B, T, Hg, lo=-2.0, hi=2.0))
    params = (arr(Hg, lo=-1.0, hi=0.5), arr(Hg) if scalar else arr(Hg * K))
    h0, do, dh = arr(B, HV, K, V), arr(B, T, HV, V), arr(B, HV, K, V)

    def loss_of(fn, **kw):
        def loss(q, k, v, g, beta, h0, A_log, dt_bias):
            o, h = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, A_log=A_log,
                      dt_bias=dt_bias, **options, **kw)  # fmt: skip
            return jnp.sum(o * do) + jnp.sum(h * dh), (o, h)

        return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(8)), has_aux=True))

    inputs = (*args, h0, *params)
    config = KernelConfig(bt=16, interpret=True)
    (_, (o, h)), grads = loss_of(chunked, backend="pallas_tpu", config=config)(*inputs)
    with jax.default_matmul_precision("highest"):
        (_, (o_r, h_r)), grads_r = loss_of(naive)(*inputs)
    assert rel_err(o, o_r) <= TOL_OUT and rel_err(h, h_r) <= TOL_OUT
    names = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
    for name, gx, gr in zip(names, grads, grads_r, strict=True):
        assert rel_err(gx, gr) <= TOL_GRAD, (name, rel_err(gx, gr))


def test_fused_recurrent_gdn_on_the_decode_kernel_with_a_pool():
    """Qwen-like decoding: 2 sequences of 3 tokens, gates on the value heads, a bfloat16 pool of 5
    slots; the named slots advance as the GDN recurrence from them does (the slot rounded once to
    bfloat16: 2^-8 relative, 4e-3 bound), the other slots come back bit for bit."""
    rng = np.random.default_rng(11)

    def arr(*shape, lo=-1.0, hi=1.0):
        return jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32)

    q, k, v = arr(2, 3, H, K), arr(2, 3, H, K), arr(2, 3, HV, V)
    g, beta = arr(2, 3, HV, lo=-1.0, hi=0.0), arr(2, 3, HV, lo=0.0)
    pool = arr(5, HV, K, V).astype(jnp.bfloat16)
    idx = jnp.asarray([4, 0])
    o, new = fused_recurrent_gated_delta_rule(
        q, k, v, g, beta=beta, initial_state=pool, output_final_state=True, state_indices=idx,
        use_qk_l2norm_in_kernel=True, backend="pallas_tpu",
        config=KernelConfig(bt=16, interpret=True),
    )  # fmt: skip
    with jax.default_matmul_precision("highest"):
        o_r, h_r = naive_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=pool[idx].astype(jnp.float32),
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
    assert rel_err(o, o_r) <= TOL_OUT
    assert new.dtype == jnp.bfloat16 and rel_err(new[idx], h_r) <= 4e-3
    for slot in (1, 2, 3):
        np.testing.assert_array_equal(np.asarray(new[slot]), np.asarray(pool[slot]))
