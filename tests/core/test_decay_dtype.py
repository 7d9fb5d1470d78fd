"""A float32 ``g`` beside bfloat16 inputs (``OpSpec.float32_decay``, and the decode and ragged
specs' ``float32_decay``): the specs take it and refuse any other mixed dtype by name; a backend that declares ``Capabilities.float32_decay``
receives it as it is, any other gets it cast to the inputs' dtype by the core; gradients return
in each argument's dtype. The numerical check of every backend that declares it is the
conformance kit's (gdn2_conformance.decay_suite)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from gdn2_conformance import ReferenceBackend, make_inputs, rel_err
from gdn2_conformance.checks import op_function, outputs_and_grads
from gdn2_conformance.decay_suite import with_float32_decay
from gdn2_conformance.inputs import Case, DecodeCase, make_decode_inputs
from gdn2core import (
    OpSpec,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    gdn2_decode,
    gdn2_decode_reference,
    gdn2_forward,
    gdn2_forward_trainable,
    gdn2_ragged,
    gdn2_token_serial_reference,
    register_backend,
    unregister_backend,
)
from gdn2core.ops.decode.spec import DecodeSpec, expand_heads
from gdn2core.ops.ragged.spec import RaggedSpec

BF16, F32 = jnp.bfloat16, jnp.float32


def _arrays(dtype, g_dtype):
    x = make_inputs(Case(T=9, H=2, dk=4, dv=3, seed=5))
    return (*(a.astype(dtype) for a in x.args[:5]), x.g.astype(g_dtype))


def test_spec_takes_a_float32_g_beside_bfloat16_inputs():
    assert OpSpec.from_inputs(*_arrays(BF16, F32)).float32_decay
    assert OpSpec.from_inputs(*_arrays(BF16, F32)).dtype == "bfloat16"
    assert not OpSpec.from_inputs(*_arrays(BF16, BF16)).float32_decay
    assert not OpSpec.from_inputs(*_arrays(F32, F32)).float32_decay


@pytest.mark.parametrize(
    ("dtype", "g_dtype", "message"),
    [
        (BF16, jnp.float16, r"g: expected dtype bfloat16 \(that of q, k, v, w, b\) or float32 "
                            r"\(a log decay kept in float32\), got float16"),
        (F32, BF16, r"g: expected dtype float32 \(that of q, k, v, w, b\), got bfloat16"),
        (F32, jnp.int32, r"g: expected dtype float32 \(that of q, k, v, w, b\), got int32"),
    ],
)  # fmt: skip
def test_spec_refuses_other_dtypes_of_g_by_name(dtype, g_dtype, message):
    with pytest.raises(TypeError, match=message):
        OpSpec.from_inputs(*_arrays(dtype, g_dtype))


def test_spec_still_names_the_other_inputs_dtypes():
    q, k, v, w, b, g = _arrays(BF16, F32)
    with pytest.raises(TypeError, match="q, k, v, w, b: expected one common dtype.*w=float32"):
        OpSpec.from_inputs(q, k, v, w.astype(F32), b, g)


class Recording(ReferenceBackend):
    """The reference backend recording the spec and g's dtype of every call."""

    seen: list = []  # noqa: RUF012

    def forward(self, q, k, v, w, b, g, h0, *, spec, config, extras=None):
        Recording.seen.append((spec.float32_decay, jnp.dtype(g.dtype).name))
        return super().forward(q, k, v, w, b, g, h0, spec=spec, config=config, extras=extras)

    def decode(self, q, k, v, w, b, g, state, slots, *, spec, config):
        Recording.seen.append((spec.float32_decay, jnp.dtype(g.dtype).name))
        return super().decode(q, k, v, w, b, g, state, slots, spec=spec, config=config)


@pytest.mark.parametrize(("declared", "want"), [(True, (True, "float32")),
                                                (False, (False, "bfloat16"))])  # fmt: skip
