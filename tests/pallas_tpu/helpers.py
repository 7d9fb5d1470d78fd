"""The pallas_tpu tests' view of the conformance kit: its one input generator, metric and
tolerance table (gdn2_conformance), in the positional form these tests use."""

from __future__ import annotations

import jax.numpy as jnp

from gdn2_conformance import Case, Decay, reference_outputs_and_grads, rel_err, tolerance  # noqa: F401  (re-exported)
from gdn2_conformance import make_inputs as kit_inputs
from gdn2_conformance import outputs_and_grads as kit_outputs_and_grads
from gdn2_conformance.inputs import ARG_NAMES as GRAD_NAMES  # noqa: F401  (re-exported)
from gdn2_conformance.inputs import Inputs

#: Tolerances on rel_err against the token-serial float32 reference of the same inputs: the kit's
#: table (gdn2_conformance.metrics states the reasons), by what the tests compare.
TOL = {
    dtype: {
        "o": tolerance(dtype, "o"),
        "h_final": tolerance(dtype, "h_final"),
        "grad": tolerance(dtype, "dq"),
    }
    for dtype in ("float32", "bfloat16")
}


def make_inputs(B, T, H, dk, dv, dtype, *, seed=0, strong=0.1, b_max=2.0, with_h0=True):
    """The kit's inputs with a share ``strong`` of tokens at g = -30: ``(args, do, dh)`` with
    ``args = (q, k, v, w, b, g, h0)`` (h0 float32, zeros without ``with_h0``)."""
    case = Case(B, T, H, dk, dv, with_h0, b_max, Decay.STRONG, seed, strong)
    x = kit_inputs(case).astype(jnp.dtype(dtype))
    return (*x.args, x.h0_or_zeros), x.do, x.dh


def _as_inputs(args, do, dh) -> Inputs:
    return Inputs(*args, do=do, dh=dh)


def outputs_and_grads(fn, args, do, dh):
    """One jit: ``fn``'s (o, h_final) and the seven gradients of sum(o*do) + sum(h_final*dh)."""
    return kit_outputs_and_grads(fn, _as_inputs(args, do, dh))


def reference_value_and_grad(args, do, dh):
    """Outputs and the seven gradients of the float32 token-serial reference."""
    return reference_outputs_and_grads(_as_inputs(args, do, dh))


def ragged_tokens(t, seed, heads, value_heads, dk, dv, slots, padding_from=None):
    """Flat tokens of a ragged step and a pool: ``((q, k, v, w, b, g), pool)``, q, k, b, g
    ``(t, heads, dk)``, v, w ``(t, value_heads, dv)``, the pool ``(slots, value_heads, dk, dv)``;
    from token ``padding_from`` on every input is NaN (an engine's padding may hold anything)."""
    import jax

    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    q = jax.random.normal(ks[0], (t, heads, dk))
    k = jax.random.normal(ks[1], (t, heads, dk)) * dk**-0.5
    v = jax.random.normal(ks[2], (t, value_heads, dv))
    w = jax.nn.sigmoid(jax.random.normal(ks[3], (t, value_heads, dv)))
    b = jax.nn.sigmoid(jax.random.normal(ks[4], (t, heads, dk)))
    g = -0.3 * jax.nn.softplus(jax.random.normal(ks[5], (t, heads, dk)))
    x = (q, k, v, w, b, g)
    if padding_from is not None:
        x = tuple(a.at[padding_from:].set(jnp.nan) for a in x)
    pool = 0.3 * jax.random.normal(ks[6], (slots, value_heads, dk, dv))
    return x, pool


def decode_plans(monkeypatch) -> list:
    """The plans of the decode kernel's calls from here on (a spy on ``decode_op.decode_call``),
    in call order."""
    import gdn2_pallas_tpu.decode_op as decode_op

    plans = []
    real = decode_op.decode_call

    def spy(*args, plan, **kw):
        plans.append(plan)
        return real(*args, plan=plan, **kw)

    monkeypatch.setattr(decode_op, "decode_call", spy)
    return plans


#: bt = 16, checkpoints every 16, T = 56 with the engine's padding from token 47 on: a decode
#: (token 0); a resumed request at context 7 from token 1 (its window starts 6 tokens before the
#: array: clamped to 0, rolled, the decode's row zeroed); a new request of 21 tokens (a
#: checkpoint after its token 15); a resumed one at context 33 whose last window runs past the
#: array's end (clamped, rolled; the padding's NaN rows zeroed).
FLAT = dict(
    cu_seqlens=[0, 1, 9, 30, 47],
    state_indices=[2, 5, 9, 0],
    has_initial_state=[True, True, False, True],
    checkpoint_every=16,
    context_lens=[15, 7, 0, 33],
    checkpoint_slots=[[1, -1], [3, -1], [4, -1], [6, 10]],
)
FLAT_T, FLAT_PADDING = 56, 47
