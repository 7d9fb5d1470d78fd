"""``GDN2Layer(variant="kda" | "gdn")``: the layer's mixer is exactly KDA / GDN (its output equals
fla's op, ``chunk_kda`` / ``chunk_gated_delta_rule``, and their independent token-serial
recurrences, on the layer's own projections), with grouped value heads and gates on either
head set; serving from a cache gives the same outputs as one call; errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from gdn2_conformance import rel_err
from gdn2core import naive_recurrent_gated_delta_rule, naive_recurrent_kda
from gdn2core.layers import GDN2Layer

D, H, HV, DK = 32, 2, 4, 16
#: float32, "highest" matmul precision: the chunked operator and the token-serial scan differ by
#: rounding only (about 1e-6 relative); 1e-5.
TOL = 1e-5


def _mixer_by_hand(layer: GDN2Layer, x: jax.Array) -> jax.Array:
    """The layer's o computed from its projections with the variant's own recurrence (fla's
    activations applied by the reference: L2 norm, beta's sigmoid, the softplus gate)."""
    B, T, _ = x.shape
    Hg = layer.gate_heads
    q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
    q, k, v = layer.q_conv(q), layer.k_conv(k), layer.v_conv(v)
    q, k = q.reshape(B, T, H, DK), k.reshape(B, T, H, DK)
    v = v.reshape(B, T, HV, layer.dv)
    beta = layer.b_proj(x).reshape(B, T, Hg)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              A_log=layer.A_log[...], dt_bias=layer.dt_bias[...], scale=layer.scale)  # fmt: skip
    if layer.variant == "kda":
        g = layer.f_proj(x).reshape(B, T, Hg, DK)
        o, _ = naive_recurrent_kda(q, k, v, g, beta, **kw)
    else:
        g = layer.f_proj(x).reshape(B, T, Hg)
        o, _ = naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    return layer._output(x, o.astype(x.dtype))


@pytest.mark.parametrize(
    "key_head_gates", [False, True], ids=["value-head-gates", "key-head-gates"]
)
@pytest.mark.parametrize("variant", ["kda", "gdn"])
def test_layer_variant_is_the_recurrence(variant, key_head_gates):
    layer = GDN2Layer(D, H, DK, num_v_heads=HV, key_head_gates=key_head_gates, variant=variant,
                      backend="jax_ref", rngs=nnx.Rngs(0))  # fmt: skip
    assert layer.w_proj is None
    Hg = H if key_head_gates else HV
    assert layer.b_proj.kernel.shape == (D, Hg)
    assert layer.dt_bias.shape == ((Hg,) if variant == "gdn" else (Hg * DK,))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 21, D))
    with jax.default_matmul_precision("highest"):
        y = layer(x)
        assert rel_err(y, _mixer_by_hand(layer, x)) <= TOL
    cache = layer.init_cache(2)
    parts, pieces = [], ((0, 13), (13, 14), (14, 21))  # a prefill, one decode token, the rest
    for lo, hi in pieces:
        y_part, cache = layer(x[:, lo:hi], cache=cache)
        parts.append(y_part)
    assert rel_err(jnp.concatenate(parts, axis=1), y) <= TOL


@pytest.mark.parametrize(("variant", "g_rank"), [("kda", 4), ("gdn", 3)])
def test_serving_hands_scalar_gates_to_the_ops(monkeypatch, variant, g_rank):
    """From a cache, the prefill's chunked op and the decode op get beta (and GDN's decay) as the
    operator's scalar gates, w ``(B, T, HV)`` and b ``(B, T, Hg)``, as the cacheless call does:
    the prefill then runs the scalar-gate kernels of a backend that has them (the decode op
    broadcasts them itself). Outputs: :func:`test_layer_variant_is_the_recurrence`."""
    import gdn2core.layers.gdn2_layer as module

    seen = []

    def spy(name):
        real = getattr(module, name)

        def call(*args, **kw):
            seen.append((name, tuple(a.ndim for a in args[3:6])))  # w, b, g
            return real(*args, **kw)

        return call

    for name in ("gdn2_forward", "gdn2_decode"):
        monkeypatch.setattr(module, name, spy(name))
    layer = GDN2Layer(D, H, DK, num_v_heads=HV, variant=variant, backend="jax_ref",
                      rngs=nnx.Rngs(0))  # fmt: skip
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 14, D))
    cache = layer.init_cache(2)
    _, cache = layer(x[:, :13], cache=cache)
    layer(x[:, 13:], cache=cache)
    assert seen == [("gdn2_forward", (3, 3, g_rank)), ("gdn2_decode", (3, 3, g_rank))]


def test_variant_errors():
    with pytest.raises(ValueError, match=r"variant: expected one of \('gdn2', 'kda', 'gdn'\)"):
        GDN2Layer(D, H, DK, variant="deltanet", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="lift_b: expected False with variant='kda'"):
        GDN2Layer(D, H, DK, variant="kda", lift_b=True, rngs=nnx.Rngs(0))
