"""The token-serial reference: the ground truth every backend is tested against.

One ``lax.scan`` step per token, in the kernel form of ``docs/operator.md``::

    S'  = exp(g_t)[:, None] * S          # decay, key axis
    r   = S'^T (b_t * k_t)               # read at the erase-gated key        [dv]
    S_t = S' + k_t (w_t * v_t - r)^T     # rank-1 edit                         [dk, dv]
    o_t = scale * S_t^T q_t                                                    [dv]

Every model feature is written here directly, token by token, independently of how the core
implements it for the backends (:mod:`gdn2core.features`), so that the reference checks the core
too:

- grouped value heads natively: the state has ``HV`` heads and value head ``j`` reads key head
  ``j // (HV // H)`` (b and g: the same, or head ``j`` when they have ``HV`` heads);
- packed sequences: ``segment_ids`` zero the state before every start but token 0; with
  ``cu_seqlens`` each sequence starts from its own ``h0[n]`` and its last state is ``h_final[n]``;
- the fused activations of each token (L2 norm, gate, sigmoids) inside the step.

The state is float32 whatever the input dtype (float64 when the inputs are float64), so a
bfloat16 call is computed in float32 from the bfloat16 values. Differentiable by autodiff in all
of q, k, v, w, b, g, h0, A_log and dt_bias. The contract is ``docs/operator.md``.
"""

from __future__ import annotations

from typing import Unpack

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn2core.checks import state_dtype
from gdn2core.features.activations import per_channel_bias
from gdn2core.features.scalar_gates import broadcast_gates
from gdn2core.features.segments import varlen_layout
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.options import (
    A_LOG_RANGE,
    L2NORM_EPS,
    FeatureArgs,
    Features,
    GateMode,
    OpExtras,
    SegmentMode,
)


def gdn2_token_serial_reference(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T HV dv"],
    w: Float[Array, "B T HV dv"],
    b: Float[Array, "B T Hg dk"],
    g: Float[Array, "B T Hg dk"],
    scale: float | None = None,
    h0: Float[Array, "L HV dk dv"] | None = None,
    **features: Unpack[FeatureArgs],
) -> tuple[Float[Array, "B T HV dv"], Float[Array, "L HV dk dv"]]:
    """Token-serial GDN-2: one ``lax.scan`` step per token (the ground truth).

    Args:
        q, k, v, w, b, g, scale, h0, **features: as for :func:`gdn2core.gdn2_forward`.

    Returns:
        ``(o, h_final)``: o in v's dtype, h_final float32 (float64 for float64 inputs).

    Raises:
        ValueError, TypeError: as :func:`gdn2core.gdn2_forward` for bad inputs.
    """
    parsed = Features.parse(features, op="gdn2_token_serial_reference")
    extras = parsed.extras
    spec = OpSpec.from_inputs(
        q, k, v, w, b, g, scale, h0,
        segment_ids=extras.segment_ids, cu_seqlens=extras.cu_seqlens,
        activations=parsed.activations, A_log=extras.A_log, dt_bias=extras.dt_bias,
        per_head_dt_bias=True,
    )  # fmt: skip
    return token_serial(spec, q, k, v, w, b, g, h0, per_channel_bias(extras, spec.dk))


