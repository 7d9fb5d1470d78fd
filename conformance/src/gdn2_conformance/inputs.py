"""The one input generator of gdn2: tests, the conformance kit and the benchmarks draw from it.

A :class:`Case` names a shape and the knobs the suite sweeps; :func:`make_arrays` draws float64
NumPy arrays for it (deterministic in ``case.seed``), and :func:`make_inputs` hands them over as
JAX arrays in the dtype under test. Distributions (per element unless said otherwise):

- q, k: N(0, 1), L2-normalised per head (as models feed the operator); v ~ N(0, 1).
- w = sigmoid(N(0, 1)); b = b_max * sigmoid(N(0, 1)) (``b_max = 2`` allows negative eigenvalues).
- g by :class:`Decay`: weak ``-1e-3 * sigmoid(N)``; mixed ``-softplus(N - 1)`` (about -0.3);
  strong: mixed, with a share ``strong_share`` (default 10%) of the tokens at ``g = -30`` on every
  channel; model: what a GDN-2
  layer produces, ``-A * softplus(N + dt_bias)`` with ``A ~ U(1, 16)`` per head and ``dt_bias``
  the inverse softplus of a log-uniform step in ``[1e-3, 1e-1]`` per channel (g in about [-10, 0)).
- h0 ~ 0.5 N(0, 1) (or absent); cotangents ``do ~ N(0, 1)`` (o's) and ``dh ~ N(0, 1)``
  (h_final's).
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np

#: The operator's six token inputs, in argument order, and the seven differentiable arguments.
INPUT_NAMES = ("q", "k", "v", "w", "b", "g")
ARG_NAMES = (*INPUT_NAMES, "h0")
#: Names of the seven gradients, as reports label them.
GRAD_NAMES = tuple(f"d{n}" for n in ARG_NAMES)


class Decay(enum.StrEnum):
    """How strongly the state decays per token (see the module docstring)."""

    WEAK = "weak"
    MIXED = "mixed"
    STRONG = "strong"
    MODEL = "model"


@dataclasses.dataclass(frozen=True)
class Case:
    """One input configuration: a shape and the distribution knobs."""

    B: int = 1
    T: int = 24
    H: int = 2
    dk: int = 8
    dv: int = 8
    h0: bool = True
    b_max: float = 1.0
    decay: Decay = Decay.MIXED
    seed: int = 0
    strong_share: float = 0.1

    @property
    def id(self) -> str:
        """A test id naming every field."""
        h0 = "h0" if self.h0 else "noh0"
        decay = f"{self.decay}"
        if self.decay == Decay.STRONG and self.strong_share != 0.1:
            decay += f"{self.strong_share:g}"
        return (
            f"B{self.B}T{self.T}H{self.H}k{self.dk}v{self.dv}-{h0}-b{self.b_max:g}-{decay}"
            f"-s{self.seed}"
        )


#: The differentiable parameters of the fused gate, in the order :attr:`Inputs.diff_args` holds them.
PARAM_NAMES = ("A_log", "dt_bias")


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The operator's inputs and the cotangents of its two outputs for one case.

    With model features (:mod:`gdn2_conformance.feature_inputs`) also the gate parameters and
    ``options``: the other keywords of the call (segment_ids, cu_seqlens, the activation flags).
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    w: jax.Array
    b: jax.Array
    g: jax.Array
    h0: jax.Array | None
    do: jax.Array  # cotangent of o
    dh: jax.Array  # cotangent of h_final
    A_log: jax.Array | None = None
    dt_bias: jax.Array | None = None
    options: dict = dataclasses.field(default_factory=dict)

    @property
    def args(self) -> tuple[jax.Array, ...]:
        """``(q, k, v, w, b, g)``."""
        return (self.q, self.k, self.v, self.w, self.b, self.g)

    @property
    def param_names(self) -> tuple[str, ...]:
        """The gate parameters present (a subset of :data:`PARAM_NAMES`, in order)."""
        return tuple(n for n in PARAM_NAMES if getattr(self, n) is not None)

    @property
    def diff_args(self) -> tuple[jax.Array, ...]:
        """Every differentiable argument: ``(q, k, v, w, b, g, h0)`` (h0 as zeros when absent),
        then the gate parameters present."""
        return (*self.args, self.h0_or_zeros, *(getattr(self, n) for n in self.param_names))

    @property
    def grad_names(self) -> tuple[str, ...]:
        """Labels of the gradients of :attr:`diff_args` (``dq`` ... ``dh0``, ``dA_log``...)."""
        return (*GRAD_NAMES, *(f"d{n}" for n in self.param_names))

    @property
    def h0_or_zeros(self) -> jax.Array:
        """h0, or zeros of its shape and dtype when the case has none."""
        return jnp.zeros(self.dh.shape, self.dh.dtype) if self.h0 is None else self.h0

    def astype(self, dtype) -> Inputs:
        """q..g in ``dtype``; h0 and the cotangents keep their (state) dtype.

        Args:
            dtype: the new input dtype.

        Returns:
            The cast inputs.
        """
        cast = {n: getattr(self, n).astype(dtype) for n in INPUT_NAMES}
        return dataclasses.replace(self, **cast)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def _l2(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _decay(case: Case, rng: np.random.Generator, normal) -> np.ndarray:
    B, T, H, dk = case.B, case.T, case.H, case.dk
    match case.decay:
        case Decay.WEAK:
            return -1e-3 * _sigmoid(normal(B, T, H, dk))
        case Decay.MIXED | Decay.STRONG:
            g = -_softplus(normal(B, T, H, dk) - 1.0)
            if case.decay == Decay.STRONG:
                g = np.where(rng.random((B, T, H, 1)) < case.strong_share, -30.0, g)
            return g
        case Decay.MODEL:
            A = rng.uniform(1.0, 16.0, size=(H, 1))
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), size=(H, dk)))
            dt_bias = dt + np.log(-np.expm1(-dt))
            return -A * _softplus(normal(B, T, H, dk) + dt_bias)
    raise ValueError(f"decay: expected one of {[d.value for d in Decay]}, got {case.decay!r}")


def make_arrays(case: Case) -> dict[str, np.ndarray]:
    """Float64 NumPy arrays for ``case`` (no JAX needed: a peer can rebuild the same inputs).

    Args:
        case: the shape, knobs and seed.

    Returns:
        ``{"q", "k", "v", "w", "b", "g", "h0", "do", "dh"}`` in the public layout; ``"h0"`` is
        absent when ``case.h0`` is false.
    """
    rng = np.random.default_rng(case.seed)
    B, T, H, dk, dv = case.B, case.T, case.H, case.dk, case.dv

    def normal(*shape):
        return rng.standard_normal(shape)

    out = {
        "q": _l2(normal(B, T, H, dk)),
        "k": _l2(normal(B, T, H, dk)),
        "v": normal(B, T, H, dv),
        "w": _sigmoid(normal(B, T, H, dv)),
        "b": case.b_max * _sigmoid(normal(B, T, H, dk)),
    }
    out["g"] = _decay(case, rng, normal)
    h0 = 0.5 * normal(B, H, dk, dv)
    if case.h0:
        out["h0"] = h0
    out["do"] = normal(B, T, H, dv)
    out["dh"] = normal(B, H, dk, dv)
    return out


def make_inputs(case: Case, dtype=jnp.float32) -> Inputs:
    """JAX inputs for ``case``: q..g in ``dtype``; h0 and the cotangents in the state dtype
    (float64 for float64 inputs, else float32).

    Args:
        case: the shape, knobs and seed.
        dtype: the input dtype.

    Returns:
        The :class:`Inputs`.
    """
    arrays = make_arrays(case)
    acc = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32

    def arr(name, dt):
        x = arrays.get(name)
        return None if x is None else jnp.asarray(x.astype(np.dtype(acc)), dtype=dt)

    return Inputs(
        *(arr(n, dtype) for n in INPUT_NAMES),
        h0=arr("h0", acc),
        do=arr("do", acc),
        dh=arr("dh", acc),
    )


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One decode configuration: ``N`` sequences of ``S`` new tokens, ``H`` key heads and ``HV``
    value heads (b and g with ``gate_heads``: H or HV; 0 means H), and a pool of ``P`` slots
    (0: one slot per sequence and no ``state_indices``)."""

    N: int = 2
    S: int = 1
    H: int = 1
    HV: int = 2
    gate_heads: int = 0
    dk: int = 8
    dv: int = 8
    P: int = 0
    b_max: float = 1.0
    decay: Decay = Decay.MIXED
    seed: int = 0

    @property
    def indexed(self) -> bool:
        """Whether the call names slots (``state_indices``)."""
        return self.P > 0

    @property
    def id(self) -> str:
        """A test id naming every field."""
        gates = self.gate_heads or self.H
        pool = f"P{self.P}" if self.indexed else "Pn"
        return (
            f"N{self.N}S{self.S}H{self.H}HV{self.HV}Hg{gates}k{self.dk}v{self.dv}{pool}"
            f"-b{self.b_max:g}-{self.decay}-s{self.seed}"
        )


