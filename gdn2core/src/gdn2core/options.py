"""The option set shared by the ops: how tokens form sequences (:class:`SegmentMode`), the fused
activations (:class:`Activations`, :class:`GateMode`) and the feature arrays a backend receives
(:class:`OpExtras`). The bottom layer of the core: it imports nothing of gdn2core.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import numbers
from typing import Any, ClassVar, Final, TypedDict

import jax
import numpy as np

#: ``use_qk_l2norm_in_kernel``: ``x / sqrt(sum(x^2 over dk) + L2NORM_EPS)`` (fla's eps).
L2NORM_EPS: Final = 1e-6
#: The range of ``lower_bound``: ``LOWER_BOUND_RANGE[0] <= lower_bound < LOWER_BOUND_RANGE[1]``.
LOWER_BOUND_RANGE: Final = (-5.0, 0.0)
#: The fused gates use ``exp(clip(A_log, *A_LOG_RANGE))``: a rate finite and nonzero in float32
#: (``exp(80) = 5.5e34``, ``exp(-80) = 1.8e-35``), so that a rate times an infinite or zero gate
#: input is never ``0 * inf``. Outside the range the rate is constant (gradient 0); inside it is
#: ``exp(A_log)`` itself (models have ``A_log`` of a few units).
A_LOG_RANGE: Final = (-80.0, 80.0)


class SegmentMode(enum.StrEnum):
    """How the tokens of a call form sequences."""

    NONE = "none"  # one sequence per batch row
    IDS = "segment_ids"  # (B, T) ids: a sequence starts wherever the id changes
    CU_SEQLENS = "cu_seqlens"  # (N + 1,) offsets into one row (B = 1): fla's varlen convention


class GateMode(enum.StrEnum):
    """Which gate activation ``use_gate_in_kernel`` applies to g."""

    NONE = "none"  # g is the log decay itself
    SOFTPLUS = "softplus"  # g = -exp(A_log) * softplus(g + dt_bias)
    LOWER_BOUND = "lower_bound"  # g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))


def _type_name(x: Any) -> str:
    """``float32[]``, ``int32[3,4]``: an array's dtype and shape; else the Python type."""
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        shape = ",".join(str(int(s)) for s in x.shape)
        return f"{np.dtype(x.dtype).name}[{shape}]"
    return type(x).__name__


