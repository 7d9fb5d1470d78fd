"""GDN2Layer's model features: packed sequences (segment_ids, attention_mask) with the short
convolutions reset at every start, and grouped value heads (num_v_heads).

References: separate layer calls per sequence (packing), a plain layer on repeated key heads
(grouped value heads). Tolerances are float32 rounding of the same arithmetic in a different
order (another T, another head layout): 2e-5 absolute on outputs of size ~1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn2core.layers import GDN2Layer
from gdn2core.layers.gdn2_layer import positions_in_segment, sequence_starts

D, H, DK = 16, 2, 8
#: float32, same arithmetic in another order (other T or head layout), outputs ~1.
ATOL, RTOL = 2e-5, 2e-5
LENGTHS = (5, 1, 7, 3)  # a length-1 sequence, boundaries inside the conv window (size 4)
T = sum(LENGTHS)


def _x(B=1, T=T, seed=1):
    return jax.random.normal(jax.random.key(seed), (B, T, D))


def _ids(lengths=LENGTHS, offset=3):
    return jnp.asarray(np.repeat(np.arange(len(lengths)) + offset, lengths)[None], jnp.int32)


@nnx.jit
def _apply(m, x, seg=None):
    return m(x, segment_ids=seg)


def test_starts_and_positions():
    seg = jnp.asarray([[7, 7, 2, 2, 2, 7]])
    mask = jnp.asarray([[1, 1, 1, 0, 0, 1]])
    np.testing.assert_array_equal(sequence_starts((1, 6), seg), [[1, 0, 1, 0, 0, 1]])
    np.testing.assert_array_equal(sequence_starts((1, 6), None, mask), [[1, 0, 0, 1, 0, 1]])
    both = sequence_starts((1, 6), seg, mask)
    np.testing.assert_array_equal(both, [[1, 0, 1, 1, 0, 1]])
    np.testing.assert_array_equal(positions_in_segment(both), [[0, 1, 0, 0, 1, 0]])
    assert sequence_starts((1, 6)) is None


@pytest.mark.parametrize("expand_v", [2])
def test_packed_equals_separate_calls(ref_backend, expand_v):
    """Each packed sequence's output (and the row's final state) equals a call on it alone."""
    layer = GDN2Layer(D, H, DK, expand_v=expand_v, backend=ref_backend.name, rngs=nnx.Rngs(0))
    x = _x()
    y, h = nnx.jit(lambda m, x, s: m(x, segment_ids=s, return_state=True))(layer, x, _ids())
    start = 0
    for n in LENGTHS:
        y1, h1 = layer(x[:, start : start + n], return_state=True)
        np.testing.assert_allclose(y[:, start : start + n], y1, rtol=RTOL, atol=ATOL)
        start += n
    np.testing.assert_allclose(h, h1, rtol=RTOL, atol=ATOL)  # the last sequence's state


def test_packed_no_leakage_bitwise():
    """jax_ref (the real path): perturbing one packed sequence leaves the others' outputs and
    input gradients identical bit for bit (the conv windows and the state are reset)."""
    layer = GDN2Layer(D, H, DK, expand_v=2, lift_b=True, backend="jax_ref", rngs=nnx.Rngs(0))
    seg = _ids()
    dy = jax.random.normal(jax.random.key(5), (1, T, D))

    @nnx.jit
    def run(m, x):
        y, vjp = jax.vjp(lambda x_: m(x_, segment_ids=seg), x)
        return y, vjp(dy)[0]

    x = _x()
    lo, hi = LENGTHS[0] + LENGTHS[1], LENGTHS[0] + LENGTHS[1] + LENGTHS[2]  # the third sequence
    x2 = x.at[:, lo:hi].add(jax.random.normal(jax.random.key(9), (1, hi - lo, D)))
    (y, dx), (y2, dx2) = run(layer, x), run(layer, x2)
    keep = np.r_[0:lo, hi:T]
    np.testing.assert_array_equal(np.asarray(y)[:, keep], np.asarray(y2)[:, keep])
    np.testing.assert_array_equal(np.asarray(dx)[:, keep], np.asarray(dx2)[:, keep])
    assert not np.allclose(y[:, lo:hi], y2[:, lo:hi])  # the perturbation did reach its sequence


def test_attention_mask_left_and_right_padding(ref_backend):
    """Padding on either side: the tokens' outputs equal a call on the tokens alone; y = 0 at
    padding. A row with a gap is two sequences."""
    layer = GDN2Layer(D, H, DK, backend=ref_backend.name, rngs=nnx.Rngs(0))
    x = _x(B=3, T=10)
    mask = np.zeros((3, 10), np.int32)
    mask[0, 3:] = 1  # left padding
    mask[1, :6] = 1  # right padding
    mask[2, :4] = mask[2, 6:] = 1  # a gap: two sequences
    y = nnx.jit(lambda m, x, a: m(x, attention_mask=a))(layer, x, jnp.asarray(mask))
    for row, spans in ((0, [(3, 10)]), (1, [(0, 6)]), (2, [(0, 4), (6, 10)])):
        for lo, hi in spans:
            alone = layer(x[row : row + 1, lo:hi])
            np.testing.assert_allclose(y[row : row + 1, lo:hi], alone, rtol=RTOL, atol=ATOL)
    assert np.all(np.asarray(y)[mask == 0] == 0)
    with pytest.raises(ValueError, match="attention_mask: not with h0 or return_state"):
        layer(x, attention_mask=jnp.asarray(mask), return_state=True)


def test_segment_ids_errors(ref_backend):
    layer = GDN2Layer(D, H, DK, backend=ref_backend.name, rngs=nnx.Rngs(0))
    x = _x(B=2, T=6)
    with pytest.raises(ValueError, match=r"segment_ids: expected shape \(B, T\) = \(2, 6\), got"):
        layer(x, segment_ids=jnp.zeros((2, 5), jnp.int32))
    with pytest.raises(TypeError, match="segment_ids: expected an integer dtype, got float32"):
        layer(x, segment_ids=jnp.zeros((2, 6), jnp.float32))
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \(B, T\) = \(2, 6\)"):
        layer(x, attention_mask=jnp.ones((6,)))


def _repeat_heads(kernel, heads, groups, axis):
    """A weight whose ``axis`` holds ``heads`` blocks, each block repeated ``groups`` times."""
    shape = kernel.shape
    blocks = kernel.reshape(*shape[:axis], heads, shape[axis] // heads, *shape[axis + 1 :])
    out = jnp.repeat(blocks, groups, axis=axis)
    return out.reshape(*shape[:axis], heads * groups * (shape[axis] // heads), *shape[axis + 1 :])


@pytest.mark.parametrize("key_head_gates", [False, True])
def test_num_v_heads_equals_repeated_key_heads(ref_backend, key_head_gates):
    """HV = 2H equals a plain layer with H' = HV whose q/k (and, with key_head_gates, b/g/A_log/
    dt_bias) weights repeat each key head for its group; the value side is shared as is."""
    G, HV = 2, 2 * H
    gva = GDN2Layer(
        D, H, DK, expand_v=2, num_v_heads=HV, key_head_gates=key_head_gates,
        backend=ref_backend.name, rngs=nnx.Rngs(0),
    )  # fmt: skip
    plain = GDN2Layer(D, HV, DK, expand_v=2, backend=ref_backend.name, rngs=nnx.Rngs(1))
    assert gva.q_proj.kernel.shape == (D, H * DK) and gva.v_proj.kernel.shape == (D, HV * 2 * DK)
    Hg = H if key_head_gates else HV
    assert gva.A_log.shape == (Hg,) and gva.dt_bias.shape == (Hg * DK,)
    assert gva.b_proj.kernel.shape == (D, Hg * DK)
    repeated = {"q_proj", "k_proj", "q_conv", "k_conv"}
    if key_head_gates:
        repeated |= {"b_proj", "f_proj", "A_log", "dt_bias"}
    weights = jax.tree_util.tree_map_with_path(
        lambda path, a: _repeat_heads(a, H, G, a.ndim - 1) if path[0].key in repeated else a,
        nnx.to_pure_dict(nnx.state(gva, nnx.Param)),
    )
    target = nnx.state(plain, nnx.Param)
    nnx.replace_by_pure_dict(target, weights)
    nnx.update(plain, target)
    x = _x(B=2, T=9)
    y_gva, h_gva = gva(x, return_state=True)
    y_plain, h_plain = plain(x, return_state=True)
    assert h_gva.shape == (2, HV, DK, 2 * DK)
    np.testing.assert_allclose(y_gva, y_plain, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(h_gva, h_plain, rtol=RTOL, atol=ATOL)


def test_num_v_heads_must_divide():
    with pytest.raises(ValueError, match="num_v_heads: expected a positive multiple of num_heads"):
        GDN2Layer(D, 2, DK, num_v_heads=3, rngs=nnx.Rngs(0))
