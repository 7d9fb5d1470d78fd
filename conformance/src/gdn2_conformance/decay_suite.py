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

Tolerances: the kit's bfloat16 ones (:mod:`gdn2_conformance.metrics`): both sides use the same
bfloat16 q, k, v, w, b and the same float32 g.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from gdn2_conformance.checks import (
    op_function,
    outputs_and_grads,
    reference_outputs,
    reference_outputs_and_grads,
)
from gdn2_conformance.inputs import GRAD_NAMES, Case, Inputs, make_inputs
from gdn2_conformance.metrics import assert_close, rel_err, tolerance
from gdn2_conformance.target import Feature, Target, capability
from gdn2core.ops.forward.api import gdn2_forward, gdn2_forward_trainable
from gdn2core.platform import default_platform

#: The reference on bfloat16-rounded g must be off by more than this many bfloat16 tolerances in
#: the decay case, or the case does not tell a float32 g from a rounded one.
ROUNDED_FACTOR = 2.0
#: The sum of the decay case's log decays over its row (module docstring).
TOTAL_DECAY = 40.0


def with_float32_decay(x: Inputs) -> Inputs:
    """``x`` with q, k, v, w, b in bfloat16 and g in float32 (as fla's layers call)."""
    return dataclasses.replace(x.astype(jnp.bfloat16), g=x.g.astype(jnp.float32))


def decay_inputs(target: Target, H: int = 2) -> Inputs:
    """The decay case (module docstring): B = 1, ``H`` heads, T = 2 C + 7 tokens, bfloat16 q, k,
    v, w, b and float32 g (full, one value on every channel), no h0."""
    dk, dv = target.head_sizes[0]
    T = 2 * target.config.bt + 7
    x = make_inputs(Case(B=1, T=T, H=H, dk=dk, dv=dv, h0=False, seed=41))
    e = round(math.log2(TOTAL_DECAY / T))
    g = np.full(x.g.shape, -(1.0 + 0.45 * 2.0**-7) * 2.0**e, np.float32)  # [B, T, H, dk]
    G = np.cumsum(g[..., :1].astype(np.float64), axis=1)  # [B, T, H, 1] decay accumulated
    k = np.zeros(x.k.shape)
    k[:, 0] = np.asarray(x.k[:, 0])  # only the first token writes the state
    q = np.asarray(x.q) * np.exp(-(G - G[:, :1]))  # o_t keeps o_0's size
    return dataclasses.replace(
        x,
        q=jnp.asarray(q, jnp.bfloat16),
        k=jnp.asarray(k, jnp.bfloat16),
        v=x.v.astype(jnp.bfloat16),
        w=x.w.astype(jnp.bfloat16),
        b=x.b.astype(jnp.bfloat16),
        g=jnp.asarray(g),
    )


def check_decay_case(target: Target, x: Inputs, label: str = "g") -> None:
    """The target's o and h_final on decay-case inputs ``x`` (:func:`decay_inputs`, g full or
    scalar) within the bfloat16 tolerance of the reference on the float32 g, after checking that
    the reference on g rounded to bfloat16 misses by more than ``ROUNDED_FACTOR`` tolerances."""
    o, h = gdn2_forward(*x.args, h0=None, config=target.config, backend=target.backend)
    expected = reference_outputs(x)
    rounded = reference_outputs(dataclasses.replace(x, g=x.g.astype(jnp.bfloat16)))
    tol = tolerance("bfloat16", "o", default_platform())
    miss = rel_err(rounded[0], expected[0])
    assert miss > ROUNDED_FACTOR * tol, (
        f"decay case ({label}): g rounded to bfloat16 moves o by only {miss:.2e}, "
        f"expected more than {ROUNDED_FACTOR:g} x {tol:.0e}"
    )
    assert_close(f"o ({label})", o, expected[0], "bfloat16")
    assert_close(f"h_final ({label})", h, expected[1], "bfloat16")


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
