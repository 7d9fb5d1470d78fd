"""The pooled forward reading a ragged call's flat tokens (token-major heads, H a multiple of 8;
flat_tokens.py): each chunk is an element window of the flat arrays, clamped into them near their
ends (its rows rolled), the rows of other requests and of the engine's padding zeroed. Interpret
mode against the token-serial ragged reference (the deviceless v5e compile of the same path is
the ``token-major`` case of test_ragged_pallas.py's compile test).

Tolerance: 5e-5 relative in float32, as tests/pallas_tpu/test_ragged_pallas.py (the chunked
forward's documented error is 1.7e-5; a row read from the wrong token, or a neighbour's row
left in, gives errors of order 1, and a NaN row of the padding left in gives NaN).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_conformance import rel_err
from gdn2_pallas_tpu.config import PallasTpuConfig
from gdn2core import KernelConfig, gdn2_ragged, gdn2_ragged_reference

from .helpers import FLAT, FLAT_PADDING, FLAT_T, ragged_tokens

H, HV, DK, DV, P = 8, 16, 64, 64, 12  # H = 8: the token-major layout, whose tokens are read flat
TOL = 5e-5
INTERPRET = KernelConfig(bt=16, interpret=True)

#: Slots the step writes: finals 2, 5, 9, 0; checkpoints 1 (the decode's), 4, 6.
FLAT_WRITTEN = (0, 1, 2, 4, 5, 6, 9)


def _tokens(t, seed, padding_from=None):
    return ragged_tokens(t, seed, H, HV, DK, DV, P, padding_from)


def _row_gathers(t: int, fn, *args) -> int:
    """Float gathers of a token row (``t`` tokens or more) in the program: the inputs' moves
    into the padded row and the output's move back (the decodes' own gathers are shorter)."""
    text = str(jax.make_jaxpr(fn)(*args))
    rows = re.findall(r":f32\[1,(\d+),\d+,\d+\] = gather", text)
    return sum(int(r) >= t for r in rows)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused-gates-races"])
def test_pooled_forward_reads_the_flat_tokens(fused):
    """The mixed step on the flat tokens; with ``fused``: the gate, L2 norm and sigmoids in the
    kernel (the garbage rows activated, then zeroed), two simulated cores with race detection and
    a random order of the head groups."""
    x, pool = _tokens(FLAT_T, seed=1, padding_from=FLAT_PADDING)
    feats, config = {}, INTERPRET
    if fused:
        ks = jax.random.split(jax.random.PRNGKey(5), 3)
        q, k, v, w, _, _ = x
        b = jax.random.normal(ks[0], (FLAT_T, H, DK)).at[FLAT_PADDING:].set(jnp.nan)
        g = jax.random.normal(ks[1], (FLAT_T, H, DK)).at[FLAT_PADDING:].set(jnp.nan)
        x = (q, k, v, w, b, g)
        feats = dict(
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_bw_sigmoid_in_kernel=True,
            A_log=jnp.log(jnp.linspace(0.5, 2.0, H)),
            dt_bias=0.1 * jax.random.normal(ks[2], (H, DK)),
        )  # fmt: skip
        config = PallasTpuConfig(
            bt=16, interpret=True, interpret_detect_races=True, interpret_cores=2,
            interpret_seed=3,
        )  # fmt: skip

    def step(pool, *x):
        return gdn2_ragged(
            *x, pool, num_decodes=1, backend="pallas_tpu", config=config, **FLAT, **feats
        )

    # no gather of a token row: the kernel reads the inputs and writes o at the flat tokens
    assert _row_gathers(FLAT_T, step, pool, *x) == 0
    o_ref, new_ref = gdn2_ragged_reference(*x, pool, **FLAT, **feats)
    o, new = step(pool, *x)
    assert rel_err(o[:FLAT_PADDING], o_ref[:FLAT_PADDING]) < TOL
    np.testing.assert_array_equal(np.asarray(o[FLAT_PADDING:]), 0.0)  # padding: zero, not NaN
    assert rel_err(new, new_ref) < TOL
    untouched = [s for s in range(P) if s not in FLAT_WRITTEN]
    np.testing.assert_array_equal(np.asarray(new)[untouched], np.asarray(pool)[untouched])


def test_pooled_forward_reads_grouped_keys(monkeypatch):
    """b, g on the value heads (fla's and Qwen3-Next's layout), H = 16 key heads, HV = 32: the
    kernel reads q and k with their own 16 heads (the four head groups of 8 value heads each
    read their half of one of the two 8-head key windows, repeated in VMEM; blocks.py, section
    Grouped keys), never repeated to 32 in XLA; two simulated cores with race detection and a
    random order of the head groups (a group reading another's key heads gives errors of order
    1)."""
    h, hv = 16, 32
    x, pool = ragged_tokens(FLAT_T, 4, h, hv, DK, DV, P, FLAT_PADDING)
    q, k, v, w, _, _ = x
    ks = jax.random.split(jax.random.PRNGKey(6), 2)
    b = jax.nn.sigmoid(jax.random.normal(ks[0], (FLAT_T, hv, DK))).at[FLAT_PADDING:].set(jnp.nan)
    g = -0.3 * jax.nn.softplus(jax.random.normal(ks[1], (FLAT_T, hv, DK)))
    x = (q, k, v, w, b, g.at[FLAT_PADDING:].set(jnp.nan))
    config = PallasTpuConfig(bt=16, interpret=True, interpret_detect_races=True,
                             interpret_cores=2, interpret_seed=5)  # fmt: skip
    import gdn2_pallas_tpu.vjp as vjp

    heads, real = [], vjp.gdn2_pallas_pooled

    def spy(q, k, v, w, b, g, pool, cu, requests, plan, *rest):
        heads.append((q.shape[2], k.shape[2], plan.key_groups))
        o, new = real(q, k, v, w, b, g, pool, cu, requests, plan, *rest)
        assert o.shape == (1, FLAT_T, hv, DV)  # Backend.forward_pooled: (1, T, H, dv)
        return o, new

    monkeypatch.setattr(vjp, "gdn2_pallas_pooled", spy)
    o, new = gdn2_ragged(*x, pool, num_decodes=1, backend="pallas_tpu", config=config, **FLAT)
    assert heads == [(h, h, hv // h)]
    o_ref, new_ref = gdn2_ragged_reference(*x, pool, **FLAT)
    assert rel_err(o[:FLAT_PADDING], o_ref[:FLAT_PADDING]) < TOL
    np.testing.assert_array_equal(np.asarray(o[FLAT_PADDING:]), 0.0)
    assert rel_err(new, new_ref) < TOL


def test_pooled_forward_on_fewer_tokens_than_a_chunk():
    """T = 10 < bt = 16: the flat tokens are padded to one chunk's window; a resumed request at
    context 7 (its window starts before the array) and one at context 20."""
    kw = dict(
        cu_seqlens=[0, 3, 10],
        state_indices=[3, 4],
        context_lens=[7, 20],
        checkpoint_every=16,
        checkpoint_slots=[[1, -1], [2, 6]],
    )
    x, pool = _tokens(10, seed=2)
    o_ref, new_ref = gdn2_ragged_reference(*x, pool, **kw)
    o, new = gdn2_ragged(*x, pool, backend="pallas_tpu", config=INTERPRET, **kw)
    assert rel_err(o, o_ref) < TOL
    assert rel_err(new, new_ref) < TOL


def test_pooled_forward_writes_o_at_the_flat_tokens():
    """o leaves the kernel at the flat tokens, each chunk writing only its request's rows: 18
    one-token decodes first (their rows: two chunks of zeros before the packed requests, then the
    decodes' outputs), a padded request whose NaN tokens must give zeros, and 40 rows of NaN
    padding after the last request (three chunks of zeros, the last one partial). No gather of a
    token row in the program: neither the inputs nor the output."""
    t, pad_from = 90, 50
    cu = [*range(19), 24, 31, 50]  # 18 decodes, a request of 5, a padded one of 7, one of 19
    kw = dict(
        cu_seqlens=cu,
        state_indices=[*range(18, 0, -1), 0, -1, 19],  # 18 ... 1 for the decodes; -1: padded
        has_initial_state=[True] * 18 + [True, False, False],
    )
    x, pool = ragged_tokens(t, 7, H, HV, DK, DV, 20, pad_from)
    x = tuple(a.at[24:31].set(jnp.nan) for a in x)  # the padded request's tokens

    def step(pool, *x):
        return gdn2_ragged(*x, pool, num_decodes=18, backend="pallas_tpu", config=INTERPRET, **kw)

    assert _row_gathers(t, step, pool, *x) == 0
    o_ref, new_ref = gdn2_ragged_reference(*x, pool, **kw)
    o, new = step(pool, *x)
    live = np.r_[0:24, 31:50]
    assert rel_err(o[live], o_ref[live]) < TOL
    np.testing.assert_array_equal(np.asarray(o[24:31]), 0.0)  # the padded request: zero, not NaN
    np.testing.assert_array_equal(np.asarray(o[pad_from:]), 0.0)  # the padding
    assert rel_err(new, new_ref) < TOL


#: bt = 16. "long" (T = 320: 5 chunks a grid step): two decodes, a resumed request of 35 tokens,
#: a new one of 264 (chunks 3 to 19 of the row: steps 1 and 2 whole, the others chunk by chunk),
#: the engine's NaN padding from token 301. "zeros" (T = 256: 8 chunks a step): 16 decodes and a
#: request of 128 tokens (step 0, whole), then
#: a step of zeros only: the chunk of the decodes' tokens 0-15 and seven of the padding's from
#: token 144, each all its rows but not consecutive (not whole: written as one window, its zeros
#: would land on the request's tokens 16-127).
WHOLE_STEPS = {
    "long": (320, 2, dict(cu_seqlens=[0, 1, 2, 37, 301], state_indices=[4, 1, 7, 2],
                          has_initial_state=[True, True, True, False])),
    "zeros": (256, 16, dict(cu_seqlens=[*range(17), 144], state_indices=[*range(16), 16],
                            has_initial_state=[True] * 16 + [False])),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(WHOLE_STEPS))
def test_pooled_forward_writes_whole_steps_at_once(case):
    """Grid steps whose chunks write all their rows to consecutive tokens write o in one DMA per
    value-head window (``FlatOutput._whole``), the others chunk by chunk (:data:`WHOLE_STEPS`).
    A whole-step DMA one token off, or a step taken as whole whose chunks are not consecutive,
    fails by errors of order 1, and a whole step's DMAs never waited by NaN (the interpreter
    leaves their rows unwritten)."""
    t, decodes, kw = WHOLE_STEPS[case]
    pad_from = kw["cu_seqlens"][-1]
    x, pool = ragged_tokens(t, 11, H, HV, DK, DV, 20, pad_from)

    def step(pool, *x):
        return gdn2_ragged(
            *x, pool, num_decodes=decodes, backend="pallas_tpu", config=INTERPRET, **kw
        )

    o_ref, new_ref = gdn2_ragged_reference(*x, pool, **kw)
    o, new = step(pool, *x)
    assert rel_err(o[:pad_from], o_ref[:pad_from]) < TOL
    np.testing.assert_array_equal(np.asarray(o[pad_from:]), 0.0)
    assert rel_err(new, new_ref) < TOL
