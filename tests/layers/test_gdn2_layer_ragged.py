"""GDN2Layer.ragged: a serving engine's flat batch of requests against slot pools.

The ground truth is the layer's plain serving call on each request alone
(``layer(x_i[None], cache=GDN2Cache(...))`` from the request's slot: the chunked forward for a
prompt, the decode op for one token), or the same requests run uninterrupted. Tolerances:
outputs and states float32 1e-5 relative (both sides are float32 chunked or decode computations
of the same operator, ~1e-7 apart at these sizes; the ragged op's two-pass composition adds one
float32 product of the pieces' maps); the convolution windows 1e-6 (they are the projections'
outputs, only gathered: any difference is the matmul's rounding for another row count); slots
not named, padded requests and padding tokens exactly (nothing may touch them).

Every ragged call runs jitted (``nnx.jit``, metadata traced) on one padded row of ``T_ROW``
tokens and ``N_ROW`` requests, so a test compiles once per kind of call; the jit test also
compares one eager call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn2_conformance import rel_err
from gdn2core.layers import GDN2Cache, GDN2Layer

D, H, HV, DK = 32, 2, 4, 8
P, T_ROW, N_ROW = 24, 24, 6
F32_TOL, WINDOW_TOL = 1e-5, 1e-6
POOLS = ("conv_q", "conv_k", "conv_v", "state")


@pytest.fixture(scope="module")
def layer():
    return GDN2Layer(D, H, DK, num_v_heads=HV, backend="jax_ref", rngs=nnx.Rngs(0))


def tokens(n, seed):
    return jax.random.normal(jax.random.key(seed), (n, D))


def random_cache(layer, seed=3):
    """Every slot nonzero: a slot read by mistake changes a result."""
    cache = layer.init_ragged_cache(P)
    keys = iter(jax.random.split(jax.random.key(seed), 4))
    return jax.tree.map(lambda a: 0.3 * jax.random.normal(next(keys), a.shape, a.dtype), cache)


TRACES = [0]


@functools.partial(nnx.jit, static_argnames=("checkpoint_every", "num_decodes", "decode_len"))
def _ragged(layer, x, cache, **meta):
    TRACES[0] += 1
    return layer.ragged(x, cache, **meta)


def run(layer, cache, xs, slots, flags, *, ctx=None, ckpt=None, drafts=None, every=None,
        decodes=(0, 1), jit=True):  # fmt: skip
    """The ragged call over requests ``xs`` (each ``(L, D)``) padded to ``T_ROW`` tokens and
    ``N_ROW`` requests (empty, slot -1); ``decodes``: ``(num_decodes, decode_len)``. Returns
    ``(per-request outputs, new cache, y)``."""
    n = len(xs)
    lens = [a.shape[0] for a in xs] + [0] * (N_ROW - n)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    x = jnp.concatenate([*xs, jnp.zeros((T_ROW - int(cu[-1]), D))])

    def rows(a, fill):
        return None if a is None else jnp.asarray(list(a) + [fill] * (N_ROW - n))

    meta = dict(
        cu_seqlens=jnp.asarray(cu), state_indices=rows(slots, -1),
        has_initial_state=rows(flags, False), context_lens=rows(ctx, 0),
        checkpoint_slots=None if ckpt is None else rows(ckpt, [-1] * len(ckpt[0])),
        draft_slots=None if drafts is None else rows(drafts, [-1] * len(drafts[0])),
    )  # fmt: skip
    meta = {k: v for k, v in meta.items() if v is not None}
    meta.update(checkpoint_every=every, num_decodes=decodes[0], decode_len=decodes[1])
    y, new = _ragged(layer, x, cache, **meta) if jit else layer.ragged(x, cache, **meta)
    return [y[cu[i] : cu[i + 1]] for i in range(n)], new, y


@nnx.jit
def _plain(layer, x, cache):
    return layer(x, cache=cache)


def alone(layer, cache, x, slot, flag):
    """The plain serving call on one request from its slot (zeros unless ``flag``):
    ``(y (L, D), GDN2Cache of one row)``."""
    pools = [getattr(cache, name)[slot][None] for name in POOLS]
    pools = [a if flag else jnp.zeros_like(a) for a in pools]
    y, c = _plain(layer, x[None], GDN2Cache(*pools))
    return y[0], c


def assert_slot(new, slot, expected: GDN2Cache, row=0, what=""):
    """Slot ``slot`` of the ragged pools equals row ``row`` of a plain cache."""
    assert rel_err(new.state[slot], expected.state[row]) < F32_TOL, (what, slot)
    for name in POOLS[:3]:
        got, want = getattr(new, name)[slot], getattr(expected, name)[row]
        assert rel_err(got, want) < WINDOW_TOL, (what, slot, name)


def assert_untouched(new, old, named):
    keep = [s for s in range(P) if s not in named]
    for name in POOLS:
        a, b = np.asarray(getattr(new, name)), np.asarray(getattr(old, name))
        np.testing.assert_array_equal(a[keep], b[keep], err_msg=name)


def test_mixed_step_equals_each_request_alone(layer):
    """Step 1 prefills two new requests (slots 7 and 3 hold random values before); step 2 mixes
    a decode (slot 3), an empty request (slot 5), a resumed prefill (slot 7), a new request
    reusing slot 0, a padded request, a 3-token request resumed from slot 11's random cache, and
    one padding token."""
    cache0 = random_cache(layer)
    xs1 = [tokens(8, 1), tokens(3, 2)]
    ys1, cache1, _ = run(layer, cache0, xs1, [7, 3], [False, False])
    for y, x, slot in zip(ys1, xs1, (7, 3), strict=True):
        y_ref, c_ref = alone(layer, cache0, x, slot, False)
        assert rel_err(y, y_ref) < F32_TOL
        assert_slot(cache1, slot, c_ref, what="step 1")
    assert not np.allclose(cache1.state[7], 0) and not np.allclose(cache1.conv_v[7], 0)

    xs = [tokens(1, 3), tokens(0, 4), tokens(8, 5), tokens(8, 6), tokens(3, 7), tokens(3, 8)]
    slots = [3, 5, 7, 0, -1, 11]
    flags = [True, True, True, False, True, True]
    ys, cache2, y_all = run(layer, cache1, xs, slots, flags)
    for i, (x, slot, flag) in enumerate(zip(xs, slots, flags, strict=True)):
        if slot < 0 or x.shape[0] == 0:
            continue
        y_ref, c_ref = alone(layer, cache1, x, slot, flag)
        assert rel_err(ys[i], y_ref) < F32_TOL, i
        assert_slot(cache2, slot, c_ref, what=f"request {i}")
    assert np.all(np.asarray(ys[4]) == 0) and np.all(np.asarray(y_all[23:]) == 0)
    assert_untouched(cache2, cache1, named={3, 7, 0, 11})  # slot 5: empty, resumed: unchanged


@pytest.mark.parametrize("variant", ["kda", "gdn"])
def test_variants_hand_scalar_gates_and_equal_each_request_alone(variant, monkeypatch):
    """KDA's and GDN's layers: the ragged op gets beta (and GDN's decay) as scalar gates, w
    ``(T, HV)``, b ``(T, Hg)``; a decode, a resumed prefill and a new request each equal the
    layer's plain serving call alone (which the variant tests check against the recurrence)."""
    import gdn2core.layers.ragged as module

    seen = []
    real = module.gdn2_ragged

    def spy(*args, **kw):
        seen.append(tuple(a.ndim for a in args[3:6]))  # w, b, g
        return real(*args, **kw)

    monkeypatch.setattr(module, "gdn2_ragged", spy)
    layer = GDN2Layer(D, H, DK, num_v_heads=HV, variant=variant, backend="jax_ref",
                      rngs=nnx.Rngs(1))  # fmt: skip
    cache = random_cache(layer)
    xs, slots, flags = [tokens(1, 3), tokens(8, 5), tokens(6, 6)], [3, 7, 0], [True, True, False]
    ys, new, _ = run(layer, cache, xs, slots, flags, decodes=(1, 1), jit=False)
    assert seen == [(2, 2, 2 if variant == "gdn" else 3)]
    for i, (x, slot, flag) in enumerate(zip(xs, slots, flags, strict=True)):
        y_ref, c_ref = alone(layer, cache, x, slot, flag)
        assert rel_err(ys[i], y_ref) < F32_TOL, i
        assert_slot(new, slot, c_ref, what=f"request {i}")


@pytest.mark.parametrize("split", [1, 2, 5, 9])
def test_a_request_split_over_two_calls_equals_one_call(layer, split):
    """An 11-token prompt behind a decode, in one call or split after ``split`` tokens (1 and 2
    are fewer than the convolution's 3 cached inputs: the old window shifts)."""
    cache = random_cache(layer, seed=4)
    dec, prompt = tokens(1, 10), tokens(11, 11)
    (_, y_whole), whole, _ = run(layer, cache, [dec, prompt], [4, 2], [True, False])
    (_, y1), mid, _ = run(layer, cache, [dec, prompt[:split]], [4, 2], [True, False])
    (y2,), end, _ = run(layer, mid, [prompt[split:]], [2], [True])
    assert rel_err(jnp.concatenate([y1, y2]), y_whole) < F32_TOL
    assert rel_err(end.state[2], whole.state[2]) < F32_TOL
    for name in POOLS[:3]:
        assert rel_err(getattr(end, name)[2], getattr(whole, name)[2]) < WINDOW_TOL, name


EVERY, M = 4, 5


def test_resuming_from_a_checkpoint_slot_reproduces_the_uninterrupted_run(layer):
    """A 21-token prompt (behind a 3-token neighbour) in two calls: 6 tokens storing the
    checkpoint at 4, then 15 from position 6 storing those at 8, 12, 16 and 20. Each checkpoint
    slot, resumed with the rest of the prompt, gives the uninterrupted outputs and final slot."""
    cache = random_cache(layer, seed=5)
    other, prompt = tokens(3, 12), tokens(21, 13)
    kw = dict(every=EVERY)
    ck1 = [[-1] * M, [13, -1, -1, -1, -1]]
    (_, y1), c1, _ = run(layer, cache, [other, prompt[:6]], [8, 1], [True, False], ctx=[5, 0],
                         ckpt=ck1, **kw)  # fmt: skip
    ck2 = [[14, 15, 16, 17, -1]]
    (y2,), c2, _ = run(layer, c1, [prompt[6:]], [1], [True], ctx=[6], ckpt=ck2, **kw)
    y_full = jnp.concatenate([y1, y2])
    assert_untouched(c2, cache, named={8, 1, 13, 14, 15, 16, 17})
    for pos, slot in zip((4, 8, 12, 16, 20), (13, 14, 15, 16, 17), strict=True):
        (y,), resumed, _ = run(layer, c2, [prompt[pos:]], [slot], [True], ctx=[pos],
                               ckpt=[[-1] * M], **kw)  # fmt: skip
        assert rel_err(y, y_full[pos:]) < F32_TOL, pos
        assert rel_err(resumed.state[slot], c2.state[1]) < F32_TOL, pos
        for name in POOLS[:3]:
            got, want = getattr(resumed, name)[slot], getattr(c2, name)[1]
            assert rel_err(got, want) < WINDOW_TOL, (pos, name)


@pytest.mark.parametrize("decodes", [(0, 1), (2, 4)], ids=["packed", "decode-op"])
def test_rolling_back_to_a_draft_slot_reproduces_the_accepted_prefix(layer, decodes):
    """A 4-token verification step stores the slot after each token; resuming from draft ``j``
    with the tokens after it gives the uninterrupted outputs. A 2-token neighbour stores only
    its first two drafts. Both requests on the packed forward, or as the step's two decodes
    (``num_decodes=2, decode_len=4``: the decode op)."""
    cache = random_cache(layer, seed=6)
    verify, more, other = tokens(4, 14), tokens(3, 15), tokens(2, 16)
    drafts = [[10, 11, 12, 13], [14, 15, 16, 17]]
    (y_v, _), c1, _ = run(
        layer, cache, [verify, other], [2, 3], [True, True], drafts=drafts, decodes=decodes
    )
    (y_m,), c2, _ = run(layer, c1, [more], [2], [True])
    y_full = jnp.concatenate([y_v, y_m])
    assert_untouched(c1, cache, named={2, 3, 10, 11, 12, 13, 14, 15})
    rest = jnp.concatenate([verify, more])
    for j, slot in enumerate(drafts[0]):
        (y,), resumed, _ = run(layer, c1, [rest[j + 1 :]], [slot], [True])
        assert rel_err(y, y_full[j + 1 :]) < F32_TOL, j
        assert rel_err(resumed.state[slot], c2.state[2]) < F32_TOL, j
        for name in POOLS[:3]:
            assert rel_err(getattr(resumed, name)[slot], getattr(c2, name)[2]) < WINDOW_TOL


def replace_slot(cache, slot, seed):
    keys = iter(jax.random.split(jax.random.key(seed), 4))
    return jax.tree.map(lambda a: a.at[slot].set(jax.random.normal(next(keys), a.shape[1:])), cache)


def test_no_leak_across_request_boundaries(layer):
    """Other tokens and another window in the request before: the next request's outputs and
    slot are bit for bit the same (its convolution taps never reach them)."""
    cache = random_cache(layer, seed=7)
    first, second = tokens(5, 17), tokens(6, 18)
    (_, y), new, _ = run(layer, cache, [first, second], [0, 1], [True, True])
    changed = replace_slot(cache, 0, seed=19)
    (_, y2), new2, _ = run(layer, changed, [tokens(5, 20), second], [0, 1], [True, True])
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))
    for name in POOLS:
        np.testing.assert_array_equal(getattr(new2, name)[1], getattr(new, name)[1], name)


