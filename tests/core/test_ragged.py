"""gdn2_ragged: one call over a flat batch of requests against a state pool.

Every result is checked against an independent ground truth, the chunked op's token-serial
reference run request by request (``gdn2_token_serial_reference`` with the slot as ``h0``), or
against the same requests run uninterrupted. Tolerances: float32 1e-5 relative (the chunked
backends' float32 error against the token-serial loop is ~1e-6 at these sizes; the two-pass
composition adds one f32 product of the pieces' maps), bfloat16 2e-2 (the inputs' rounding).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_conformance import rel_err
from gdn2core import gdn2_ragged, gdn2_ragged_reference, gdn2_token_serial_reference

H, HV, DK, DV, P = 2, 4, 8, 6, 24
F32_TOL, BF16_TOL = 1e-5, 2e-2


def tokens(t, seed=0, dtype=jnp.float32, gate_heads=H):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (t, H, DK))
    k = jax.random.normal(ks[1], (t, H, DK)) * DK**-0.5
    v = jax.random.normal(ks[2], (t, HV, DV))
    w = jax.nn.sigmoid(jax.random.normal(ks[3], (t, HV, DV)))
    b = jax.nn.sigmoid(jax.random.normal(ks[4], (t, gate_heads, DK)))
    g = -0.5 * jax.nn.softplus(jax.random.normal(ks[5], (t, gate_heads, DK)))
    return tuple(x.astype(dtype) for x in (q, k, v, w, b, g))


def pool_of(seed=7, dtype=jnp.float32):
    return (0.3 * jax.random.normal(jax.random.PRNGKey(seed), (P, HV, DK, DV))).astype(dtype)


#: A step of an engine: a decode, an empty request, a prefill, a new request reusing a slot, a
#: padded request, a 3-token draft verification, and 3 padding tokens at the end.
LENS = [1, 0, 13, 7, 2, 3]
SLOTS = [3, 5, 7, 0, -1, 11]
FLAGS = [True, True, True, False, True, True]
T_MIX = sum(LENS) + 3


def cu_of(lens):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)


def per_request(x, pool, lens, slots, flags, **features):
    """The ground truth: each request alone through the token-serial reference."""
    o = np.zeros((x[0].shape[0], HV, DV), np.float32)
    new = np.array(pool, np.float32)
    start = 0
    for n, s, f in zip(lens, slots, flags, strict=True):
        if n and s >= 0:
            h0 = (pool[s] if f else jnp.zeros_like(pool[s])).astype(jnp.float32)[None]
            oi, hf = gdn2_token_serial_reference(
                *(a[None, start : start + n] for a in x), h0=h0, **features
            )
            o[start : start + n] = np.asarray(oi[0], np.float32)
            new[s] = np.asarray(hf[0])
        elif s >= 0 and not f:
            new[s] = 0.0
        start += n
    return o, new


@pytest.mark.parametrize("backend", ["jax_ref", "scan_baseline"])
def test_mixed_step_equals_each_request_alone(backend):
    x, pool = tokens(T_MIX), pool_of()
    o, new = gdn2_ragged(
        *x, pool, cu_seqlens=cu_of(LENS), state_indices=jnp.asarray(SLOTS),
        has_initial_state=jnp.asarray(FLAGS), backend=backend,
    )  # fmt: skip
    o_ref, new_ref = per_request(x, pool, LENS, SLOTS, FLAGS)
    assert rel_err(o, o_ref) < F32_TOL
    assert rel_err(new, new_ref) < F32_TOL
    assert np.all(np.asarray(o[sum(LENS) :]) == 0)  # padding tokens
    named = {s for s in SLOTS if s >= 0}
    untouched = [s for s in range(P) if s not in named]
    np.testing.assert_array_equal(np.asarray(new)[untouched], np.asarray(pool)[untouched])


def test_reference_equals_each_request_alone():
    x, pool = tokens(T_MIX, seed=1), pool_of(seed=2)
    kw = dict(cu_seqlens=cu_of(LENS), state_indices=SLOTS, has_initial_state=FLAGS)
    o, new = gdn2_ragged_reference(*x, pool, **kw)
    o_ref, new_ref = per_request(x, pool, LENS, SLOTS, FLAGS)
    assert rel_err(o, o_ref) < 1e-6  # the same token step, another order of the scans
    assert rel_err(new, new_ref) < 1e-6


FEATURES = dict(
    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_bw_sigmoid_in_kernel=True
)


def test_grouped_heads_and_fused_gates():
    x = tokens(T_MIX, seed=4, gate_heads=HV)
    a_log = jnp.linspace(-1.0, 0.5, HV)
    dt_bias = 0.1 * jnp.ones((HV, DK))
    pool = pool_of(seed=5)
    kw = dict(cu_seqlens=cu_of(LENS), state_indices=jnp.asarray(SLOTS),
              has_initial_state=jnp.asarray(FLAGS), A_log=a_log, dt_bias=dt_bias, **FEATURES)  # fmt: skip
    o, new = gdn2_ragged(*x, pool, backend="jax_ref", **kw)
    feats = dict(A_log=a_log, dt_bias=dt_bias, **FEATURES)
    o_ref, new_ref = per_request(x, pool, LENS, SLOTS, FLAGS, **feats)
    assert rel_err(o, o_ref) < F32_TOL
    assert rel_err(new, new_ref) < F32_TOL


@pytest.mark.parametrize("gate_heads", [H, HV], ids=["key-head-gates", "value-head-gates"])
def test_scalar_gates(gate_heads):
    """KDA's and GDN's scalar gates, w ``(T, HV)``, b and g ``(T, Hg)`` (one value per head and
    token), with leading decodes (the decode op) and a prefill after them: against each request
    alone through the token-serial reference on the same values written out on every channel."""
    x = tokens(T_MIX, seed=9, gate_heads=gate_heads)
    scalar = tuple(a[..., 0] for a in x[3:])  # w, b, g: [T, heads]
    full = tuple(
        jnp.broadcast_to(a[..., None], y.shape) for a, y in zip(scalar, x[3:], strict=True)
    )
    pool = pool_of(seed=10)
    lens, slots = [1, 1, 13, 7, 2, 3], [3, 5, 7, 0, -1, 11]
    flags = [True, True, True, False, True, True]
    kw = dict(cu_seqlens=cu_of(lens), state_indices=jnp.asarray(slots),
              has_initial_state=jnp.asarray(flags), num_decodes=2, backend="jax_ref")  # fmt: skip
    o_ref, new_ref = per_request((*x[:3], *full), pool, lens, slots, flags)
    for gates in (scalar[:2] + full[2:], scalar):  # KDA's (w, b), GDN's (w, b, g)
        o, new = gdn2_ragged(*x[:3], *gates, pool, **kw)
        assert rel_err(o, o_ref) < F32_TOL
        assert rel_err(new, new_ref) < F32_TOL
    kw.pop("num_decodes"), kw.pop("backend")
    o, new = gdn2_ragged_reference(*x[:3], *scalar, pool, **kw)
    assert rel_err(o, o_ref) < 1e-6  # the same token step (test_reference_equals_...)
    assert rel_err(new, new_ref) < 1e-6


def test_bfloat16_pool_and_inputs():
    x, pool = tokens(T_MIX, seed=6, dtype=jnp.bfloat16), pool_of(seed=8, dtype=jnp.bfloat16)
    kw = dict(cu_seqlens=cu_of(LENS), state_indices=jnp.asarray(SLOTS),
              has_initial_state=jnp.asarray(FLAGS))  # fmt: skip
    o, new = gdn2_ragged(*x, pool, backend="jax_ref", **kw)
    assert o.dtype == jnp.bfloat16 and new.dtype == jnp.bfloat16
    o_ref, new_ref = per_request(x, pool, LENS, SLOTS, FLAGS)
    assert rel_err(o, o_ref) < BF16_TOL
    assert rel_err(new, new_ref) < BF16_TOL


@pytest.mark.parametrize("split", [1, 5, 9, 12])
def test_a_request_split_across_two_calls_equals_one_call(split):
    n = 13
    x, pool = tokens(n + 2, seed=9), pool_of(seed=10)
    whole_o, whole = gdn2_ragged(
        *x, pool, cu_seqlens=[0, 1, n + 1], state_indices=[4, 2], backend="jax_ref"
    )
    # Call 1: the decode and the first `split` tokens of the prompt; call 2: the rest.
    first = tuple(a[: 1 + split] for a in x)
    o1, mid = gdn2_ragged(*first, pool, cu_seqlens=[0, 1, 1 + split], state_indices=[4, 2],
                          backend="jax_ref")  # fmt: skip
    rest = tuple(a[1 + split : n + 1] for a in x)
    o2, end = gdn2_ragged(
        *rest, mid, cu_seqlens=[0, n - split], state_indices=[2], backend="jax_ref"
    )
    assert rel_err(jnp.concatenate([o1, o2]), whole_o[: n + 1]) < F32_TOL
    assert rel_err(end, whole) < F32_TOL


EVERY = 4


def test_checkpoints_restart_the_uninterrupted_run():
    """A 15-token prompt resumed at position 6: checkpoints at 8, 12, 16 and 20 (the last not
    stored); each restart reproduces the rest of the run."""
    n, ctx = 15, 6
    x, pool = tokens(n, seed=11), pool_of(seed=12)
    ck = jnp.asarray([[13, 14, 15, -1]])
    o, new = gdn2_ragged(
        *x, pool, cu_seqlens=[0, n], state_indices=[1], checkpoint_every=EVERY,
        context_lens=[ctx], checkpoint_slots=ck, backend="jax_ref",
    )  # fmt: skip
    o_ref, new_ref = per_request(x, pool, [n], [1], [True])
    assert rel_err(o, o_ref) < F32_TOL and rel_err(new[1], new_ref[1]) < F32_TOL
    for m, slot in enumerate([13, 14, 15]):
        done = (ctx // EVERY + 1 + m) * EVERY - ctx  # tokens of this call before checkpoint m
        o_rest, resumed = gdn2_ragged(
            *(a[done:] for a in x), new, cu_seqlens=[0, n - done], state_indices=[slot],
            backend="jax_ref",
        )  # fmt: skip
        assert rel_err(o_rest, o_ref[done:]) < F32_TOL, m
        assert rel_err(resumed[slot], new_ref[1]) < F32_TOL, m
    untouched = [s for s in range(P) if s not in (1, 13, 14, 15)]
    np.testing.assert_array_equal(np.asarray(new)[untouched], np.asarray(pool)[untouched])


def test_draft_states_equal_per_token_states():
    lens = [4, 2, 6]
    x, pool = tokens(sum(lens), seed=13), pool_of(seed=14)
    drafts = jnp.asarray([[10, 11, 12, 13], [14, -1, 15, 16], [17, 18, -1, -1]])
    _, new = gdn2_ragged(
        *x, pool, cu_seqlens=cu_of(lens), state_indices=[0, 1, 2], draft_slots=drafts,
        backend="jax_ref",
    )  # fmt: skip
    start = 0
    for i, n in enumerate(lens):
        for j in range(min(n, 4)):
            slot = int(drafts[i, j])
            if slot < 0:
                continue
            _, h = gdn2_token_serial_reference(
                *(a[None, start : start + j + 1] for a in x), h0=pool[i][None]
            )
            assert rel_err(new[slot], h[0]) < F32_TOL, (i, j)
        start += n
    for slot in (15, 16):  # request 1 has 2 tokens: its drafts 2 and 3 are not stored
        np.testing.assert_array_equal(np.asarray(new[slot]), np.asarray(pool[slot]))


def test_checkpoints_and_drafts_match_the_reference():
    lens = [3, 9, 1]
    x, pool = tokens(sum(lens) + 2, seed=15), pool_of(seed=16)
    kw = dict(
        cu_seqlens=cu_of(lens),
        state_indices=[2, 3, 4],
        has_initial_state=[True, False, True],
        checkpoint_every=EVERY,
        context_lens=[2, 0, 7],
        checkpoint_slots=[[5, -1, -1], [6, 7, -1], [8, -1, -1]],
        draft_slots=[[9, 10], [11, 12], [13, 14]],
    )
    o, new = gdn2_ragged(*x, pool, backend="jax_ref", **kw)
    o_ref, new_ref = gdn2_ragged_reference(*x, pool, **kw)
    assert rel_err(o, o_ref) < F32_TOL
    assert rel_err(new, new_ref) < F32_TOL
    np.testing.assert_array_equal(np.asarray(new[14]), np.asarray(pool[14]))  # 1 token only


def test_jitted_with_traced_metadata_and_a_donated_pool():
    x, pool = tokens(T_MIX, seed=17), pool_of(seed=18)
    kw = dict(cu_seqlens=cu_of(LENS), state_indices=jnp.asarray(SLOTS),
              has_initial_state=jnp.asarray(FLAGS))  # fmt: skip
    o_eager, new_eager = gdn2_ragged(*x, pool, backend="jax_ref", **kw)

    def step(x, pool, cu, idx, flags):
        return gdn2_ragged(*x, pool, cu_seqlens=cu, state_indices=idx, has_initial_state=flags,
                           backend="jax_ref")  # fmt: skip

    jitted = jax.jit(step, donate_argnums=(1,))
    args = (x, pool, kw["cu_seqlens"], kw["state_indices"], kw["has_initial_state"])
    compiled = jitted.lower(*args).compile()
    # The pool is updated in place: output 1 aliases the donated input 6, and no instruction of
    # the compiled program copies a pool-shaped array.
    text = compiled.as_text()
    assert "input_output_alias={ {1}: (6," in text
    pool_shape = f"f32[{P},{HV},{DK},{DV}]"
    assert not re.search(re.escape(pool_shape) + r"\{[^}]*\} copy\(", text)
    o, new = jitted(x, jnp.array(pool), *args[2:])
    assert rel_err(o, o_eager) < F32_TOL and rel_err(new, new_eager) < F32_TOL
    # Other lengths, the same compile (traced metadata).
    o2, _ = jitted(x, jnp.array(pool), cu_of([2, 0, 12, 8, 1, 3]), *args[3:])
    assert o2.shape == o.shape


def test_traced_invalid_slots_write_nothing_outside_their_own():
    x, pool = tokens(8, seed=19), pool_of(seed=20)
    run = jax.jit(
        lambda idx, ck: gdn2_ragged(
            *x,
            pool,
            cu_seqlens=jnp.asarray([0, 3, 6, 8]),
            state_indices=idx,
            checkpoint_every=2,
            context_lens=jnp.zeros((3,), jnp.int32),
            checkpoint_slots=ck,
            backend="jax_ref",
        )
    )
    # Request 0: out of range; requests 1 and 2 name slot 6 twice; a checkpoint names slot 9 of
    # no request: stored; another names P.
    ck = jnp.asarray([[9, 10], [P, -1], [-1, -1]])
    o, new = run(jnp.asarray([P, 6, 6]), ck)
    assert np.all(np.isnan(np.asarray(o[:8])))  # every request skipped
    np.testing.assert_array_equal(np.asarray(new), np.asarray(pool))  # nothing stored
    o, new = run(jnp.asarray([2, 6, 9]), jnp.asarray([[9, 10], [11, -1], [-1, -1]]))
    # slot 9: request 2's state and request 0's checkpoint: both dropped.
    assert np.all(np.isnan(np.asarray(o[6:8]))) and np.all(np.isfinite(np.asarray(o[:6])))
    np.testing.assert_array_equal(np.asarray(new[9]), np.asarray(pool[9]))
    # Request 1's checkpoint at position 2 is stored; request 0 meets no second checkpoint.
    assert not np.array_equal(np.asarray(new[11]), np.asarray(pool[11]))
    np.testing.assert_array_equal(np.asarray(new[10]), np.asarray(pool[10]))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(q=jnp.zeros((4, 2, 8, 1))), r"q: expected rank 3 \(T, H, dk\)"),
        (dict(w=jnp.zeros((8,))), r"w: expected rank 3 \(T, HV, dv\) or rank 2 \(T, HV\)"),
        (dict(w=jnp.zeros((8, 3))), r"w: expected shape \(T, HV\) = \(8, 4\), got \(8, 3\)"),
        (dict(b=jnp.zeros((8, 3))), r"b: expected H=2 or HV=4 heads"),
        (dict(g=jnp.zeros((7, 2))), r"g: expected shape \(T, H or HV\) = \(8, 2\)"),
        (dict(pool=jnp.zeros((P, HV, DK, 5))), r"pool: expected shape \(P, HV, dk, dv\)"),
        (
            dict(pool=jnp.zeros((P, HV, DK, DV), jnp.int32)),
            r"pool: expected dtype float32 or bfloat16",
        ),
        (dict(cu_seqlens=[1, 4, 6]), r"cu_seqlens: expected cu_seqlens\[0\] = 0, got 1"),
        (dict(cu_seqlens=[0, 5, 3]), r"cu_seqlens\[1\] = 5 > cu_seqlens\[2\] = 3"),
        (dict(cu_seqlens=[0, 4, 9]), r"cu_seqlens\[N\] <= T = 8"),
        (dict(state_indices=[0]), r"state_indices: expected shape \(N,\) = \(2,\)"),
        (dict(state_indices=[0, P]), r"state_indices: expected slots in \[0, P\) = \[0, 24\)"),
        (dict(state_indices=[3, 3]), r"slot 3 at state_indices\[1\] and at state_indices\[0\]"),
        (dict(has_initial_state=[1, 0]), r"has_initial_state: expected a bool array"),
        (dict(draft_slots=[[4], [0]]), r"slot 0 at draft_slots\[1, 0\] and at state_indices\[0\]"),
        (dict(checkpoint_every=4), r"context_lens: expected an array with checkpoint_every"),
        (dict(context_lens=[0, 0]), r"context_lens: given without checkpoint_every"),
        (
            dict(checkpoint_every=2, context_lens=[0, 0], checkpoint_slots=[[5], [6]]),
            r"request 1 meets 2 checkpoint positions .* expected at most M = 1",
        ),
        (
            dict(checkpoint_every=0, context_lens=[0, 0], checkpoint_slots=[[5], [6]]),
            r"checkpoint_every: expected a positive int",
        ),
        (
            dict(segment_ids=jnp.zeros((1, 8), jnp.int32)),
            r"unexpected keyword argument 'segment_ids'",
        ),
        (dict(head_axes="heads"), r"head_axes: given but no mesh"),
    ],
)
def test_bad_inputs_name_the_argument(change, match):
    x = dict(zip("qkvwbg", tokens(8), strict=True))
    kw = dict(pool=pool_of(), cu_seqlens=[0, 3, 7], state_indices=[0, 1], backend="jax_ref")
    x_keys = {key: change.pop(key) for key in list(change) if key in x}
    x.update(x_keys)
    kw.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        gdn2_ragged(*x.values(), kw.pop("pool"), **kw)


def test_no_tokens_at_all():
    x, pool = tokens(0), pool_of()
    o, new = gdn2_ragged(*x, pool, cu_seqlens=[0, 0], state_indices=[3],
                         has_initial_state=[False], backend="jax_ref")  # fmt: skip
    assert o.shape == (0, HV, DV)
    np.testing.assert_array_equal(np.asarray(new[3]), 0.0)  # a new request, no token: zeros


def test_leading_decodes_on_the_decode_op_equal_the_packed_path():
    """Decodes first (num_decodes): 1-token and 3-token decodes, one padded and one new, then a
    prefill; with checkpoints and drafts among the decodes too."""
    lens = [1, 3, 1, 2, 9]
    x, pool = tokens(sum(lens) + 2, seed=21), pool_of(seed=22)
    kw = dict(
        cu_seqlens=cu_of(lens), state_indices=[4, 6, -1, 8, 10],
        has_initial_state=[True, True, True, False, True],
        checkpoint_every=EVERY, context_lens=[3, 6, 0, 0, 2],
        checkpoint_slots=[[12, -1, -1], [13, -1, -1], [-1, -1, -1], [-1, -1, -1], [14, 15, 16]],
        draft_slots=[[17, -1, -1], [18, 19, 20], [-1, -1, -1], [21, 22, 23], [-1, -1, -1]],
    )  # fmt: skip
    o_ref, new_ref = gdn2_ragged_reference(*x, pool, **kw)
    o, new = gdn2_ragged(*x, pool, num_decodes=4, decode_len=3, backend="jax_ref", **kw)
    assert rel_err(o, o_ref) < F32_TOL
    assert rel_err(new, new_ref) < F32_TOL
    np.testing.assert_array_equal(np.asarray(new[23]), np.asarray(pool[23]))  # request 3: 2 tokens
    o_all, new_all = gdn2_ragged(*x, pool, num_decodes=5, decode_len=9, backend="jax_ref", **kw)
    assert rel_err(o_all, o_ref) < F32_TOL and rel_err(new_all, new_ref) < F32_TOL
    with pytest.raises(ValueError, match=r"request 1 is one of the num_decodes = 4 decodes"):
        gdn2_ragged(*x, pool, num_decodes=4, decode_len=2, backend="jax_ref", **kw)
    with pytest.raises(ValueError, match=r"num_decodes: expected at most N = 5"):
        gdn2_ragged(*x, pool, num_decodes=6, backend="jax_ref", **kw)


def test_one_token_decodes_checkpoint_their_final_state_and_fresh_ones_start_from_zeros():
    """Decodes of one token, no drafts: a checkpoint that falls on a decode's token is its final
    state, copied from its slot after the decode op; a new decode (has_initial_state false) starts
    from zeros, not from what its slot held. Ground truth: each request alone."""
    lens, slots, flags = [1, 1, 1, 1, 6], [2, 5, 9, 13, 15], [True, False, True, True, True]
    x, pool = tokens(sum(lens), seed=31), pool_of(seed=32)
    ckpt = [[18, -1], [19, -1], [20, -1], [-1, -1], [21, 22]]
    kw = dict(
        cu_seqlens=cu_of(lens), state_indices=slots, has_initial_state=flags,
        checkpoint_every=EVERY, context_lens=[EVERY - 1, EVERY - 1, EVERY, 2 * EVERY - 1, 0],
        checkpoint_slots=ckpt,
    )  # fmt: skip
    o, new = gdn2_ragged(*x, pool, num_decodes=4, backend="jax_ref", **kw)
    o_ref, new_ref = per_request(x, pool, lens, slots, flags)
    assert rel_err(o, o_ref) < F32_TOL
    assert rel_err(new[np.array(slots)], new_ref[np.array(slots)]) < F32_TOL
    # Requests 0 and 1 reach position EVERY: their checkpoint is their final state.
    np.testing.assert_array_equal(np.asarray(new[18]), np.asarray(new[2]))
    np.testing.assert_array_equal(np.asarray(new[19]), np.asarray(new[5]))
    # Request 2 ends at EVERY + 1 (no checkpoint), request 3's checkpoint slot is -1, request 4
    # reaches EVERY (slot 21) but not 2 EVERY (slot 22): the rest of the pool is bit-identical.
    keep = [i for i in range(P) if i not in (*slots, 18, 19, 21)]
    np.testing.assert_array_equal(np.asarray(new)[keep], np.asarray(pool)[keep])
    _, new_all = gdn2_ragged_reference(*x, pool, **kw)
    assert rel_err(new, new_all) < F32_TOL


def test_backend_without_continued_sequences_takes_the_three_pass_path():
    """scan_baseline does not declare ``Capabilities.continued``: its checkpoints and drafts come
    from the pieces' maps (two more forwards and a chain), and equal the reference."""
    from gdn2core import get_backend

    assert not get_backend("scan_baseline").capabilities.continued
    assert get_backend("jax_ref").capabilities.continued
    lens = [3, 9, 1]
    x, pool = tokens(sum(lens) + 2, seed=23), pool_of(seed=24)
    kw = dict(
        cu_seqlens=cu_of(lens), state_indices=[2, 3, 4], has_initial_state=[True, False, True],
        checkpoint_every=EVERY, context_lens=[2, 0, 7],
        checkpoint_slots=[[5, -1, -1], [6, 7, -1], [8, -1, -1]],
        draft_slots=[[9, 10], [11, 12], [13, 14]],
    )  # fmt: skip
    o_ref, new_ref = gdn2_ragged_reference(*x, pool, **kw)
    o, new = gdn2_ragged(*x, pool, backend="scan_baseline", **kw)
    assert rel_err(o, o_ref) < F32_TOL
    assert rel_err(new, new_ref) < F32_TOL
