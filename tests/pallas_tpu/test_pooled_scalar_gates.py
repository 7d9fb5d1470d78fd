"""Scalar gates (KDA's and GDN's beta, GDN's decay: ``(T, heads)``) through the ragged op's
pooled forward on pallas_tpu: the kernel reads them as one value per head and token, moved into
the chunk-aligned row in XLA (4 bytes a head and token), never as ``(T, heads, d)`` arrays.

Interpret mode against the token-serial ragged reference on the same gates written out on every
channel (not through the scalar path under test). Tolerance: 5e-5 relative in float32, as
test_pooled_flat_tokens.py (the chunked forward's documented error is 1.7e-5; a gate read at the
wrong token, or a filler's gate left in, gives errors of order 1, a NaN of the padding NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn2_pallas_tpu.vjp as vjp
from gdn2_conformance import rel_err
from gdn2core import KernelConfig, gdn2_ragged, gdn2_ragged_reference

from .helpers import FLAT, FLAT_PADDING, FLAT_T, ragged_tokens

TOL = 5e-5
INTERPRET = KernelConfig(bt=16, interpret=True)
P, DK, DV = 12, 64, 64
#: the mixed step of test_pooled_flat_tokens.py (helpers.FLAT): a decode, a resumed request at
#: context 7, a new one of 21 tokens (a checkpoint), a resumed one at context 33; NaN padding.
KW, T, PADDING = FLAT, FLAT_T, FLAT_PADDING
#: (H, HV, gates on the value heads, fused gate): H = 8 reads the flat tokens (token-major),
#: H = 4 moves every input into the row (head-major); gates on the key heads leave w on the
#: value heads (grouped: the core broadcasts it), on the value heads all three are scalar.
CASES = {
    "flat-key-gates": (8, 16, False, False),
    "flat-value-gates-fused": (8, 16, True, True),
    "head-major-value-gates": (4, 4, True, False),
}


def _inputs(h, hv, value_gates, fused):
    x, pool = ragged_tokens(T, 3, h, hv, DK, DV, P, PADDING)
    q, k, v, w, b, g = x
    gh = hv if value_gates else h
    ks = jax.random.split(jax.random.PRNGKey(4), 3)
    w = jax.nn.sigmoid(jax.random.normal(ks[0], (T, hv)))
    b = jax.nn.sigmoid(jax.random.normal(ks[1], (T, gh)))
    g = jax.random.normal(ks[2], (T, gh)) if fused else -0.3 * jax.nn.softplus(b * 3 - 1)
    scalar = tuple(a.at[PADDING:].set(jnp.nan) for a in (w, b, g))  # the padding: anything
    feats = {}
    if fused:  # GDN's gate: -exp(A_log) softplus(g + dt_bias), in the kernel
        feats = dict(use_gate_in_kernel=True, A_log=jnp.log(jnp.linspace(0.5, 2.0, gh)),
                     dt_bias=0.1 * jnp.arange(gh, dtype=jnp.float32))  # fmt: skip
    return (q, k, v), scalar, pool, feats


@pytest.mark.parametrize("case", sorted(CASES))
def test_pooled_forward_reads_scalar_gates(case, monkeypatch):
    h, hv, value_gates, fused = CASES[case]
    (q, k, v), scalar, pool, feats = _inputs(h, hv, value_gates, fused)
    full = (
        jnp.broadcast_to(scalar[0][..., None], (T, hv, DV)),
        *(jnp.broadcast_to(a[..., None], (*a.shape, DK)) for a in scalar[1:]),
    )
    dt = feats.get("dt_bias")
    if dt is not None:  # the reference's per-channel dt_bias, the same on every channel
        feats_full = dict(feats, dt_bias=jnp.broadcast_to(dt[:, None], (dt.shape[0], DK)))
        feats = dict(feats, dt_bias=feats_full["dt_bias"])
    else:
        feats_full = feats
    ranks = []
    real = vjp.gdn2_pallas_pooled

    def spy(q, k, v, w, b, g, *rest, **kw):
        ranks.append((w.ndim, b.ndim, g.ndim))
        return real(q, k, v, w, b, g, *rest, **kw)

    monkeypatch.setattr(vjp, "gdn2_pallas_pooled", spy)
    o, new = gdn2_ragged(q, k, v, *scalar, pool, num_decodes=1, backend="pallas_tpu",
                         config=INTERPRET, **KW, **feats)  # fmt: skip
    # w is broadcast under grouped values with gates on the key heads, the rest stay scalar
    assert ranks == [(4 if h != hv and not value_gates else 3, 3, 3)]
    o_ref, new_ref = gdn2_ragged_reference(q, k, v, *full, pool, **KW, **feats_full)
    assert rel_err(o[:PADDING], o_ref[:PADDING]) < TOL
    np.testing.assert_array_equal(np.asarray(o[PADDING:]), 0.0)  # padding: zero, not NaN
    assert rel_err(new, new_ref) < TOL