@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """The arguments of one decode call (``state_indices`` None: slot n for sequence n)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    w: jax.Array
    b: jax.Array
    g: jax.Array
    state: jax.Array
    state_indices: jax.Array | None

    @property
    def args(self) -> tuple[jax.Array, ...]:
        """``(q, k, v, w, b, g)``."""
        return (self.q, self.k, self.v, self.w, self.b, self.g)

    def astype(self, dtype) -> DecodeInputs:
        """q..g in ``dtype`` (the pool keeps its dtype).

        Args:
            dtype: the new input dtype.

        Returns:
            The cast inputs.
        """
        return dataclasses.replace(self, **{n: getattr(self, n).astype(dtype) for n in INPUT_NAMES})


def make_decode_arrays(case: DecodeCase) -> dict[str, np.ndarray]:
    """Float64 NumPy arrays for a decode case, from the same distributions as :func:`make_arrays`
    (the key-side inputs of key head ``h`` are drawn as those of value head ``h * HV / H``).

    Args:
        case: the shape, knobs and seed.

    Returns:
        ``{"q", "k", "v", "w", "b", "g", "state", "state_indices"}``; ``"state"`` is the pool
        ``(P, HV, dk, dv)`` (``P = N`` when the case names no slots) ~ ``0.5 N(0, 1)``, and
        ``"state_indices"`` (absent when the case names no slots) N distinct slots in a random
        order.
    """
    full = make_arrays(
        Case(B=case.N, T=case.S, H=case.HV, dk=case.dk, dv=case.dv, h0=False,
             b_max=case.b_max, decay=case.decay, seed=case.seed)
    )  # fmt: skip
    group = case.HV // case.H
    gates = case.gate_heads or case.H
    out = {n: full[n] for n in ("v", "w")}
    out.update({n: full[n][:, :, ::group] for n in ("q", "k")})
    out.update({n: full[n][:, :, :: case.HV // gates] for n in ("b", "g")})
    rng = np.random.default_rng(case.seed + 1000)
    slots = case.P if case.indexed else case.N
    out["state"] = 0.5 * rng.standard_normal((slots, case.HV, case.dk, case.dv))
    if case.indexed:
        out["state_indices"] = rng.permutation(case.P)[: case.N]
    return out


def make_decode_inputs(case: DecodeCase, dtype=jnp.float32, pool_dtype=jnp.float32) -> DecodeInputs:
    """JAX inputs of a decode case: q..g in ``dtype``, the pool in ``pool_dtype``, int32 indices.

    Args:
        case: the shape, knobs and seed.
        dtype: the input dtype.
        pool_dtype: the pool dtype.

    Returns:
        The :class:`DecodeInputs`.
    """
    arrays = make_decode_arrays(case)
    acc = np.float64 if jnp.dtype(dtype) == jnp.float64 else np.float32
    xs = {n: jnp.asarray(arrays[n].astype(acc), dtype=dtype) for n in INPUT_NAMES}
    state = jnp.asarray(arrays["state"].astype(acc), dtype=pool_dtype)
    idx = arrays.get("state_indices")
    return DecodeInputs(
        **xs, state=state, state_indices=None if idx is None else jnp.asarray(idx, jnp.int32)
    )
