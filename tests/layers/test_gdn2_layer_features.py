"""GDN2Layer's model features: packed sequences (segment_ids) with the short convolutions reset
at every start, padding (attention_mask, unpadded as fla does), and grouped value heads
(num_v_heads).

References: separate layer calls per sequence (packing) or on the unpadded tokens (padding), a
plain layer on repeated key heads (grouped value heads). Tolerances are float32 rounding of the same arithmetic in a different
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


def _unpadded(layer, x, mask, **kw):
    """fla's unpadding, by hand: each row's tokens (the mask's non-zero positions) alone."""
    return [layer(x[r : r + 1, np.flatnonzero(mask[r])], **kw) for r in range(len(mask))]


def test_attention_mask_unpads_like_fla(ref_backend):
    """fla removes the padded positions and runs each row's remaining tokens as one sequence
    (get_unpad_data / index_first_axis): padding on the left, on the right, between tokens
    (a gap of 2, and gaps of 1 inside the conv window), the tokens' outputs equal a call on the
    row's tokens alone, the state and the short convolutions carried across each gap; y = 0 at
    padding."""
    layer = GDN2Layer(D, H, DK, backend=ref_backend.name, rngs=nnx.Rngs(0))
    x = _x(B=4, T=10)
    mask = np.zeros((4, 10), np.int32)
    mask[0, 3:] = 1  # left padding
    mask[1, :6] = 1  # right padding
    mask[2, :4] = mask[2, 6:] = 1  # a gap of two between tokens: still one sequence
    mask[3, [1, 2, 4, 6, 9]] = 1  # padding everywhere
    y = nnx.jit(lambda m, x, a: m(x, attention_mask=a))(layer, x, jnp.asarray(mask))
    for row, alone in enumerate(_unpadded(layer, x, mask)):
        idx = np.flatnonzero(mask[row])
        np.testing.assert_allclose(y[row : row + 1, idx], alone, rtol=RTOL, atol=ATOL)
    assert np.all(np.asarray(y)[mask == 0] == 0)
    # the mask of booleans, and of all tokens (the plain call), are the same call
    y_bool = nnx.jit(lambda m, x, a: m(x, attention_mask=a))(layer, x, jnp.asarray(mask != 0))
    np.testing.assert_array_equal(np.asarray(y_bool), np.asarray(y))
    np.testing.assert_allclose(
        layer(x, attention_mask=jnp.ones((4, 10))), layer(x), rtol=RTOL, atol=ATOL
    )


def test_attention_mask_with_h0_and_segment_ids(ref_backend):
    """h0 enters each row's first token (wherever the padding is); with segment_ids a sequence
    starts where the id changes from one token to the next (the padding between skipped)."""
    layer = GDN2Layer(D, H, DK, backend=ref_backend.name, rngs=nnx.Rngs(0))
    x = _x(B=2, T=10)
    mask = np.ones((2, 10), np.int32)
    mask[0, :2] = mask[0, 5:7] = 0  # left padding and a gap
    mask[1, 3] = mask[1, 8:] = 0
    h0 = jax.random.normal(jax.random.key(3), (2, H, DK, DK))
    y = nnx.jit(lambda m, x, a, h: m(x, attention_mask=a, h0=h))(layer, x, jnp.asarray(mask), h0)
    for row in range(2):
        idx = np.flatnonzero(mask[row])
        alone = layer(x[row : row + 1, idx], h0=h0[row : row + 1])
        np.testing.assert_allclose(y[row : row + 1, idx], alone, rtol=RTOL, atol=ATOL)
    # row 0: ids 4 4 | 4 4 4 _ _ 4 | 9 9 -> tokens 2..4 and 7 are one sequence, 8..9 another
    ids = jnp.asarray([[4, 4, 4, 4, 4, 4, 4, 4, 9, 9], [1] * 10], jnp.int32)
    y = nnx.jit(lambda m, x, a, s: m(x, attention_mask=a, segment_ids=s))(
        layer, x, jnp.asarray(mask), ids
    )
    for span in ([2, 3, 4, 7], [8, 9]):
        np.testing.assert_allclose(y[:1, span], layer(x[:1, span]), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="attention_mask: not with return_state"):
        layer(x, attention_mask=jnp.asarray(mask), return_state=True)


def test_attention_mask_padding_never_reaches_a_token_bitwise():
    """jax_ref (the real, chunked path): other values at the padded positions (between tokens
    too) leave the tokens' outputs and input gradients identical bit for bit; y and the gradient
    are 0 at padding."""
    layer = GDN2Layer(D, H, DK, expand_v=2, backend="jax_ref", rngs=nnx.Rngs(0))
    mask = np.ones((2, T), np.int32)
    mask[0, 3:6] = mask[0, -2:] = 0
    mask[1, :4] = mask[1, 9] = 0
    dy = jax.random.normal(jax.random.key(5), (2, T, D))

    @nnx.jit
    def run(m, x):
        y, vjp = jax.vjp(lambda x_: m(x_, attention_mask=jnp.asarray(mask)), x)
        return y, vjp(dy)[0]

    x = _x(B=2)
    noise = jax.random.normal(jax.random.key(9), x.shape)
    x2 = jnp.where(jnp.asarray(mask == 0)[..., None], x + 10 * noise, x)
    (y, dx), (y2, dx2) = run(layer, x), run(layer, x2)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx2))
    assert np.all(np.asarray(y)[mask == 0] == 0) and np.all(np.asarray(dx)[mask == 0] == 0)
    assert np.all(np.abs(np.asarray(dx)[mask != 0]).sum(-1) > 0)


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
