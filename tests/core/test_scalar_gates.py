"""Scalar gates in the core: ``b``, ``g`` ``(B, T, Hg)`` and ``w`` ``(B, T, HV)`` (one value per
head and token, the same on every channel): validation, what each backend receives, and results
equal to the call on the gates broadcast by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn2core
from gdn2_conformance import ReferenceBackend
from gdn2core import gdn2_forward, gdn2_forward_trainable
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.plugin import Capabilities, broadcast_gates

B, T, H, HV, K, V = 2, 11, 2, 4, 8, 6


def _inputs(Hv=H, scalar=("w", "b", "g"), seed=0):
    rng = np.random.default_rng(seed)

    def arr(*shape, lo=-1.0, hi=1.0):
        return jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32)

    q, k, v = arr(B, T, H, K), arr(B, T, H, K), arr(B, T, Hv, V)
    w = arr(B, T, Hv, lo=0.1) if "w" in scalar else arr(B, T, Hv, V, lo=0.1)
    b = arr(B, T, H, lo=0.1) if "b" in scalar else arr(B, T, H, K, lo=0.1)
    g = arr(B, T, H, lo=-1.0, hi=0.0) if "g" in scalar else arr(B, T, H, K, lo=-1.0, hi=0.0)
    return q, k, v, w, b, g


def _full(q, k, v, w, b, g):
    expand = lambda x, d: x if x.ndim == 4 else jnp.broadcast_to(x[..., None], (*x.shape, d))  # noqa: E731
    return q, k, v, expand(w, v.shape[-1]), expand(b, K), expand(g, K)


@pytest.mark.parametrize("scalar", [("w", "b"), ("w", "b", "g"), ("g",)], ids="".join)
def test_spec_names_the_scalar_gates(scalar):
    spec = OpSpec.from_inputs(*_inputs(scalar=scalar))
    assert spec.scalar_gates == scalar
    assert OpSpec.from_inputs(*_full(*_inputs(scalar=scalar))).scalar_gates == ()


@pytest.mark.parametrize(
    "name, shape, message",
    [
        ("b", (B, T, H + 1), r"b: expected shape \(B, T, H\) = \(2, 11, 2\), got \(2, 11, 3\)"),
        ("w", (B, T, H + 1), r"w: expected shape \(B, T, HV\) \(a scalar gate\) = \(2, 11, 2\)"),
        ("g", (B, T), r"g: expected rank 4 \(B, T, H, dk\) or rank 3 \(B, T, Hg\), got rank 2"),
        ("w", (B, T), r"w: expected rank 4 \(B, T, HV, dv\) or rank 3 \(B, T, HV\), got rank 2"),
    ],
)
def test_bad_scalar_gates_are_named(name, shape, message):
    args = dict(zip("qkvwbg", _inputs(), strict=True))
    args[name] = jnp.zeros(shape, jnp.float32)
    with pytest.raises(ValueError, match=message):
        gdn2_forward(*args.values(), backend="jax_ref")


def test_gates_of_different_heads_are_refused():
    """b on the key heads, g on the value heads: one Hg for both, as with full gates."""
    q, k, v, w, b, _ = _inputs(Hv=HV)
    g = jnp.zeros((B, T, HV), jnp.float32)
    with pytest.raises(ValueError, match=r"g: expected the heads of b \(2\), got shape"):
        gdn2_forward(q, k, v, w, b, g, backend="jax_ref")


@pytest.mark.parametrize("Hv", [H, HV], ids=["plain", "grouped"])
def test_scalar_gates_equal_their_broadcast(Hv):
    """On a backend that takes only full gates (jax_ref) the core broadcasts them: o, h_final as
    the call on gates broadcast by hand, bit for bit; a scalar gate's gradient is the sum of the
    broadcast gate's over its channels (1e-6: the same sums, maybe in another order)."""
    args = _inputs(Hv=Hv)
    full = _full(*args)
    o, h = gdn2_forward(*args, backend="jax_ref")
    o_f, h_f = gdn2_forward(*full, backend="jax_ref")
    assert np.array_equal(o, o_f) and np.array_equal(h, h_f)

    def loss(*a):
        o, h = gdn2_forward_trainable(*a, backend="jax_ref")
        return jnp.sum(jnp.sin(o)) + jnp.sum(h * h)

    grads = jax.grad(loss, argnums=tuple(range(6)))(*args)
    grads_f = jax.grad(loss, argnums=tuple(range(6)))(*full)
    for name, got, want in zip("qkvwbg", grads, grads_f, strict=True):
        want = want if got.ndim == 4 else jnp.sum(want, axis=-1)
        assert got.shape == args["qkvwbg".index(name)].shape, name
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=name)


class Recording(ReferenceBackend):
    """The reference, recording the gate shapes it receives."""

    seen: list = []  # noqa: RUF012

    def forward(self, q, k, v, w, b, g, h0, *, spec, config, extras=None):
        Recording.seen.append((spec.scalar_gates, w.shape, b.shape, g.shape))
        return super().forward(q, k, v, w, b, g, h0, spec=spec, config=config, extras=extras)


@pytest.fixture
def recording():
    caps = {
        "scalar": Capabilities(auto=False, fused_activations=True, scalar_gates=True),
        "full": Capabilities(auto=False, fused_activations=True),
        "xla_activations": Capabilities(auto=False, scalar_gates=True),
    }
    for name, c in caps.items():
        gdn2core.register_backend(Recording(f"rec_{name}", capabilities=c), replace=True)
    yield Recording.seen
    for name in caps:
        gdn2core.unregister_backend(f"rec_{name}")
    Recording.seen.clear()


def test_what_each_backend_receives(recording):
    """A backend that declares scalar gates gets them (B, T, H); one that does not, or that
    leaves the activations to the core (applied in XLA on full gates), gets them broadcast; under
    grouped value heads (shared keys) w is broadcast for all (its kernel head has G dv
    channels). Each call's result equals the reference's."""
    args = _inputs()
    ref = gdn2core.gdn2_token_serial_reference(*_full(*args))
    for name in ("scalar", "full"):
        o, _ = gdn2_forward(*args, backend=f"rec_{name}")
        np.testing.assert_allclose(o, ref[0], rtol=1e-6, atol=1e-6)
    act = {"use_bw_sigmoid_in_kernel": True}
    gdn2_forward(*args, backend="rec_xla_activations", **act)
    grouped = _inputs(Hv=HV)
    gdn2_forward(*grouped, backend="rec_scalar")
    assert recording == [
        (("w", "b", "g"), (B, T, H), (B, T, H), (B, T, H)),
        ((), (B, T, H, V), (B, T, H, K), (B, T, H, K)),
        ((), (B, T, H, V), (B, T, H, K), (B, T, H, K)),
        (("b", "g"), (B, T, H, 2 * V), (B, T, H), (B, T, H)),
    ]


def test_broadcast_gates_keeps_the_others():
    args = _inputs()
    spec = OpSpec.from_inputs(*args)
    w, b, g = args[3:]
    view, w2, b2, g2 = broadcast_gates(spec, w, b, g, ("b",))
    assert view.scalar_gates == ("w", "g") and w2 is w and g2 is g
    assert b2.shape == (B, T, H, K) and np.array_equal(b2[..., 3], b)


def test_describe_lists_scalar_gates():
    assert "scalar gates" in Capabilities(scalar_gates=True).describe()
    assert "scalar gates" not in Capabilities().describe()
