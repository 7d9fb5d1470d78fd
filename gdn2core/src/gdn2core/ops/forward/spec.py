"""The typed operator spec: shapes, dtypes, scale and the model features of one call, derived
from (and validated against) the inputs.

The contract is ``docs/operator.md``: q, k are ``(B, T, H, dk)``; v, w are ``(B, T, HV, dv)``
(``HV`` value heads, a multiple of ``H``: grouped value heads); b, g are ``(B, T, Hg, dk)`` with
``Hg`` either ``H`` or ``HV``; the optional initial state h0 is float32 ``(B, HV, dk, dv)``
(``(N, HV, dk, dv)`` with ``cu_seqlens``). The option types it carries (:class:`SegmentMode`,
:class:`Activations`) are :mod:`gdn2core.options`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from gdn2core.checks import check_scale, check_token_dtypes, expect_shape
from gdn2core.features.activations import check_gate_params
from gdn2core.features.segments import check_segments
from gdn2core.options import NO_ACTIVATIONS, Activations, GateMode, SegmentMode

#: Input names in the public argument order, with the axis that holds their channel size.
KEY_AXIS_INPUTS: tuple[str, ...] = ("q", "k", "b", "g")
VALUE_AXIS_INPUTS: tuple[str, ...] = ("v", "w")
#: The gates that may come as one value per head and token (rank 3), in the spec's order.
SCALAR_GATE_NAMES: tuple[str, ...] = ("w", "b", "g")


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
    dtype: str  # common floating dtype of q, k, v, w, b (and g) ("float32", "bfloat16", "float64")
    scale: float
    value_heads: int = 0  # HV: heads of v, w, the state and o (0: heads)
    gate_heads: int = 0  # heads of b and g: heads or value_heads (0: heads)
    segments: SegmentMode = SegmentMode.NONE
    n_seqs: int = 0  # N with cu_seqlens, else batch
    activations: Activations = NO_ACTIVATIONS
    continued: bool = False  # cu_seqlens pieces that continue a state (extras.continues)
    scalar_gates: tuple[str, ...] = ()  # of "w", "b", "g": given (B, T, heads), one per channel
    key_groups: int = 1  # a backend's view only (Capabilities.grouped_keys): q, k come with
    #   heads / key_groups heads, head j reading key head j // key_groups
    uniform_gate: bool = False  # a scalar g under a fused gate whose dt_bias is one per head (or
    #   absent): the activated g is the same on every channel (dt_bias reaches backends (Hg, dk))
    value_groups: int = 1  # a backend's view only (grouped value heads, b and g on the key heads):
    #   v, w and o are the caller's (B, T, value_groups H, dv / value_groups) reshaped, each head's
    #   dv channels value_groups value heads side by side; a backend may read them so (a hint:
    #   the arrays are the plain call's either way)
    float32_decay: bool = False  # g is float32 beside bfloat16 inputs (fla's layers compute the
    #   log decay in float32); a backend without Capabilities.float32_decay gets it cast to dtype

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
        if self.key_groups < 1 or self.heads % self.key_groups:
            raise ValueError(
                f"key_groups: expected a divisor of H={self.heads}, got {self.key_groups}"
            )
        if self.value_groups < 1 or self.dv % self.value_groups:
            raise ValueError(
                f"value_groups: expected a divisor of dv={self.dv}, got {self.value_groups}"
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
        per_head_dt_bias: bool = False,
    ) -> OpSpec:
        """Validate the inputs of the operator and derive the spec.

        Args:
            q, k, v, w, b, g: the operator's inputs (arrays or ``ShapeDtypeStruct``).
            scale: the query scale, a real number (None: ``dk ** -0.5``).
            h0: the optional initial state.
            segment_ids, cu_seqlens: the packed-sequence arguments (at most one).
            activations: the fused activations (None: none).
            A_log, dt_bias: the gate parameters (only with a fused gate).
            per_head_dt_bias: the caller takes ``dt_bias`` ``(Hg,)`` with a scalar ``g`` (and
                broadcasts it for the backends: ``features.activations.per_channel_bias``).

        Returns:
            The spec.

        Raises:
            ValueError: a shape or value (a non-finite scale, bad cu_seqlens...), naming the
                argument, the expected and the actual value.
            TypeError: a dtype or a type, likewise.
        """
        arrays = {"q": q, "k": k, "v": v, "w": w, "b": b, "g": g}
        for name, x in arrays.items():
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
            scalar_ok = name in SCALAR_GATE_NAMES and len(x.shape) == 3
            if len(x.shape) != 4 and not scalar_ok:
                axes = "(B, T, H, dk)" if name in KEY_AXIS_INPUTS else "(B, T, HV, dv)"
                if name in SCALAR_GATE_NAMES:
                    axes += " or rank 3 " + ("(B, T, Hg)" if name != "w" else "(B, T, HV)")
                raise ValueError(
                    f"{name}: expected rank 4 {axes}, got rank {len(x.shape)} shape "
                    f"{tuple(x.shape)}"
                )
        scalar_gates = tuple(n for n in SCALAR_GATE_NAMES if len(arrays[n].shape) == 3)
        bsz, seq, heads, dk = (int(s) for s in q.shape)
        vheads, dv = int(v.shape[2]), int(v.shape[3])
        expect_shape("k", k.shape, (bsz, seq, heads, dk), "(B, T, H, dk)")
        expect_shape("v", v.shape, (bsz, seq, vheads, dv), "(B, T, HV, dv)")
        if "w" in scalar_gates:
            expect_shape("w", w.shape, (bsz, seq, vheads), "(B, T, HV) (a scalar gate)")
        else:
            expect_shape("w", w.shape, (bsz, seq, vheads, dv), "(B, T, HV, dv)")
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
            want = expected
            if name in scalar_gates:  # one value per head and token: no channel axis
                want = f"(B, T, H) = {(bsz, seq, heads)}" + (
                    f" or (B, T, HV) = {(bsz, seq, vheads)}" if vheads != heads else ""
                )
                shape = (*shape, dk)
            if shape[:2] != (bsz, seq) or shape[3] != dk or shape[2] not in (heads, vheads):
                raise ValueError(f"{name}: expected shape {want}, got {tuple(arrays[name].shape)}")
        if int(g.shape[2]) != gheads:
            raise ValueError(
                f"g: expected the heads of b ({gheads}), got shape {tuple(int(s) for s in g.shape)}"
            )

        dtype, float32_decay = check_token_dtypes(arrays)

        segments, n_seqs = check_segments(segment_ids, cu_seqlens, bsz, seq)
        if h0 is not None:
            if not hasattr(h0, "shape"):
                raise TypeError(f"h0: expected an array or None, got {type(h0).__name__}")
            if segments == SegmentMode.CU_SEQLENS:
                expect_shape("h0", h0.shape, (n_seqs, vheads, dk, dv), "(N, HV, dk, dv)")
            else:
                axes = "(B, H, dk, dv)" if vheads == heads else "(B, HV, dk, dv)"
                expect_shape("h0", h0.shape, (bsz, vheads, dk, dv), axes)
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
        scalar_g = "g" in scalar_gates
        per_head = scalar_g and per_head_dt_bias
        check_gate_params(activations, A_log, dt_bias, gheads, dk, per_head=per_head)
        uniform_gate = (
            per_head
            and activations.gate != GateMode.NONE
            and (dt_bias is None or len(dt_bias.shape) == 1)
        )

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
            scalar_gates=scalar_gates,
            uniform_gate=uniform_gate,
            float32_decay=float32_decay,
        )
