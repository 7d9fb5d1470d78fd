"""The conformance tests of a float32 ``g`` beside bfloat16 inputs (``Capabilities.float32_decay``,
:attr:`Feature.FLOAT32_DECAY`). fla's layers compute the log decay in float32 next to bfloat16 q,
k, v, and fla's kernels keep it in float32; a backend that declares the capability must not round
it to bfloat16. :class:`DecayDtypeTests` is a mixin of :class:`~gdn2_conformance.ConformanceSuite`.

The decay case (:func:`decay_inputs`) makes that rounding visible: every token's log decay is the
same value ``-(1 + 0.45 * 2^-7) * 2^e``, 0.45 of a bfloat16 ulp above a power of two, so bfloat16
drops 0.35% of every decay in the same direction; ``e`` makes the decays add up to about 40 over
the row. Only the first token writes the state (every other ``k`` is 0), and each query is
scaled by ``exp`` of the decay accumulated since, so every ``o_t`` has the size of the first:
rounding ``g`` shifts ``o_t`` by ``exp(0.0035 * |G_t|) - 1``, up to 15% at the end of the row and
about 8% over it, against the kit's bfloat16 tolerance of 3%. The test checks that the reference
on the rounded ``g`` does miss by more than twice the tolerance (:data:`ROUNDED_FACTOR`), so the
case cannot stop telling the two apart.

On a backend with a decode op the same case runs as a decode call (:func:`decode_decay_inputs`,
16 tokens per sequence whose decays add up to about 64: the metric divides by the largest o of
only 16 tokens) and as a ragged step of a decode and a prompt (:func:`ragged_decay_call`), each
sequence from a slot of a random pool (a state decays like the first token's write, so o keeps
its size). The slots written are compared alone: they decay to ``exp(-64)`` of the pool's other
slots, which would hide any error in the metric's maximum.

Tolerances: the kit's bfloat16 ones (:mod:`gdn2_conformance.metrics`; the decode quantity for
the decode op's outputs): both sides use the same bfloat16 q, k, v, w, b and the same float32 g.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from gdn2_conformance.checks import (
    decode_reference_outputs,
    op_function,
    outputs_and_grads,
    reference_outputs,
    reference_outputs_and_grads,
)
from gdn2_conformance.inputs import (
    GRAD_NAMES,
    Case,
    DecodeCase,
    DecodeInputs,
    Inputs,
    make_decode_inputs,
    make_inputs,
)
from gdn2_conformance.metrics import Quantity, assert_close, rel_err, tolerance
from gdn2_conformance.target import Feature, Target, capability
from gdn2core.ops.decode.api import gdn2_decode
from gdn2core.ops.forward.api import gdn2_forward, gdn2_forward_trainable
from gdn2core.ops.ragged.api import gdn2_ragged
from gdn2core.ops.ragged.reference import gdn2_ragged_reference
from gdn2core.platform import default_platform

#: The reference on bfloat16-rounded g must be off by more than this many bfloat16 tolerances in
#: the decay case, or the case does not tell a float32 g from a rounded one.
ROUNDED_FACTOR = 2.0
#: The sum of the decay case's log decays over its row (module docstring).
TOTAL_DECAY = 40.0
#: Tokens of a decode in the decode and ragged decay cases, and the sum of their log decays:
#: larger than :data:`TOTAL_DECAY`, so that the shift of the last tokens (22%) stands out in a
#: metric that divides by the largest o of only 16 tokens (measured: the rounded g misses o by
#: 5.7% with a sum of 32, 11% with 64). The state decays to ``exp(-64)``: float32 holds it.
DECODE_TOKENS = 16
DECODE_DECAY = 64.0


def with_float32_decay(x: Inputs) -> Inputs:
    """``x`` with q, k, v, w, b in bfloat16 and g in float32 (as fla's layers call)."""
    return dataclasses.replace(x.astype(jnp.bfloat16), g=x.g.astype(jnp.float32))


def decay_values(
    q: np.ndarray, k: np.ndarray, total: float = TOTAL_DECAY
) -> tuple[np.ndarray, ...]:
    """The decay case's ``(q, k, g)`` from q, k ``[B, T, H, dk]`` of ``B`` sequences of ``T``
    tokens (module docstring): g float32 ``[B, T, H, dk]``, one value on every token and
    channel; k zero but on each sequence's first token; q scaled by ``exp`` of the decay since
    it; the decays add up to about ``total`` over the ``T`` tokens. A state a sequence starts
    from decays like the first token's write: it may be non-zero."""
    T = q.shape[1]
    e = round(math.log2(total / T))
    g = np.full(q.shape, -(1.0 + 0.45 * 2.0**-7) * 2.0**e, np.float32)  # [B, T, H, dk]
    G = np.cumsum(g[..., :1].astype(np.float64), axis=1)  # [B, T, H, 1] decay accumulated
    first = np.zeros(k.shape)
    first[:, 0] = k[:, 0]  # only the first token writes the state
    return q * np.exp(-(G - G[:, :1])), first, g  # o_t keeps o_0's size


def decay_inputs(target: Target, H: int = 2) -> Inputs:
    """The decay case (module docstring): B = 1, ``H`` heads, T = 2 C + 7 tokens, bfloat16 q, k,
    v, w, b and float32 g (full, one value on every channel), no h0."""
    dk, dv = target.head_sizes[0]
    T = 2 * target.config.bt + 7
    x = make_inputs(Case(B=1, T=T, H=H, dk=dk, dv=dv, h0=False, seed=41))
    return with_decay_case(x, TOTAL_DECAY)


def with_decay_case(x: Inputs | DecodeInputs, total: float) -> Inputs | DecodeInputs:
    """``x`` in bfloat16 with the decay case's q, k and float32 g (:func:`decay_values`)."""
    q, k, g = decay_values(np.asarray(x.q), np.asarray(x.k), total)
    return dataclasses.replace(
        x.astype(jnp.bfloat16),
        q=jnp.asarray(q, jnp.bfloat16),
        k=jnp.asarray(k, jnp.bfloat16),
        g=jnp.asarray(g),
    )


def check_tells_apart(label: str, rounded, expected, tol: float) -> None:
    """The reference on ``g`` rounded to bfloat16 must miss the one on the float32 ``g`` by more
    than ``ROUNDED_FACTOR`` tolerances, or the case cannot tell a backend that rounds ``g``."""
    miss = rel_err(rounded, expected)
    assert miss > ROUNDED_FACTOR * tol, (
        f"decay case ({label}): g rounded to bfloat16 moves it by only {miss:.2e}, "
        f"expected more than {ROUNDED_FACTOR:g} x {tol:.0e}"
    )


def check_decay_case(target: Target, x: Inputs, label: str = "g") -> None:
    """The target's o and h_final on decay-case inputs ``x`` (:func:`decay_inputs`, g full or
    scalar) within the bfloat16 tolerance of the reference on the float32 g, after checking that
    the reference on g rounded to bfloat16 misses by more than ``ROUNDED_FACTOR`` tolerances."""
    o, h = gdn2_forward(*x.args, h0=None, config=target.config, backend=target.backend)
    expected = reference_outputs(x)
    rounded = reference_outputs(dataclasses.replace(x, g=x.g.astype(jnp.bfloat16)))
    tol = tolerance("bfloat16", "o", default_platform())
    check_tells_apart(label, rounded[0], expected[0], tol)
    assert_close(f"o ({label})", o, expected[0], "bfloat16")
    assert_close(f"h_final ({label})", h, expected[1], "bfloat16")


def decode_decay_inputs(target: Target, tokens: int = DECODE_TOKENS) -> DecodeInputs:
    """The decay case as a decode call: 2 sequences of ``tokens`` tokens, 1 key head, 2 value
    heads, bfloat16 inputs and a float32 g; each sequence starts from its slot of a float32 pool
    of 3 (``~ 0.5 N(0, 1)``)."""
    dk, dv = target.head_sizes[0]
    x = make_decode_inputs(DecodeCase(N=2, S=tokens, H=1, HV=2, dk=dk, dv=dv, P=3, seed=43))
    return with_decay_case(x, DECODE_DECAY)


def ragged_decay_call(target: Target) -> tuple[tuple, jax.Array, dict, int]:
    """A ragged step of two requests, each its own decay case (module docstring), from its slot
    of a float32 pool of 4: a decode of :data:`DECODE_TOKENS` tokens (``num_decodes=1``) and a
    prompt of ``2 C + 7``. Returns ``(q, k, v, w, b, g)`` flat ``(T, ., d)`` (bfloat16, g
    float32), the pool, the metadata keywords of the call, and the decode's token count."""
    dk, dv = target.head_sizes[0]
    lens = (DECODE_TOKENS, 2 * target.config.bt + 7)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    case = DecodeCase(N=1, S=int(cu[-1]), H=1, HV=2, dk=dk, dv=dv, P=4, seed=44)
    x = make_decode_inputs(case)  # its (1, S, ...) tokens are the flat (T, ...) tokens
    totals = (DECODE_DECAY, TOTAL_DECAY)
    parts = [
        decay_values(np.asarray(x.q)[:, a:z], np.asarray(x.k)[:, a:z], total)
        for (a, z), total in zip(itertools.pairwise(cu), totals, strict=True)
    ]
    q, k, g = (np.concatenate([p[i] for p in parts], axis=1)[0] for i in range(3))
    bf16 = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, x.v[0], x.w[0], x.b[0])]
    kw = dict(cu_seqlens=cu, state_indices=np.array([3, 1], np.int32))
    return (*bf16, jnp.asarray(g)), x.state, kw, lens[0]