def token_serial(
    spec: OpSpec, q, k, v, w, b, g, h0=None, extras: OpExtras | None = None
) -> tuple[jax.Array, jax.Array]:
    """The reference for validated inputs of ``spec`` (what :func:`gdn2_token_serial_reference`
    runs after validation; the reference backend of the kit calls it directly).

    Args:
        spec: the inputs' spec (features included).
        q, k, v, w, b, g, h0: the inputs (h0 None: zeros).
        extras: the feature arrays (None: none).

    Returns:
        ``(o, h_final)``.
    """
    extras = OpExtras() if extras is None else extras
    spec, w, b, g = broadcast_gates(spec, w, b, g)  # scalar gates: the same on every channel
    acc = state_dtype(q.dtype)
    HV, dk, dv = spec.value_heads, spec.dk, spec.dv
    if h0 is None:
        h0 = jnp.zeros((spec.state_rows, HV, dk, dv), acc)
    h0 = h0.astype(acc)
    token = feature_token_step(spec, extras, acc)

    # [T, B, heads, d] in the accumulation dtype: the scan runs over the leading axis.
    xs = tuple(jnp.swapaxes(x, 0, 1).astype(acc) for x in (q, k, v, w, b, g))
    zero = jnp.zeros((spec.batch, HV, dk, dv), acc)

    if spec.segments == SegmentMode.CU_SEQLENS:  # B = 1; h0 and h_final per sequence
        seq, start, end = varlen_layout(extras.cu_seqlens, spec.seq_len)  # [T] each

        def step_varlen(carry, x):
            S, h_fin = carry  # [1, HV, dk, dv], [N, HV, dk, dv]
            n, is_start, is_end, tok = x
            S = jnp.where(is_start, h0[n][None], S)  # sequence n starts from h0[n]
            S_new, o = token(S, tok)
            h_fin = h_fin.at[n].set(jnp.where(is_end, S_new[0], h_fin[n]))
            return (S_new, h_fin), o

        (_, h_final), o = jax.lax.scan(step_varlen, (zero, h0), (seq, start, end, xs))
    else:
        if spec.segments == SegmentMode.IDS:
            ids = extras.segment_ids
            reset = jnp.concatenate(
                [jnp.zeros_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1
            )  # [B, T]: a start other than token 0
        else:
            reset = jnp.zeros((spec.batch, spec.seq_len), bool)

        def step(S, x):
            is_reset, tok = x  # [B]
            S = jnp.where(is_reset[:, None, None, None], 0.0, S)  # a new sequence: zero state
            return token(S, tok)

        h_final, o = jax.lax.scan(step, h0, (jnp.swapaxes(reset, 0, 1), xs))
    return jnp.swapaxes(o, 0, 1).astype(v.dtype), h_final  # o: [B, T, HV, dv]


def feature_token_step(spec: OpSpec, extras: OpExtras, acc):
    """One token of every row with the model features of ``spec``: grouped value heads and the
    fused activations, written directly (the token-serial references' step).

    Args:
        spec: the call's spec (heads, activations, scale).
        extras: the feature arrays (``A_log``, ``dt_bias``).
        acc: the accumulation dtype.

    Returns:
        ``token(S, x) -> (S_t, o_t)``: S ``[B, HV, dk, dv]``, x the raw inputs of one token
        ``(q [B, H, dk], k, v [B, HV, dv], w, b [B, Hg, dk], g)``, o_t ``[B, HV, dv]``.
    """
    HV = spec.value_heads
    # Per value head j: the key head it reads and the gate head it uses.
    key_head = jnp.arange(HV) // spec.groups  # [HV]
    gate_head = key_head if spec.gate_heads == spec.heads else jnp.arange(HV)  # [HV]
    act = spec.activations
    if act.gate != GateMode.NONE:
        # The rate is finite and nonzero, and the factor it multiplies held finite, so that no
        # gradient is 0 * inf at a saturated gate (docs/operator.md, the gates); dt_bias is
        # optional with lower_bound (absent: 0).
        rate = jnp.exp(jnp.clip(extras.A_log.astype(acc), *A_LOG_RANGE))[:, None]  # [Hg, 1]
        bias = 0.0 if extras.dt_bias is None else extras.dt_bias.astype(acc)  # [Hg, dk]
        big = jnp.finfo(acc).max

    def token(S, x):
        """One token for every row: S [B, HV, dk, dv] -> (S_t, o_t [B, HV, dv])."""
        qt, kt, vt, wt, bt, gt = x  # [B, H, dk] x2, [B, HV, dv] x2, [B, Hg, dk] x2
        if act.qk_l2norm:
            qt = qt / jnp.sqrt(jnp.sum(qt**2, axis=-1, keepdims=True) + L2NORM_EPS)
            kt = kt / jnp.sqrt(jnp.sum(kt**2, axis=-1, keepdims=True) + L2NORM_EPS)
        if act.bw_sigmoid:  # jax.nn.sigmoid: exact at +-inf, gradient s (1 - s)
            bt = (2.0 if act.neg_eigval else 1.0) * jax.nn.sigmoid(bt)
            wt = jax.nn.sigmoid(wt)
        if act.gate == GateMode.SOFTPLUS:
            gt = -rate * jnp.minimum(jnp.logaddexp(0.0, gt + bias), big)
        elif act.gate == GateMode.LOWER_BOUND:  # fla's safe gate
            gt = act.lower_bound * jax.nn.sigmoid(rate * jnp.clip(gt + bias, -big, big))
        qt, kt = qt[:, key_head], kt[:, key_head]  # [B, HV, dk]
        bt, gt = bt[:, gate_head], gt[:, gate_head]  # [B, HV, dk]
        return token_step(S, qt, kt, vt, wt, bt, gt, spec.scale)  # [B, HV, dk, dv], [B, HV, dv]

    return token


def token_step(S, qt, kt, vt, wt, bt, gt, scale: float):
    """One token of the recurrence, in the four lines of the module docstring.

    Args:
        S: the state ``[..., dk, dv]``.
        qt, kt, bt, gt: ``[..., dk]``; vt, wt: ``[..., dv]`` (the same leading axes as S).
        scale: the query scale.

    Returns:
        ``(S_t, o_t)``: ``[..., dk, dv]`` and ``[..., dv]``, in S's dtype.
    """
    S_dec = jnp.exp(gt)[..., None] * S  # [..., dk, dv]
    r = jnp.einsum("...kv,...k->...v", S_dec, bt * kt)  # [..., dv]
    S_new = S_dec + kt[..., None] * (wt * vt - r)[..., None, :]  # [..., dk, dv]
    o = scale * jnp.einsum("...kv,...k->...v", S_new, qt)  # [..., dv]
    return S_new, o