def test_a_backend_gets_float32_g_only_when_it_declares_it(declared, want):
    """With the capability the backend sees ``spec.float32_decay`` and a float32 g; without, the
    core casts g to bfloat16 first. Either way dg returns in float32 and the result is the
    token-serial reference's on the g the backend saw (bfloat16 tolerance of the kit, 3e-2, and
    between the two calls: g's rounding, 0.4% per token)."""
    caps = ReferenceBackend.capabilities.model_copy(update={"float32_decay": declared})
    backend = Recording("recording", capabilities=caps)
    register_backend(backend, replace=True)
    try:
        x = with_float32_decay(make_inputs(Case(T=9, H=2, dk=4, dv=3, seed=6)))
        o, h, grads = outputs_and_grads(op_function(gdn2_forward_trainable, x,
                                                    backend="recording"), x)  # fmt: skip
        assert Recording.seen[-1] == want
        assert grads[5].dtype == F32 and grads[0].dtype == BF16
        ref = outputs_and_grads(op_function(gdn2_token_serial_reference, x), x)
        assert rel_err(o, ref[0]) < 3e-2 and rel_err(h, ref[1]) < 3e-2
        assert rel_err(grads[5], ref[2][5]) < 3e-2
    finally:
        unregister_backend("recording")
        Recording.seen.clear()


def test_gated_deltanet_keeps_a_float32_g_on_the_chunked_path_and_on_the_decode_op():
    """``chunk_gated_delta_rule`` and ``fused_recurrent_*`` (on the decode op) hand the float32 g
    on as it is: the recurrent form's state is the chunked call's on the float32 g (both
    token-serial in float32 here: 1e-5), not the one on the rounded g (0.4% per token apart)."""
    register_backend(Recording("recording", capabilities=ReferenceBackend.capabilities),
                     replace=True)  # fmt: skip
    try:
        x = make_inputs(Case(T=5, H=2, dk=4, dv=3, seed=7))
        q, k, v = (a.astype(BF16) for a in x.args[:3])
        g, beta = x.g[..., 0].astype(F32), x.b[..., 0].astype(BF16)  # [B, T, H]
        _, h_f32 = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                          backend="recording")  # fmt: skip
        assert Recording.seen[-1] == (True, "float32")
        _, h = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True,
                                                backend="recording")  # fmt: skip
        assert Recording.seen[-1] == (True, "float32")
        _, h_rounded = chunk_gated_delta_rule(q, k, v, g.astype(BF16), beta,
                                              output_final_state=True, backend="recording")  # fmt: skip
        with jax.default_matmul_precision("highest"):
            assert rel_err(h, h_f32) < 1e-5
            assert rel_err(h, h_rounded) > 1e-4
    finally:
        unregister_backend("recording")
        Recording.seen.clear()


def _decode_arrays(dtype, g_dtype):
    x = make_decode_inputs(DecodeCase(N=2, S=3, H=1, HV=2, dk=4, dv=3, P=3, seed=8))
    return (*(a.astype(dtype) for a in x.args[:5]), x.g.astype(g_dtype), x.state, x.state_indices)


def test_decode_and_ragged_specs_take_a_float32_g_and_refuse_others_by_name():
    q, k, v, w, b, g, pool, idx = _decode_arrays(BF16, F32)
    assert DecodeSpec.from_inputs(q, k, v, w, b, g, pool, idx).float32_decay
    assert not DecodeSpec.from_inputs(q, k, v, w, b, g.astype(BF16), pool, idx).float32_decay
    flat = [a[0] for a in (q, k, v, w, b, g)]  # [S, ., d]: one request of 3 tokens
    ragged = dict(cu_seqlens=[0, 3], state_indices=[1])
    assert RaggedSpec.from_inputs(*flat, pool, **ragged).float32_decay
    message = r"g: expected dtype bfloat16 \(that of q, k, v, w, b\) or float32"
    with pytest.raises(TypeError, match=message):
        DecodeSpec.from_inputs(q, k, v, w, b, g.astype(jnp.float16), pool, idx)
    with pytest.raises(TypeError, match=message):
        RaggedSpec.from_inputs(*flat[:5], flat[5].astype(jnp.float16), pool, **ragged)


