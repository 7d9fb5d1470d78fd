"""The option set shared by the ops: how tokens form sequences (:class:`SegmentMode`), the fused
activations (:class:`Activations`, :class:`GateMode`) and the feature arrays a backend receives
(:class:`OpExtras`). The bottom layer of the core: it imports nothing of gdn2core.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from typing import Any, Final

import jax
import numpy as np

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
