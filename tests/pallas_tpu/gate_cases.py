"""What the scalar-gate and grouped-keys tests share: their inputs (b, g on the key or the value
heads, each gate scalar or full), their keywords, and the train call in interpret mode checked
against the token-serial reference, outputs and every gradient."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import gdn2core
from gdn2_conformance import rel_err
from gdn2core import KernelConfig

#: The conformance kit's float32 bounds: float32 products run as three bf16 passes (1.7e-5 on
#: outputs, 2.2e-5 on gradients measured, docs/algorithm.md section 10).
TOL_OUT, TOL_GRAD = 1e-4, 3e-4
CONFIG = KernelConfig(bt=16, interpret=True)
K = V = 64
GRAD_NAMES = ("dq", "dk", "dv", "dw", "db", "dg", "dh0")


def gate_inputs(H, HV, T, scalar, seed, gate_heads=None, dv=V):
    """``((q, k, v, w, b, g), h0, do, dh)``: q, k on ``H`` heads, v, w on ``HV`` heads of ``dv``
    channels, b, g on ``gate_heads`` (default ``H``); the gates ``scalar`` names one value per
    head and token."""
    rng = np.random.default_rng(seed)
    Hg = H if gate_heads is None else gate_heads

    def arr(*shape, lo=-1.0, hi=1.0):
        return jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32)

    q, k, v = arr(1, T, H, K), arr(1, T, H, K), arr(1, T, HV, dv)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    w = arr(1, T, HV, lo=0.05) if "w" in scalar else arr(1, T, HV, dv, lo=0.05)
    b = arr(1, T, Hg, lo=0.05) if "b" in scalar else arr(1, T, Hg, K, lo=0.05)
    g = arr(1, T, Hg, lo=-1.5, hi=-0.01) if "g" in scalar else arr(1, T, Hg, K, lo=-1.5, hi=-0.01)
    return (q, k, v, w, b, g), arr(1, HV, K, dv), arr(1, T, HV, dv), arr(1, HV, K, dv)


def gate_keywords(options, gate_heads, T):
    """The call's keywords from a case's options: ``segment_ids=True`` becomes sequences of 9, up
    to 30 and the rest of the tokens; a fused gate gets ``A_log``, ``dt_bias`` on the gate heads
    (``dt_bias_per_head=True``: ``(Hg,)``, else ``(Hg, dk)``)."""
    kw = dict(options)
    if kw.pop("segment_ids", False):
        ids = [0] * 9 + [1] * min(30, T - 9) + [2] * max(0, T - 39)
        kw["segment_ids"] = jnp.asarray([ids], jnp.int32)
    per_head = kw.pop("dt_bias_per_head", False)  # (Hg,): one bias per head (a scalar g)
    if kw.get("use_gate_in_kernel"):
        kw["A_log"] = jnp.linspace(-1.0, 0.5, gate_heads).astype(jnp.float32)
        kw["dt_bias"] = (
            jnp.linspace(-0.5, 0.5, gate_heads).astype(jnp.float32)
            if per_head
            else jnp.linspace(-0.5, 0.5, gate_heads * K).reshape(gate_heads, K).astype(jnp.float32)
        )
    return kw


def assert_train_matches_reference(args, h0, do, dh, kw) -> Callable:
    """The pallas_tpu train call (interpret mode, under jit) on ``args`` against the token-serial
    reference at "highest" precision: o, h_final, the seven gradients (shapes too: a scalar gate's
    is ``(B, T, H)``) and those of ``A_log``, ``dt_bias`` in ``kw``. Returns the call's
    ``(q, k, v, w, b, g) -> (loss and outputs, gradients)``, for a look at its program."""
    kw = dict(kw)
    params = {n: kw.pop(n) for n in ("A_log", "dt_bias") if n in kw}

    def loss_of(fn, **more):
        def loss(q, k, v, w, b, g, h0, params):
            o, h = fn(q, k, v, w, b, g, h0=h0, **kw, **params, **more)
            return jnp.sum(o * do) + jnp.sum(h * dh), (o, h)

        return jax.value_and_grad(loss, argnums=tuple(range(8)), has_aux=True)

    run = loss_of(gdn2core.gdn2_forward_trainable, backend="pallas_tpu", config=CONFIG)
    (_, (o, h)), grads = jax.jit(run)(*args, h0, params)
    with jax.default_matmul_precision("highest"):
        (_, (o_r, h_r)), grads_r = loss_of(gdn2core.gdn2_token_serial_reference)(*args, h0, params)
    assert rel_err(o, o_r) <= TOL_OUT and rel_err(h, h_r) <= TOL_OUT
    for name, got, want in zip(GRAD_NAMES, grads[:7], grads_r[:7], strict=True):
        assert got.shape == want.shape, name
        assert rel_err(got, want) <= TOL_GRAD, name
    for name in params:
        assert rel_err(grads[7][name], grads_r[7][name]) <= TOL_GRAD, name
    return lambda *a: run(*a, h0, params)


def assert_chunk_states_match_reference(args, h0, chunks: tuple[int, ...]) -> None:
    """The pallas_tpu forward with chunk states (interpret mode) against the reference: o,
    h_final, and the entry state of each chunk in ``chunks`` (C = 16) against the reference's
    state after that prefix."""
    o, h, states = gdn2core.gdn2_forward(*args, h0=h0, backend="pallas_tpu", config=CONFIG,
                                         return_chunk_states=True)  # fmt: skip
    o_r, h_r = gdn2core.gdn2_token_serial_reference(*args, h0=h0)
    assert rel_err(o, o_r) <= TOL_OUT and rel_err(h, h_r) <= TOL_OUT
    for i in chunks:
        _, h_i = gdn2core.gdn2_token_serial_reference(*(a[:, : 16 * i] for a in args), h0=h0)
        assert rel_err(states[:, i], h_i) <= TOL_OUT, i