@pytest.mark.parametrize(("declared", "want"), [(True, (True, "float32")),
                                                (False, (False, "bfloat16"))])  # fmt: skip
def test_a_decode_backend_gets_float32_g_only_when_it_declares_it(declared, want):
    """gdn2_decode and the decodes of gdn2_ragged hand a backend's decode the float32 g only
    with the capability (else the core casts it); the outputs are the decode reference's on the
    g the backend saw (token-serial in float32 on both sides: 1e-5)."""
    caps = ReferenceBackend.capabilities.model_copy(update={"float32_decay": declared})
    register_backend(Recording("recording", capabilities=caps), replace=True)
    try:
        q, k, v, w, b, g, pool, idx = _decode_arrays(BF16, F32)
        o, new = gdn2_decode(q, k, v, w, b, g, pool, state_indices=idx, backend="recording")
        assert Recording.seen[-1] == want
        seen_g = g if declared else g.astype(BF16)
        o_ref, new_ref = gdn2_decode_reference(q, k, v, w, b, seen_g, pool, idx)
        assert rel_err(o, o_ref) < 1e-5 and rel_err(new, new_ref) < 1e-5
        flat = [a.reshape(-1, *a.shape[2:]) for a in (q, k, v, w, b, g)]  # [N S, ., d]
        gdn2_ragged(*flat, pool, cu_seqlens=[0, 3, 6], state_indices=idx, num_decodes=2,
                    decode_len=3, backend="recording")  # fmt: skip
        assert Recording.seen[-1] == want
    finally:
        unregister_backend("recording")
        Recording.seen.clear()


@pytest.mark.parametrize(("declared", "want"), [(True, (True, "float32")),
                                                (False, (False, "bfloat16"))])  # fmt: skip
def test_a_gate_activated_by_the_core_is_a_float32_decay(declared, want):
    """``use_gate_in_kernel`` on bfloat16 inputs, for a backend that does not fuse activations
    (the core applies them in XLA) and on the decode op (the core always does): the gate is
    computed in float32 and handed on in float32 (as fla's kernels and pallas_tpu's fused gate
    keep it), or cast to bfloat16 for a backend without the capability. The chunked call and the
    decode call on the same raw inputs then agree (both token-serial in float32: 1e-5)."""
    caps = ReferenceBackend.capabilities.model_copy(
        update={"float32_decay": declared, "fused_activations": False}
    )
    register_backend(Recording("recording", capabilities=caps), replace=True)
    try:
        q, k, v, w, b, g, pool, idx = _decode_arrays(BF16, BF16)
        gate = dict(use_gate_in_kernel=True, A_log=jnp.asarray([0.3]),
                    dt_bias=jnp.full((1, 4), 0.5))  # fmt: skip
        h0 = pool[idx].astype(F32)
        heads = v.shape[2]
        keys = [expand_heads(a, heads) for a in (q, k, b, g)]
        per_value_head = dict(gate, A_log=jnp.repeat(gate["A_log"], heads),
                              dt_bias=jnp.repeat(gate["dt_bias"], heads, axis=0))  # fmt: skip
        _, h_fwd = gdn2_forward(*keys[:2], v, w, *keys[2:], h0=h0, backend="recording",
                                **per_value_head)  # fmt: skip
        assert Recording.seen[-1] == want
        _, new = gdn2_decode(q, k, v, w, b, g, pool, state_indices=idx, backend="recording",
                             **gate)  # fmt: skip
        assert Recording.seen[-1] == want
        assert rel_err(new[idx], h_fwd) < 1e-5
    finally:
        unregister_backend("recording")
        Recording.seen.clear()
