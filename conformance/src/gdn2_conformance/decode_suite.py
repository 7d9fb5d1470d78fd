"""The conformance tests of the serving ops: :func:`~gdn2core.gdn2_decode` against the decode
reference (:func:`~gdn2core.gdn2_decode_reference`) and ``gdn2_forward(...,
return_chunk_states=True)`` against the token-serial reference, and ``gdn2_ragged`` on a pooled
forward against the ragged reference. :class:`DecodeTests` is a mixin of
:class:`~gdn2_conformance.ConformanceSuite`; its tests run on targets that claim
``Feature.DECODE`` / ``Feature.CHUNK_STATES`` / ``Feature.POOLED`` (declared by
``Capabilities.decode`` / ``chunk_states`` / ``pooled``).

Tolerances: the kit's table (:mod:`gdn2_conformance.metrics`, quantity ``decode`` for the decode
op against its reference); the slots a call does not name, and the slot written back against the
last token state, are compared bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gdn2_conformance.checks import decode_reference_outputs, reference_outputs_and_grads
from gdn2_conformance.inputs import Case, DecodeCase, DecodeInputs, make_decode_inputs, make_inputs
from gdn2_conformance.metrics import assert_close
from gdn2_conformance.target import DECODE_CASES, Feature, Target, capability
from gdn2core.ops.decode.api import gdn2_decode
from gdn2core.ops.decode.reference import gdn2_decode_reference
from gdn2core.ops.decode.spec import expand_heads
from gdn2core.ops.forward.api import gdn2_forward
from gdn2core.ops.ragged.api import gdn2_ragged
from gdn2core.ops.ragged.reference import gdn2_ragged_reference


def _decode(target: Target, x: DecodeInputs, *, jit: bool = False, donate: bool = False):
    """``(o, new_state, token_states)`` of the target's decode on ``x`` (eager, or under
    ``jax.jit``, optionally with the pool donated)."""

    def run(q, k, v, w, b, g, state, idx):
        return gdn2_decode(
            q, k, v, w, b, g, state, state_indices=idx, return_token_states=True,
            config=target.config, backend=target.backend,
        )  # fmt: skip

    args = (*x.args, x.state, x.state_indices)
    if not jit:
        return run(*args)
    return jax.jit(run, donate_argnums=(6,) if donate else ())(*args)


def _bits(x) -> bytes:
    return np.asarray(x).tobytes()


def _slots(x: DecodeInputs) -> np.ndarray:
    n = x.q.shape[0]
    return np.arange(n) if x.state_indices is None else np.asarray(x.state_indices)


def _check_decode(x: DecodeInputs, dtype: str, outputs) -> None:
    """Outputs, pool and token states against the decode reference; dtypes; every slot not named
    bit for bit as given; the slot written back bit for bit the last token state."""
    o, pool, states = outputs
    o_ref, pool_ref, states_ref = decode_reference_outputs(x)
    pool_dtype = x.state.dtype
    assert o.dtype == x.v.dtype, f"o: dtype {o.dtype}, expected v's {x.v.dtype}"
    for name, arr in (("state", pool), ("token_states", states)):
        assert arr.dtype == pool_dtype, (
            f"{name}: dtype {arr.dtype}, expected the pool's {pool_dtype}"
        )
    # a bfloat16 pool rounds the state: judged at the bfloat16 tolerance
    state_dtype = "bfloat16" if pool_dtype == jnp.bfloat16 else dtype
    assert_close("o (decode)", o, o_ref, dtype)
    assert_close("state (decode)", pool, pool_ref, state_dtype)
    assert_close("token_states (decode)", states, states_ref, state_dtype)
    slots = _slots(x)
    others = np.setdiff1d(np.arange(x.state.shape[0]), slots)
    assert _bits(np.asarray(pool)[others]) == _bits(np.asarray(x.state)[others]), (
        f"state: slots {others.tolist()} were not named but changed"
    )
    assert _bits(np.asarray(pool)[slots]) == _bits(np.asarray(states)[:, -1]), (
        "state: the slots written back differ from the last token states"
    )


def _forward_from_slots(target: Target, x: DecodeInputs):
    """The chunked forward (the target's own) over the decode tokens, from the named slots."""
    heads = x.v.shape[2]
    q, k, b, g = (expand_heads(a, heads) for a in (x.q, x.k, x.b, x.g))
    h0 = jnp.asarray(np.asarray(x.state.astype(jnp.float32))[_slots(x)])
    return gdn2_forward(q, k, x.v, x.w, b, g, h0=h0, config=target.config, backend=target.backend)


def _pooled_call(C: int) -> dict:
    """A ragged step for :meth:`DecodeTests.test_pooled_ragged_step` with chunks of ``C``
    tokens: a decode, a new prompt of ``C + 3`` tokens, a resumed one at context ``2 C - 2`` (its
    checkpoint after 2 tokens), one ending on a checkpoint, an empty new request (its slot becomes
    zeros), a padded one, and 2 padding tokens."""
    every = 2 * C
    lens = [1, C + 3, 5, every]
    ctx = [C, 0, every - 2, every]
    cu = np.concatenate([[0], np.cumsum([*lens, 0, 3])]).astype(np.int32)
    return dict(
        cu_seqlens=cu, state_indices=[2, 5, 9, 0, 7, -1],
        has_initial_state=[True, False, True, True, False, True],
        checkpoint_every=every, context_lens=[*ctx, 0, 0],
        checkpoint_slots=[[-1], [-1], [4], [6], [-1], [-1]],
    )  # fmt: skip


#: The sequences of :meth:`DecodeTests.test_decode_skipped_sequences_under_jit`: slot 2, an
#: index past the pool, slot 5 twice, a negative index.
SKIP_INDICES = (2, 9, 5, 5, -1)


class DecodeTests:
    """The decode and chunk-state tests (a mixin of the suite; see the module docstring)."""

    @capability(Feature.DECODE)
    def test_decode(self, gdn2_target: Target, gdn2_decode_case: DecodeCase):
        """float32: o, the pool and the per-token states against the decode reference; untouched
        slots bit-identical; and o and the final states against the target's chunked forward over
        the same tokens from the same states."""
        x = make_decode_inputs(gdn2_decode_case)
        outputs = _decode(gdn2_target, x)
        _check_decode(x, "float32", outputs)
        o_fwd, h_fwd = _forward_from_slots(gdn2_target, x)
        assert_close("o", outputs[0], o_fwd, "float32")
        assert_close("h_final", np.asarray(outputs[1])[_slots(x)], h_fwd, "float32")

    @capability(Feature.DECODE)
    def test_decode_scalar_gates(self, gdn2_target: Target):
        """Scalar gates, one value per head and token without a channel axis (fla's beta, GDN's
        decay): KDA's w ``(N, S, HV)`` and b ``(N, S, Hg)``, and GDN's g ``(N, S, Hg)`` too, on
        key and on value heads, with a float32 and a bfloat16 pool: against the decode reference
        on the same values written out on every channel."""
        for spec in DECODE_CASES[1:3]:  # b, g on the key heads, then on the value heads
            for pool_dtype in (jnp.float32, jnp.bfloat16):
                x = make_decode_inputs(spec.build(gdn2_target), pool_dtype=pool_dtype)
                for names in (("w", "b"), ("w", "b", "g")):
                    scalar = {n: getattr(x, n)[..., 0] for n in names}  # [N, S, heads]
                    full = {n: jnp.broadcast_to(a[..., None], getattr(x, n).shape)
                            for n, a in scalar.items()}  # fmt: skip
                    outputs = _decode(gdn2_target, dataclasses.replace(x, **scalar))
                    _check_decode(dataclasses.replace(x, **full), "float32", outputs)

    @capability(Feature.DECODE)
    def test_decode_bfloat16_pool(self, gdn2_target: Target):
        """A bfloat16 pool: float32 arithmetic from its values, rounded once when written back."""
        for spec in DECODE_CASES[:2]:
            x = make_decode_inputs(spec.build(gdn2_target), pool_dtype=jnp.bfloat16)
            _check_decode(x, "float32", _decode(gdn2_target, x))

    @capability(Feature.DECODE, Feature.BFLOAT16)
    def test_decode_bfloat16(self, gdn2_target: Target):
        """bfloat16 inputs with a float32 and with a bfloat16 pool."""
        case = DECODE_CASES[1].build(gdn2_target)
        for pool_dtype in (jnp.float32, jnp.bfloat16):
            x = make_decode_inputs(case, jnp.bfloat16, pool_dtype)
            _check_decode(x, "bfloat16", _decode(gdn2_target, x))

    @capability(Feature.DECODE, Feature.FLOAT64)
    def test_decode_float64(self, gdn2_target: Target, gdn2_x64):
        """float64 inputs and pool."""
        case = DECODE_CASES[0].build(gdn2_target)
        x = make_decode_inputs(case, jnp.float64, jnp.float64)
        _check_decode(x, "float64", _decode(gdn2_target, x))

    @capability(Feature.DECODE)
    def test_decode_in_jit_with_donated_pool(self, gdn2_target: Target, gdn2_x64):
        """Under ``jax.jit`` with the pool donated (``donate_argnums``) and ``jax_enable_x64`` on
        (int64 indices): the same results."""
        x = make_decode_inputs(DECODE_CASES[0].build(gdn2_target))
        x = dataclasses.replace(x, state_indices=x.state_indices.astype(jnp.int64))
        given = x.state.copy()
        outputs = _decode(gdn2_target, x, jit=True, donate=True)
        _check_decode(dataclasses.replace(x, state=given), "float32", outputs)

    @capability(Feature.DECODE)
    def test_decode_skipped_sequences_under_jit(self, gdn2_target: Target):
        """Under ``jax.jit`` an index out of range, or a slot named twice, skips those sequences:
        their outputs are NaN and no slot but the valid sequence's changes."""
        dk, dv = gdn2_target.head_sizes[0]
        case = DecodeCase(N=len(SKIP_INDICES), S=2, H=1, HV=2, dk=dk, dv=dv, P=6, seed=15)
        x = make_decode_inputs(case)
        x = dataclasses.replace(x, state_indices=jnp.asarray(SKIP_INDICES, jnp.int32))
        o, pool, states = _decode(gdn2_target, x, jit=True)
        assert bool(jnp.all(jnp.isnan(o[1:]))), "o: skipped sequences must be NaN"
        assert bool(jnp.all(jnp.isnan(states[1:]))), "token_states: skipped sequences: NaN"
        kept = [s for s in range(6) if s != 2]
        assert _bits(np.asarray(pool)[kept]) == _bits(np.asarray(x.state)[kept]), (
            "state: a slot no valid sequence owns changed"
        )
        first = dataclasses.replace(
            x, **{n: getattr(x, n)[:1] for n in ("q", "k", "v", "w", "b", "g")},
            state_indices=x.state_indices[:1],
        )  # fmt: skip
        _check_decode(first, "float32", (o[:1], pool, states[:1]))

    @capability(Feature.POOLED)
    def test_pooled_ragged_step(self, gdn2_target: Target):
        """gdn2_ragged with a float32 pool and checkpoints every ``2 bt`` (a call the pooled
        forward takes): o and the pool against the token-serial ragged reference; every slot the
        call does not write bit for bit as given."""
        dk, dv = gdn2_target.head_sizes[0]
        kw = _pooled_call(gdn2_target.config.bt)
        t = int(kw["cu_seqlens"][-1]) + 2
        case = DecodeCase(N=1, S=t, H=1, HV=2, dk=dk, dv=dv, P=12, seed=21)
        x = make_decode_inputs(case)  # its (1, S, ...) tokens are the flat (T, ...) tokens
        q, k, v, w, b, g = (a[0] for a in x.args)
        pool = x.state
        o, new = gdn2_ragged(
            q, k, v, w, b, g, pool, num_decodes=1, config=gdn2_target.config,
            backend=gdn2_target.backend, **kw,
        )  # fmt: skip
        o_ref, new_ref = gdn2_ragged_reference(q, k, v, w, b, g, pool, **kw)
        assert_close("o (ragged)", o, o_ref, "float32")
        assert_close("state (ragged)", new, new_ref, "float32")
        written = [2, 5, 9, 0, 7, 4, 6]
        others = np.setdiff1d(np.arange(pool.shape[0]), written)
        assert _bits(np.asarray(new)[others]) == _bits(np.asarray(pool)[others]), (
            f"state: slots {others.tolist()} were not written but changed"
        )

    @capability(Feature.CHUNK_STATES)
    def test_chunk_states(self, gdn2_target: Target, gdn2_case: Case):
        """``return_chunk_states=True``: o and h_final as without it, and entry ``i`` the
        reference's state after the first ``i * bt`` tokens."""
        x = make_inputs(gdn2_case)
        C = gdn2_target.config.bt
        o, h, chunks = gdn2_forward(
            *x.args, h0=x.h0, config=gdn2_target.config, backend=gdn2_target.backend,
            return_chunk_states=True,
        )  # fmt: skip
        o_ref, h_ref, _ = reference_outputs_and_grads(x)
        assert_close("o", o, o_ref, "float32")
        assert_close("h_final", h, h_ref, "float32")
        n_chunks = -(-gdn2_case.T // C)
        B, H, dk, dv = gdn2_case.B, gdn2_case.H, gdn2_case.dk, gdn2_case.dv
        assert chunks.shape == (B, n_chunks, H, dk, dv), f"chunk_states: shape {chunks.shape}"
        assert chunks.dtype == h.dtype, f"chunk_states: dtype {chunks.dtype}, expected {h.dtype}"
        # the reference's state after every token: the decode reference over all T tokens
        with jax.default_matmul_precision("highest"):
            _, _, after = jax.jit(gdn2_decode_reference, static_argnums=(9,))(
                *x.args, x.h0_or_zeros, None, None, True
            )  # [B, T, H, dk, dv]
        for i in range(n_chunks):
            h_i = x.h0_or_zeros if i == 0 else after[:, i * C - 1]
            assert_close(f"h_final (chunk {i})", chunks[:, i], h_i, "float32")


__all__ = ["SKIP_INDICES", "DecodeTests"]