def check_gradients(target: Target, H: int = 2, seed: int = 42) -> None:
    """A case of T = C + 5 (a partial chunk), ``H`` heads, bfloat16 inputs and a float32 g: o,
    h_final and the seven gradients of the target against the reference; dg in float32, the
    others in their arguments' dtypes (bfloat16, h0's float32)."""
    dk, dv = target.head_sizes[0]
    case = Case(B=1, T=target.config.bt + 5, H=H, dk=dk, dv=dv, seed=seed)
    x = with_float32_decay(make_inputs(case))
    fn = op_function(gdn2_forward_trainable, x, config=target.config, backend=target.backend)
    o, h, grads = outputs_and_grads(fn, x)
    o_ref, h_ref, expected = reference_outputs_and_grads(x)
    assert_close("o", o, o_ref, "bfloat16")
    assert_close("h_final", h, h_ref, "bfloat16")
    for name, got, want, arg in zip(GRAD_NAMES, grads, expected, x.diff_args, strict=False):
        assert got.dtype == arg.dtype, f"{name}: dtype {got.dtype}, expected {arg.dtype}"
        assert_close(name, got, want, "bfloat16")


class DecayDtypeTests:
    """The float32-decay tests (a mixin of the conformance suite)."""

    @capability(Feature.FLOAT32_DECAY, Feature.BFLOAT16)
    def test_float32_decay(self, gdn2_target: Target):
        """The decay case, with g on its channels and as GDN's scalar ``(B, T, H)`` decay
        (:func:`check_decay_case`)."""
        full = decay_inputs(gdn2_target)
        check_decay_case(gdn2_target, full, "g")
        check_decay_case(gdn2_target, dataclasses.replace(full, g=full.g[..., 0]), "scalar g")

    @capability(Feature.FLOAT32_DECAY, Feature.BFLOAT16, Feature.TRAINABLE)
    def test_float32_decay_gradients(self, gdn2_target: Target):
        """Every gradient and its dtype (:func:`check_gradients`)."""
        check_gradients(gdn2_target)

    @capability(Feature.FLOAT32_DECAY, Feature.BFLOAT16, Feature.DECODE)
    def test_float32_decay_decode(self, gdn2_target: Target):
        """The decay case as a decode call (:func:`decode_decay_inputs`): o and the named slots
        of the pool against the decode reference on the float32 g, at the bfloat16 decode
        tolerance (the reference on the rounded g misses each by more than twice it). The named
        slots alone: they decay to ``exp(-64)`` of the others, which would hide them in the
        metric's maximum."""
        x = decode_decay_inputs(gdn2_target)
        o, pool = gdn2_decode(
            *x.args, x.state, state_indices=x.state_indices, config=gdn2_target.config,
            backend=gdn2_target.backend,
        )  # fmt: skip
        expected = decode_reference_outputs(x)
        rounded = decode_reference_outputs(dataclasses.replace(x, g=x.g.astype(jnp.bfloat16)))
        tol = tolerance("bfloat16", Quantity.DECODE, default_platform())
        named = np.asarray(x.state_indices)
        check_tells_apart("decode", rounded[0], expected[0], tol)
        check_tells_apart("decode state", rounded[1][named], expected[1][named], tol)
        assert_close("o (decode)", o, expected[0], "bfloat16")
        assert_close("state (decode)", pool[named], expected[1][named], "bfloat16")

    @capability(Feature.FLOAT32_DECAY, Feature.BFLOAT16, Feature.DECODE)
    def test_float32_decay_ragged(self, gdn2_target: Target):
        """A ragged step of a decode and a prompt, each a decay case (:func:`ragged_decay_call`):
        o (the decode's rows alone, then all) and the two slots written against the ragged
        reference on the float32 g, at the bfloat16 tolerance."""
        x, pool, kw, decoded = ragged_decay_call(gdn2_target)
        o, new = gdn2_ragged(
            *x, pool, num_decodes=1, decode_len=decoded, config=gdn2_target.config,
            backend=gdn2_target.backend, **kw,
        )  # fmt: skip
        o_ref, new_ref = gdn2_ragged_reference(*x, pool, **kw)
        rounded, rounded_pool = gdn2_ragged_reference(*x[:5], x[5].astype(jnp.bfloat16), pool, **kw)
        platform = default_platform()
        decode_tol = tolerance("bfloat16", Quantity.DECODE, platform)
        check_tells_apart("ragged decodes", rounded[:decoded], o_ref[:decoded], decode_tol)
        tol = tolerance("bfloat16", "o", platform)
        check_tells_apart("ragged", rounded, o_ref, tol)
        # the decodes' rows come from the decode op: its tolerance
        assert_close("o of the decodes (decode)", o[:decoded], o_ref[:decoded], "bfloat16")
        assert_close("o (ragged)", o, o_ref, "bfloat16")
        for slot in kw["state_indices"]:  # each alone: they decay to exp(-64) and exp(-40)
            check_tells_apart(f"ragged slot {slot}", rounded_pool[slot], new_ref[slot], tol)
            assert_close(f"h_final (slot {slot})", new[slot], new_ref[slot], "bfloat16")