def static_lower_bound(lb: Any) -> float:
    """``lower_bound`` as a Python float: a real number (``int``, ``float``, a NumPy scalar) or
    a concrete 0-d integer or floating NumPy or JAX array (``jnp.float32(-2.0)``); not a bool,
    not traced. The range is checked by the caller.

    Raises:
        TypeError: a traced value (under ``jax.jit``; it must be static: it selects the kernel's
            gate), an array that is not 0-d, a bool or anything else that is not a real number;
            the message names the type.
    """
    lo, hi = LOWER_BOUND_RANGE
    expected = f"lower_bound: expected a Python float (a static number) in [{lo:g}, {hi:g})"
    if isinstance(lb, jax.core.Tracer):
        raise TypeError(
            f"{expected}, got a traced {_type_name(lb)} (it must be static: it selects the "
            "kernel's gate)"
        )
    if isinstance(lb, bool | np.bool_):
        raise TypeError(f"{expected}, got the bool {lb!r}")
    if isinstance(lb, numbers.Real):
        return float(lb)
    if hasattr(lb, "dtype") and hasattr(lb, "shape"):
        if tuple(lb.shape) != ():
            raise TypeError(f"{expected}, got a {_type_name(lb)} array (not a scalar)")
        real = jax.numpy.issubdtype(lb.dtype, jax.numpy.floating) or jax.numpy.issubdtype(
            lb.dtype, jax.numpy.integer
        )
        if not real:  # bool, complex, ...
            raise TypeError(f"{expected}, got a {_type_name(lb)} (not a real number)")
        return float(lb)
    raise TypeError(f"{expected}, got a {_type_name(lb)}: {lb!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class Activations:
    """The activations applied to the raw inputs inside the op (``Activations()``: none).

    Attributes:
        qk_l2norm: q and k divided by ``sqrt(sum over dk of x^2 + L2NORM_EPS)``.
        gate: the gate activation of g (:class:`GateMode`).
        lower_bound: the bound of :attr:`GateMode.LOWER_BOUND`, in ``[-5, 0)`` (any concrete
            real scalar, stored as a float: :func:`static_lower_bound`); None otherwise.
        bw_sigmoid: ``b = sigmoid(b)``, ``w = sigmoid(w)``.
        neg_eigval: ``b = 2 * sigmoid(b)`` instead (erase eigenvalues down to -1); needs
            ``bw_sigmoid``.
    """

    #: :data:`A_LOG_RANGE`, for the backends (which import only :mod:`gdn2core.plugin`).
    A_LOG_RANGE: ClassVar[tuple[float, float]] = A_LOG_RANGE

    qk_l2norm: bool = False
    gate: GateMode = GateMode.NONE
    lower_bound: float | None = None
    bw_sigmoid: bool = False
    neg_eigval: bool = False

    def __post_init__(self) -> None:
        if self.gate == GateMode.LOWER_BOUND:
            lo, hi = LOWER_BOUND_RANGE
            lb = static_lower_bound(self.lower_bound)
            if not lo <= lb < hi:
                raise ValueError(f"lower_bound: expected a float in [{lo:g}, {hi:g}), got {lb!r}")
            object.__setattr__(self, "lower_bound", lb)
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
            lower_bound: a static real number in ``[-5, 0)`` (with ``use_gate_in_kernel``) or
                None.

        Returns:
            The :class:`Activations`.

        Raises:
            TypeError: a flag that is not a bool; a ``lower_bound`` that is not a static real
                scalar (:func:`static_lower_bound`).
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
        dt_bias: ``(H, dk)`` in the state dtype, with the softplus gate (and with
            ``lower_bound`` when given); differentiable.
        continues: ``(N,)`` bool, with ``cu_seqlens`` in a forward (never a trainable call):
            sequence ``n`` continues from the state the sequence before it left, and its
            ``h0[n]`` is not read (the ragged op cuts a request into such pieces to store the
            states between them). Set only by the core, for backends that declare
            ``Capabilities.continued``; not a keyword of the public functions.
    """

    segment_ids: Any = None
    cu_seqlens: Any = None
    A_log: Any = None
    dt_bias: Any = None
    continues: Any = None


class FeatureArgs(TypedDict, total=False):
    """The keywords of the model features, shared by the ops and their references (fla's names;
    ``docs/operator.md``, section Model features). Every key is optional; an absent one takes its
    default in :data:`FEATURE_DEFAULTS`.

    Keys:
        segment_ids: ``(B, T)`` integers, packed sequences: a sequence starts at token 0 and
            wherever the id differs from the previous token's; the state is reset to zero at
            every start except token 0, where ``h0`` enters. Not with ``cu_seqlens``.
        cu_seqlens: ``(N + 1,)`` integers, fla's variable-length convention (B = 1): sequence
            ``n`` is tokens ``cu_seqlens[n]:cu_seqlens[n + 1]``, from ``h0[n]`` to
            ``h_final[n]``.
        use_qk_l2norm_in_kernel: q and k are divided by ``sqrt(sum over dk of x^2 + 1e-6)``.
        use_gate_in_kernel: g is raw: ``g = -exp(A_log) * softplus(g + dt_bias)`` per head and
            channel, or with ``lower_bound``: ``g = lower_bound * sigmoid(exp(A_log) * (g +
            dt_bias))`` (fla's safe gate).
        A_log: ``(Hg,)``, with ``use_gate_in_kernel``; differentiable.
        dt_bias: ``(Hg, dk)``, with ``use_gate_in_kernel`` (optional with ``lower_bound``: absent
            means 0), or ``(Hg,)`` with a scalar ``g`` (one bias per head); differentiable.
        lower_bound: a static real number in ``[-5, 0)``: the bounded gate (only with
            ``use_gate_in_kernel``).
        use_bw_sigmoid_in_kernel: b and w are raw: ``b = sigmoid(b)``, ``w = sigmoid(w)``.
        allow_neg_eigval: ``b = 2 * sigmoid(b)`` (erase eigenvalues down to -1); needs
            ``use_bw_sigmoid_in_kernel``.
    """

    segment_ids: Any
    cu_seqlens: Any
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    A_log: Any
    dt_bias: Any
    lower_bound: float | None
    use_bw_sigmoid_in_kernel: bool
    allow_neg_eigval: bool


#: The default of every key of :class:`FeatureArgs` (a plain call).
FEATURE_DEFAULTS: Final[dict[str, Any]] = {
    "segment_ids": None,
    "cu_seqlens": None,
    "use_qk_l2norm_in_kernel": False,
    "use_gate_in_kernel": False,
    "A_log": None,
    "dt_bias": None,
    "lower_bound": None,
    "use_bw_sigmoid_in_kernel": False,
    "allow_neg_eigval": False,
}
#: The keys that mark packed sequences (the decode op has none: each sequence has its own slot).
PACKED_ARGS: Final = ("segment_ids", "cu_seqlens")


def as_index_array(name: str, x: Any) -> Any:
    """An index argument (``segment_ids``, ``cu_seqlens``, ``state_indices``) as an array: a list
    or tuple becomes ``jnp.asarray(x)``; anything else is returned as is (its checks follow).

    Raises:
        TypeError: a list or tuple that is not a rectangular nest of integers.
    """
    if not isinstance(x, list | tuple):
        return x
    try:
        return jax.numpy.asarray(x)
    except (TypeError, ValueError, OverflowError) as err:
        raise TypeError(
            f"{name}: expected an integer array or a (nested) list of integers, got a "
            f"{type(x).__name__} that is not one ({err})"
        ) from None


@dataclasses.dataclass(frozen=True)
class Features:
    """The model features of one call, parsed once from its keywords and passed down: the
    activations (static) and the feature arrays (:class:`OpExtras`, what a backend receives).

    Attributes:
        activations: the fused activations.
        extras: ``segment_ids``, ``cu_seqlens``, ``A_log``, ``dt_bias`` as given (None: absent).
    """

    activations: Activations = NO_ACTIVATIONS
    extras: OpExtras = OpExtras()

    @classmethod
    def parse(cls, kwargs: dict[str, Any], *, op: str, packed: bool = True) -> Features:
        """The features of a public call's ``**features`` keywords.

        Args:
            kwargs: the keywords (a subset of :class:`FeatureArgs`).
            op: the public function's name, for the errors.
            packed: whether the op takes packed sequences (``segment_ids``, ``cu_seqlens``).

        Returns:
            The validated features.

        Raises:
            TypeError: a keyword the op does not take (with the closest known name), or a flag
                that is not a bool.
            ValueError: inconsistent activation options (see :meth:`Activations.from_options`).
        """
        known = [n for n in FEATURE_DEFAULTS if packed or n not in PACKED_ARGS]
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, [*known, *PACKED_ARGS], n=1)
                hint = f"; did you mean {close[0]!r}?" if close and close[0] in known else ""
                if name in PACKED_ARGS:
                    hint = f" ({op} has no packed sequences: each sequence has its own slot)"
                raise TypeError(f"{op}() got an unexpected keyword argument {name!r}{hint}")
        args = {**FEATURE_DEFAULTS, **kwargs}
        activations = Activations.from_options(
            args["use_qk_l2norm_in_kernel"],
            args["use_gate_in_kernel"],
            args["lower_bound"],
            args["use_bw_sigmoid_in_kernel"],
            args["allow_neg_eigval"],
        )
        seg, cu = (as_index_array(n, args[n]) for n in PACKED_ARGS)  # lists become arrays
        extras = OpExtras(seg, cu, args["A_log"], args["dt_bias"])
        return cls(activations, extras)
