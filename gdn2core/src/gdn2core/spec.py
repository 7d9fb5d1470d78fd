"""The typed operator spec: shapes, dtypes, scale and the model features of one call, derived
from (and validated against) the inputs.

The contract is ``docs/operator.md``: q, k are ``(B, T, H, dk)``; v, w are ``(B, T, HV, dv)``
(``HV`` value heads, a multiple of ``H``: grouped value heads); b, g are ``(B, T, Hg, dk)`` with
``Hg`` either ``H`` or ``HV``; the optional initial state h0 is float32 ``(B, HV, dk, dv)``
(``(N, HV, dk, dv)`` with ``cu_seqlens``). Besides :class:`OpSpec` this module holds the types of
the model features: :class:`SegmentMode`, :class:`GateMode`, :class:`Activations` (the fused gate
activations and L2 norm) and :class:`OpExtras` (the arrays a backend receives with them).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from typing import Any, Final

import jax
import jax.numpy as jnp
import numpy as np

#: Input names in the public argument order, with the axis that holds their channel size.
KEY_AXIS_INPUTS: tuple[str, ...] = ("q", "k", "b", "g")
VALUE_AXIS_INPUTS: tuple[str, ...] = ("v", "w")

SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float64")

#: ``use_qk_l2norm_in_kernel``: ``x / sqrt(sum(x^2 over dk) + L2NORM_EPS)`` (fla's eps).
L2NORM_EPS: Final = 1e-6
#: The range of ``lower_bound``: ``LOWER_BOUND_RANGE[0] <= lower_bound < LOWER_BOUND_RANGE[1]``.
LOWER_BOUND_RANGE: Final = (-5.0, 0.0)


class SegmentMode(enum.StrEnum):
    """How the tokens of a call form sequences."""

    NONE = "none"  # one sequence per batch row
    IDS = "segment_ids"  # (B, T) ids: a sequence starts wherever the id changes
    CU_SEQLENS = "cu_seqlens"  # (N + 1,) offsets into one row (B = 1): fla's varlen convention


class GateMode(enum.StrEnum):
    """Which gate activation ``use_gate_in_kernel`` applies to g."""

    NONE = "none"  # g is the log decay itself
    SOFTPLUS = "softplus"  # g = -exp(A_log) * softplus(g + dt_bias)
    LOWER_BOUND = "lower_bound"  # g = lower_bound * sigmoid(exp(A_log) * g)


@dataclasses.dataclass(frozen=True, slots=True)
class Activations:
    """The activations applied to the raw inputs inside the op (``Activations()``: none).

    Attributes:
        qk_l2norm: q and k divided by ``sqrt(sum over dk of x^2 + L2NORM_EPS)``.
        gate: the gate activation of g (:class:`GateMode`).
        lower_bound: the bound of :attr:`GateMode.LOWER_BOUND`, in ``[-5, 0)``; None otherwise.
        bw_sigmoid: ``b = sigmoid(b)``, ``w = sigmoid(w)``.
        neg_eigval: ``b = 2 * sigmoid(b)`` instead (erase eigenvalues down to -1); needs
            ``bw_sigmoid``.
    """

    qk_l2norm: bool = False
    gate: GateMode = GateMode.NONE
    lower_bound: float | None = None
    bw_sigmoid: bool = False
    neg_eigval: bool = False

    def __post_init__(self) -> None:
        if self.gate == GateMode.LOWER_BOUND:
            lo, hi = LOWER_BOUND_RANGE
            lb = self.lower_bound
            if not isinstance(lb, numbers.Real) or isinstance(lb, bool) or not lo <= lb < hi:
                raise ValueError(f"lower_bound: expected a float in [{lo:g}, {hi:g}), got {lb!r}")
            object.__setattr__(self, "lower_bound", float(lb))
        elif self.lower_bound is not None:
            raise ValueError(
                f"lower_bound: given ({self.lower_bound!r}) but the gate is not fused "
                "(needs use_gate_in_kernel=True)"
            )
        if self.neg_eigval and not self.bw_sigmoid:
            raise ValueError(
                "allow_neg_eigval: True needs use_bw_sigmoid_in_kernel=True (it changes the "
                "sigmoid of b to 2 * sigmoid(b)), got use_bw_sigmoid_in_kernel=False"
            )

    @property
    def any(self) -> bool:
        """Whether any activation is on."""
        return self.qk_l2norm or self.gate != GateMode.NONE or self.bw_sigmoid

    @classmethod
    def from_options(
        cls,
        use_qk_l2norm_in_kernel: bool = False,
        use_gate_in_kernel: bool = False,
        lower_bound: float | None = None,
        use_bw_sigmoid_in_kernel: bool = False,
        allow_neg_eigval: bool = False,
    ) -> Activations:
        """The activations of the public keywords (fla's names).

        Args:
            use_qk_l2norm_in_kernel, use_gate_in_kernel, use_bw_sigmoid_in_kernel,
                allow_neg_eigval: bools.
            lower_bound: a float in ``[-5, 0)`` (with ``use_gate_in_kernel``) or None.

        Returns:
            The :class:`Activations`.

        Raises:
            TypeError: a flag that is not a bool.
            ValueError: ``lower_bound`` outside ``[-5, 0)`` or without ``use_gate_in_kernel``;
                ``allow_neg_eigval`` without ``use_bw_sigmoid_in_kernel``.
        """
        flags = {
            "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
            "use_gate_in_kernel": use_gate_in_kernel,
            "use_bw_sigmoid_in_kernel": use_bw_sigmoid_in_kernel,
            "allow_neg_eigval": allow_neg_eigval,
        }
        for name, value in flags.items():
            if not isinstance(value, bool | np.bool_):
                raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
        if lower_bound is not None and not use_gate_in_kernel:
            raise ValueError(
                f"lower_bound: given ({lower_bound!r}) without use_gate_in_kernel=True "
                "(it bounds the fused gate)"
            )
        if not use_gate_in_kernel:
            gate = GateMode.NONE
        else:
            gate = GateMode.SOFTPLUS if lower_bound is None else GateMode.LOWER_BOUND
        return cls(
            qk_l2norm=bool(use_qk_l2norm_in_kernel),
            gate=gate,
            lower_bound=lower_bound,
            bw_sigmoid=bool(use_bw_sigmoid_in_kernel),
            neg_eigval=bool(allow_neg_eigval),
        )


NO_ACTIVATIONS: Final = Activations()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OpExtras:
    """The arrays of the model features, handed to a backend's ``forward`` /
    ``forward_trainable`` as ``extras=`` (a pytree; absent fields are None).

    Attributes:
        segment_ids: ``(B, T)`` int32; a sequence starts where the id changes (token 0 always).
        cu_seqlens: ``(N + 1,)`` int32 offsets (B = 1).
        A_log: ``(H,)`` in the state dtype, with a fused gate; differentiable.
        dt_bias: ``(H, dk)`` in the state dtype, with the softplus gate; differentiable.
    """

    segment_ids: Any = None
    cu_seqlens: Any = None
    A_log: Any = None
    dt_bias: Any = None


@dataclasses.dataclass(frozen=True, slots=True)
class OpSpec:
    """Static description of one GDN-2 call; hashable, so it can key caches and jit statics.

    The first seven fields are positional (``OpSpec(B, T, H, dk, dv, dtype, scale)`` is a plain
    call); the feature fields default to a plain call: ``value_heads`` and ``gate_heads`` to
    ``heads``, ``n_seqs`` to ``batch`` (it is kept equal to ``batch`` unless ``segments`` is
    :attr:`SegmentMode.CU_SEQLENS`).
    """

    batch: int
    seq_len: int
    heads: int  # H: heads of q and k
    dk: int
    dv: int
    dtype: str  # common floating dtype of q, k, v, w, b, g ("float32", "bfloat16", "float64")
    scale: float
    value_heads: int = 0  # HV: heads of v, w, the state and o (0: heads)
    gate_heads: int = 0  # heads of b and g: heads or value_heads (0: heads)
    segments: SegmentMode = SegmentMode.NONE
    n_seqs: int = 0  # N with cu_seqlens, else batch
    activations: Activations = NO_ACTIVATIONS

    def __post_init__(self) -> None:
        if self.value_heads == 0:
            object.__setattr__(self, "value_heads", self.heads)
        if self.gate_heads == 0:
            object.__setattr__(self, "gate_heads", self.heads)
        if self.segments != SegmentMode.CU_SEQLENS or self.n_seqs == 0:
            object.__setattr__(self, "n_seqs", self.batch)
        if self.value_heads % self.heads:
            raise ValueError(
                f"v: expected HV (value heads) a multiple of H={self.heads}, got HV="
                f"{self.value_heads}"
            )
        if self.gate_heads not in (self.heads, self.value_heads):
            raise ValueError(
                f"b/g: expected H={self.heads} or HV={self.value_heads} heads, got "
                f"{self.gate_heads}"
            )

    @property
    def groups(self) -> int:
        """``G = HV // H``: value heads per key head (1 without grouped value heads)."""
        return self.value_heads // self.heads

    @property
    def state_rows(self) -> int:
        """The leading size of h0 and h_final: ``N`` with cu_seqlens, else ``B``."""
        return self.n_seqs

    @property
    def token_heads(self) -> int:
        """``B * T * HV``."""
        return self.batch * self.seq_len * self.value_heads

    @property
    def itemsize(self) -> int:
        """Bytes per element of the inputs."""
        return int(np.dtype(jnp.dtype(self.dtype)).itemsize)

    @classmethod
    def from_inputs(
        cls,
        q: Any,
        k: Any,
        v: Any,
        w: Any,
        b: Any,
        g: Any,
        scale: float | None = None,
        h0: Any = None,
        *,
        segment_ids: Any = None,
        cu_seqlens: Any = None,
        activations: Activations | None = None,
        A_log: Any = None,
        dt_bias: Any = None,
    ) -> OpSpec:
        """Validate the inputs of the operator and derive the spec.

        Args:
            q, k, v, w, b, g: the operator's inputs (arrays or ``ShapeDtypeStruct``).
            scale: the query scale, a real number (None: ``dk ** -0.5``).
            h0: the optional initial state.
            segment_ids, cu_seqlens: the packed-sequence arguments (at most one).
            activations: the fused activations (None: none).
            A_log, dt_bias: the gate parameters (only with a fused gate).

        Returns:
            The spec.

        Raises:
            ValueError: a shape or value (a non-finite scale, bad cu_seqlens...), naming the
                argument, the expected and the actual value.
            TypeError: a dtype or a type, likewise.
        """
        from gdn2core.features.activations import check_gate_params
        from gdn2core.features.segments import check_segments

        arrays = {"q": q, "k": k, "v": v, "w": w, "b": b, "g": g}
        for name, x in arrays.items():
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
            if len(x.shape) != 4:
                axes = "(B, T, H, dk)" if name in KEY_AXIS_INPUTS else "(B, T, HV, dv)"
                raise ValueError(
                    f"{name}: expected rank 4 {axes}, got rank {len(x.shape)} shape "
                    f"{tuple(x.shape)}"
                )
        bsz, seq, heads, dk = (int(s) for s in q.shape)
        vheads, dv = int(v.shape[2]), int(v.shape[3])
        _expect_shape("k", k.shape, (bsz, seq, heads, dk), "(B, T, H, dk)")
        for name in VALUE_AXIS_INPUTS:
            _expect_shape(name, arrays[name].shape, (bsz, seq, vheads, dv), "(B, T, HV, dv)")
        if min(bsz, heads, dk, vheads, dv) < 1:
            raise ValueError(
                f"q/v: B, H, HV, dk and dv must be positive, got B={bsz}, H={heads}, HV={vheads}, "
                f"dk={dk}, dv={dv}"
            )
        if vheads % heads:
            raise ValueError(
                f"v: expected HV (its heads) a multiple of H={heads} (the heads of q and k), "
                f"got HV={vheads}"
            )
        # b and g: H heads (shared by each group of value heads) or HV heads, both the same.
        gheads = int(b.shape[2])
        expected = f"(B, T, H, dk) = {(bsz, seq, heads, dk)}"
        if vheads != heads:
            expected += f" or (B, T, HV, dk) = {(bsz, seq, vheads, dk)}"
        for name in ("b", "g"):
            shape = tuple(int(s) for s in arrays[name].shape)
            if shape[:2] != (bsz, seq) or shape[3] != dk or shape[2] not in (heads, vheads):
                raise ValueError(f"{name}: expected shape {expected}, got {shape}")
        if int(g.shape[2]) != gheads:
            raise ValueError(
                f"g: expected the heads of b, shape {(bsz, seq, gheads, dk)}, got "
                f"{tuple(int(s) for s in g.shape)}"
            )

        dtype = check_common_dtype(arrays)

        segments, n_seqs = check_segments(segment_ids, cu_seqlens, bsz, seq)
        if h0 is not None:
            if not hasattr(h0, "shape"):
                raise TypeError(f"h0: expected an array or None, got {type(h0).__name__}")
            if segments == SegmentMode.CU_SEQLENS:
                _expect_shape("h0", h0.shape, (n_seqs, vheads, dk, dv), "(N, HV, dk, dv)")
            else:
                axes = "(B, H, dk, dv)" if vheads == heads else "(B, HV, dk, dv)"
                _expect_shape("h0", h0.shape, (bsz, vheads, dk, dv), axes)
            h0_dtype = jnp.dtype(h0.dtype)
            allowed_h0 = ("float32", "float64") if dtype == "float64" else ("float32",)
            if h0_dtype.name not in allowed_h0:
                raise TypeError(
                    f"h0: expected dtype {' or '.join(allowed_h0)}, got {h0_dtype.name}"
                )

        scale = check_scale(scale, dk)

        if activations is None:
            activations = NO_ACTIVATIONS
        if not isinstance(activations, Activations):
            raise TypeError(
                f"activations: expected an Activations or None, got {type(activations).__name__}"
            )
        check_gate_params(activations, A_log, dt_bias, gheads, dk)

        return cls(
            batch=bsz,
            seq_len=seq,
            heads=heads,
            dk=dk,
            dv=dv,
            dtype=dtype,
            scale=scale,
            value_heads=vheads,
            gate_heads=gheads,
            segments=segments,
            n_seqs=n_seqs,
            activations=activations,
        )


def check_common_dtype(arrays: dict[str, Any]) -> str:
    """The one floating dtype of the token inputs.

    Args:
        arrays: ``{"q": q, "k": k, ...}`` (anything with a ``dtype``).

    Returns:
        The dtype's name, one of :data:`SUPPORTED_DTYPES`.

    Raises:
        TypeError: a non-floating dtype, dtypes that differ, or an unsupported one (naming the
            arguments and their dtypes).
    """
    dtypes = {name: jnp.dtype(x.dtype) for name, x in arrays.items()}
    for name, dt in dtypes.items():
        if not jnp.issubdtype(dt, jnp.floating):
            raise TypeError(f"{name}: expected a floating dtype, got {dt.name}")
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n}={d.name}" for n, d in dtypes.items())
        raise TypeError(f"{', '.join(dtypes)}: expected one common dtype, got {listing}")
    first = next(iter(arrays))
    dtype = dtypes[first].name
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{first}: expected one of {SUPPORTED_DTYPES}, got {dtype}")
    return dtype


def check_scale(scale: Any, dk: int) -> float:
    """The query scale of a call: ``scale`` as a float, or ``dk ** -0.5`` for None.

    Args:
        scale: the ``scale`` argument.
        dk: the key head size.

    Returns:
        The scale.

    Raises:
        TypeError: not a real number (a bool, a string or an array is refused).
        ValueError: not finite.
    """
    if scale is None:
        return dk**-0.5
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float, got {scale}")
    return scale


def _expect_shape(name: str, actual: Any, expected: tuple[int, ...], axes: str) -> None:
    actual = tuple(int(s) for s in actual)
    if actual != expected:
        raise ValueError(f"{name}: expected shape {axes} = {expected}, got {actual}")