def test_jitted_with_traced_metadata_equals_eager(layer):
    """One compile serves other lengths, slots and flags (the metadata is traced), and the
    jitted call equals the eager one."""
    cache = random_cache(layer, seed=8)
    xs, slots, flags = [tokens(1, 21), tokens(8, 22), tokens(3, 23)], [5, 9, 2], [True, False, True]
    ys, new, _ = run(layer, cache, xs, slots, flags)
    before = TRACES[0]
    ys_e, new_e, _ = run(layer, cache, xs, slots, flags, jit=False)
    TRACES[0] = before  # the eager call traces nothing, but counts
    for a, b in zip(ys, ys_e, strict=True):
        assert rel_err(a, b) < F32_TOL
    for name in POOLS:
        assert rel_err(getattr(new, name), getattr(new_e, name)) < F32_TOL, name
    other = [tokens(3, 24), tokens(2, 25), tokens(10, 26), tokens(1, 27)]
    ys2, _, _ = run(layer, cache, other, [7, 6, 5, 4], [False, True, True, False])
    assert TRACES[0] == before, "new metadata values retraced the call"
    assert [y.shape[0] for y in ys2] == [3, 2, 10, 1]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(x=jnp.zeros((1, 4, D))), r"x: expected shape \(T, d_model\) = \(T, 32\)"),
        (dict(cache="plain"), r"cache: expected a GDN2RaggedCache .* got GDN2Cache"),
        (dict(state=jnp.zeros((P, HV, DK, 3))), r"cache.state: expected shape \(P, HV, dk, dv\)"),
        (dict(conv_k=jnp.zeros((P - 1, 3, H * DK))), r"cache.conv_k: expected shape \(24, 3, 16\)"),
        (dict(conv_v=None), r"cache.conv_v: expected shape \(24, 3, 32\) .* got None"),
        (dict(state=jnp.zeros((P, HV, DK, DK), jnp.int32)), r"cache.state: expected dtype"),
        (dict(state_indices=[0]), r"state_indices: expected shape \(N,\) = \(2,\)"),
        (dict(state_indices=[0, P]), r"state_indices: expected slots in \[0, P\) = \[0, 24\)"),
        (dict(checkpoint_every=4), r"context_lens: expected an array with checkpoint_every"),
    ],
)
def test_bad_inputs_name_the_argument(layer, change, match):
    x, cache = tokens(5, 0), layer.init_ragged_cache(P)
    x = change.pop("x", x)
    if change.pop("cache", None):
        cache = layer.init_cache(2)
    pools = {k: change.pop(k) for k in list(change) if k in POOLS}
    if pools:
        cache = dataclasses.replace(cache, **pools)
    meta = {"cu_seqlens": [0, 2, 5], "state_indices": [0, 1], **change}
    with pytest.raises((ValueError, TypeError), match=match):
        layer.ragged(x, cache, **meta)


def test_init_ragged_cache(layer):
    cache = layer.init_ragged_cache(5, state_dtype=jnp.bfloat16)
    assert cache.state.shape == (5, HV, DK, DK) and cache.state.dtype == jnp.bfloat16
    assert cache.conv_q.shape == (5, 3, H * DK) and cache.conv_v.shape == (5, 3, HV * DK)
    with pytest.raises(ValueError, match=r"slots: expected a positive integer, got 0"):
        layer.init_ragged_cache(0)
    with pytest.raises(TypeError, match=r"state_dtype: expected float32 or bfloat16, got float16"):
        layer.init_ragged_cache(2, state_dtype=jnp.float16)
    bare = GDN2Layer(D, H, DK, conv_size=0, backend="jax_ref", rngs=nnx.Rngs(0))
    assert bare.init_ragged_cache(2).conv_q is None
    wrong = dataclasses.replace(bare.init_ragged_cache(2), conv_q=jnp.zeros((2, 3, H * DK)))
    with pytest.raises(ValueError, match=r"cache.conv_q: expected None \(no short convolutions\)"):
        bare.ragged(tokens(2, 0), wrong, cu_seqlens=[0, 2], state_indices=[0])
