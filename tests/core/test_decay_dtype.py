"""A float32 ``g`` beside bfloat16 inputs (``OpSpec.float32_decay``): the spec takes it and
refuses any other mixed dtype by name; a backend that declares ``Capabilities.float32_decay``
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
from gdn2_conformance.inputs import Case
from gdn2core import (
    OpSpec,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    gdn2_forward_trainable,
    gdn2_token_serial_reference,
    register_backend,
    unregister_backend,
)

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


def test_gated_deltanet_keeps_a_float32_g_on_the_chunked_path_and_rounds_it_for_decode():
    """``chunk_gated_delta_rule`` hands the float32 g on as it is; ``fused_recurrent_*`` on the
    decode op (one dtype) rounds it to bfloat16, so its state is that of the chunked call on the
    rounded g (the decode op and the reference are token-serial in float32: 1e-5)."""
    register_backend(Recording("recording", capabilities=ReferenceBackend.capabilities),
                     replace=True)  # fmt: skip
    try:
        x = make_inputs(Case(T=5, H=2, dk=4, dv=3, seed=7))
        q, k, v = (a.astype(BF16) for a in x.args[:3])
        g, beta = x.g[..., 0].astype(F32), x.b[..., 0].astype(BF16)  # [B, T, H]
        chunk_gated_delta_rule(q, k, v, g, beta, backend="recording")
        assert Recording.seen[-1] == (True, "float32")
        _, h = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True,
                                                backend="jax_ref")  # fmt: skip
        _, h_rounded = chunk_gated_delta_rule(q, k, v, g.astype(BF16), beta,
                                              output_final_state=True, backend="recording")  # fmt: skip
        with jax.default_matmul_precision("highest"):
            assert rel_err(h, h_rounded) < 1e-5
    finally:
        unregister_backend("recording")
        Recording.seen.clear()
