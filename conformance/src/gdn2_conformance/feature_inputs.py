"""Inputs with model features: packed sequences, grouped value heads, raw inputs for the fused
activations (an extension of :mod:`gdn2_conformance.inputs`, with the same distributions where
they overlap).

A :class:`FeatureCase` names the shape (``H`` key heads, ``HV = groups * H`` value heads, b and g
on key or value heads), the packing (per-row sequence lengths for ``segment_ids``, or sequence
lengths for ``cu_seqlens``) and the activations; :func:`make_feature_inputs` draws it. Raw inputs
(when an activation is on): q, k ~ N(0, 1) unnormalised, b and w ~ N(0, 1) before the sigmoid,
g ~ N(0, 1) before the gate, ``A_log = log U(0.5, 4)`` per head, ``dt_bias ~ N(-1, 0.5)`` per head
and channel (with the softplus gate, and with ``lower_bound`` unless ``gate_bias=False``).
:func:`activate_numpy` applies the activations in float64 NumPy, written apart from the core and
the reference: "the unfused op applied to activated inputs"; :func:`np_sigmoid`,
:func:`np_softplus` and :func:`np_gate` are its stable formulas, exact at any input.
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp
import numpy as np

from gdn2_conformance.inputs import Inputs
from gdn2core.options import A_LOG_RANGE, L2NORM_EPS, NO_ACTIVATIONS, Activations, GateMode


class GateHeads(enum.StrEnum):
    """The heads of b and g (and of A_log, dt_bias) in a grouped call."""

    KEY = "key"  # H: shared by each group of value heads
    VALUE = "value"  # HV


@dataclasses.dataclass(frozen=True)
class FeatureCase:
    """One call with model features.

    Attributes:
        B, T, H, dk, dv: as :class:`~gdn2_conformance.Case`.
        groups: value heads per key head (``HV = groups * H``).
        gate_heads: the heads of b and g.
        h0: with an initial state (``(B, HV, dk, dv)``; ``(N, HV, dk, dv)`` with seqlens).
        rows: ``segment_ids``: the lengths of the sequences of each row (each sums to T); None.
        seqlens: ``cu_seqlens``: the lengths of the sequences (B = 1, they sum to T; zero-length
            sequences allowed); None.
        activations: the fused activations (raw inputs are drawn for those that are on).
        gate_bias: with ``lower_bound``, whether ``dt_bias`` is drawn (fla's safe gate takes
            one; optional there). The softplus gate always has one.
        b_max: b's range when b is not raw.
        seed: the seed.
    """

    B: int = 1
    T: int = 24
    H: int = 2
    dk: int = 8
    dv: int = 8
    groups: int = 1
    gate_heads: GateHeads = GateHeads.KEY
    h0: bool = True
    rows: tuple[tuple[int, ...], ...] | None = None
    seqlens: tuple[int, ...] | None = None
    activations: Activations = NO_ACTIVATIONS
    gate_bias: bool = True
    b_max: float = 1.0
    seed: int = 0

    @property
    def HV(self) -> int:
        """The value heads."""
        return self.groups * self.H

    @property
    def Hg(self) -> int:
        """The heads of b and g."""
        return self.H if self.gate_heads == GateHeads.KEY else self.HV

    @property
    def state_rows(self) -> int:
        """The leading size of h0 and h_final."""
        return self.B if self.seqlens is None else len(self.seqlens)

    def segment_ids(self) -> np.ndarray | None:
        """``(B, T)`` int32 ids of :attr:`rows`: sequence i of a row gets id ``7 * i - 3`` (any
        integers: negative, not consecutive), except that the ids alternate between two values
        in the last row, so the same id comes back after another one (a new sequence)."""
        if self.rows is None:
            return None
        ids = np.zeros((self.B, self.T), np.int32)
        for r, lengths in enumerate(self.rows):
            assert sum(lengths) == self.T, (r, lengths, self.T)
            pos = 0
            for i, n in enumerate(lengths):
                ids[r, pos : pos + n] = (i % 2) * 5 + 1 if r == self.B - 1 else 7 * i - 3
                pos += n
        return ids

    def cu_seqlens(self) -> np.ndarray | None:
        """``(N + 1,)`` int32 offsets of :attr:`seqlens`."""
        if self.seqlens is None:
            return None
        assert self.B == 1 and sum(self.seqlens) == self.T, (self.B, self.seqlens, self.T)
        return np.concatenate([[0], np.cumsum(self.seqlens)]).astype(np.int32)


def np_sigmoid(x) -> np.ndarray:
    """float64 ``1 / (1 + exp(-x))`` for any x: ``where(x >= 0, 1, t) / (1 + t)``,
    ``t = exp(-|x|)`` (1 and 0 at +-inf; NaN stays NaN)."""
    x = np.asarray(x, np.float64)
    t = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0, t) / (1.0 + t)


def np_softplus(x) -> np.ndarray:
    """float64 ``log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|))`` for any x (0 at -inf)."""
    x = np.asarray(x, np.float64)
    return np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x)))


def np_gate(act: Activations, g, A_log, dt_bias=None) -> np.ndarray:
    """float64 the fused gate of ``act`` on raw ``g`` ``(..., Hg, dk)`` (``docs/operator.md``,
    the gates): ``rate = exp(clip(A_log, *A_LOG_RANGE))``, ``x = g + dt_bias`` (None: 0); softplus:
    ``-rate * softplus(x)``, lower_bound: ``lower_bound * sigmoid(rate * x)``. Infinite products
    (``rate * inf``) give the infinite limit."""
    rate = np.exp(np.clip(np.asarray(A_log, np.float64), *A_LOG_RANGE))[:, None]  # [Hg, 1] > 0
    x = np.asarray(g, np.float64)
    if dt_bias is not None:
        x = x + np.asarray(dt_bias, np.float64)
    with np.errstate(over="ignore"):  # rate * x may overflow to +-inf: its limit
        if act.gate == GateMode.SOFTPLUS:
            return -rate * np_softplus(x)
        return act.lower_bound * np_sigmoid(rate * x)


def make_feature_arrays(case: FeatureCase) -> dict[str, np.ndarray]:
    """Float64 NumPy arrays for ``case`` (integer ``segment_ids`` / ``cu_seqlens``).

    Args:
        case: the case.

    Returns:
        ``{"q", "k", "v", "w", "b", "g", "do", "dh"}`` and, when present, ``"h0"``, ``"A_log"``,
        ``"dt_bias"``, ``"segment_ids"``, ``"cu_seqlens"``.
    """
    rng = np.random.default_rng(case.seed)
    act = case.activations
    B, T, H, HV, Hg, dk, dv = case.B, case.T, case.H, case.HV, case.Hg, case.dk, case.dv

    def normal(*shape):
        return rng.standard_normal(shape)

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    out = {
        "q": normal(B, T, H, dk) if act.qk_l2norm else unit(normal(B, T, H, dk)),
        "k": normal(B, T, H, dk) if act.qk_l2norm else unit(normal(B, T, H, dk)),
        "v": normal(B, T, HV, dv),
        "w": normal(B, T, HV, dv) if act.bw_sigmoid else np_sigmoid(normal(B, T, HV, dv)),
        "b": normal(B, T, Hg, dk)
        if act.bw_sigmoid
        else case.b_max * np_sigmoid(normal(B, T, Hg, dk)),
    }
    if act.gate == GateMode.NONE:
        out["g"] = -np.logaddexp(0.0, normal(B, T, Hg, dk) - 1.0)  # the "mixed" decay
    else:
        out["g"] = normal(B, T, Hg, dk)
        out["A_log"] = np.log(rng.uniform(0.5, 4.0, size=Hg))
        if act.gate == GateMode.SOFTPLUS or case.gate_bias:
            out["dt_bias"] = -1.0 + 0.5 * normal(Hg, dk)
    h0 = 0.5 * normal(case.state_rows, HV, dk, dv)
    if case.h0:
        out["h0"] = h0
    out["do"] = normal(B, T, HV, dv)
    out["dh"] = normal(case.state_rows, HV, dk, dv)
    for name in ("segment_ids", "cu_seqlens"):
        value = getattr(case, name)()
        if value is not None:
            out[name] = value
    return out


def make_feature_inputs(case: FeatureCase, dtype=jnp.float32) -> Inputs:
    """JAX inputs for ``case``: q..g in ``dtype``; h0, the gate parameters and the cotangents in
    the state dtype; ``options`` holds segment_ids / cu_seqlens and the activation keywords.

    Args:
        case: the case.
        dtype: the input dtype.

    Returns:
        The :class:`~gdn2_conformance.Inputs`.
    """
    arrays = make_feature_arrays(case)
    acc = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32

    def arr(name, dt):
        x = arrays.get(name)
        return None if x is None else jnp.asarray(x.astype(np.dtype(acc)), dtype=dt)

    options = activation_options(case.activations)
    for name in ("segment_ids", "cu_seqlens"):
        if name in arrays:
            options[name] = jnp.asarray(arrays[name])
    return Inputs(
        *(arr(n, dtype) for n in ("q", "k", "v", "w", "b", "g")),
        h0=arr("h0", acc),
        do=arr("do", acc),
        dh=arr("dh", acc),
        A_log=arr("A_log", acc),
        dt_bias=arr("dt_bias", acc),
        options=options,
    )


def activation_options(act: Activations) -> dict:
    """The public keywords (fla's names) of ``act``; empty when no activation is on.

    Args:
        act: the activations.

    Returns:
        The keywords.
    """
    if not act.any:
        return {}
    return {
        "use_qk_l2norm_in_kernel": act.qk_l2norm,
        "use_gate_in_kernel": act.gate != GateMode.NONE,
        "lower_bound": act.lower_bound,
        "use_bw_sigmoid_in_kernel": act.bw_sigmoid,
        "allow_neg_eigval": act.neg_eigval,
    }


def activate_numpy(x: Inputs, act: Activations) -> Inputs:
    """The activated inputs of raw ``x``, in float64 NumPy (rounded to x's dtype), with no
    activation options left: the unfused op on them equals the fused op on ``x``.

    Args:
        x: raw inputs.
        act: the activations to apply.

    Returns:
        The activated inputs (no gate parameters, no activation options).
    """

    def f64(a):
        return np.asarray(a, np.float64)

    q, k, w, b, g = (f64(a) for a in (x.q, x.k, x.w, x.b, x.g))
    if act.qk_l2norm:
        q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + L2NORM_EPS)
        k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + L2NORM_EPS)
    if act.bw_sigmoid:
        b = (2.0 if act.neg_eigval else 1.0) * np_sigmoid(b)
        w = np_sigmoid(w)
    if act.gate != GateMode.NONE:
        g = np_gate(act, g, x.A_log, x.dt_bias)
    dt = x.q.dtype
    cast = {n: jnp.asarray(a, dt) for n, a in zip("qkwbg", (q, k, w, b, g), strict=True)}
    options = {n: v for n, v in x.options.items() if n in ("segment_ids", "cu_seqlens")}
    return dataclasses.replace(x, **cast, A_log=None, dt_bias=None, options=options)
