"""The typed operator spec: shapes, dtypes and scale derived from (and validated against) inputs.

The contract is ``docs/operator.md``: q, k, b, g are ``(B, T, H, dk)``; v, w are ``(B, T, H, dv)``;
the optional initial state h0 is float32 ``(B, H, dk, dv)``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np

#: Input names in the public argument order, with the axis that holds their channel size.
KEY_AXIS_INPUTS: tuple[str, ...] = ("q", "k", "b", "g")
VALUE_AXIS_INPUTS: tuple[str, ...] = ("v", "w")

SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float64")


@dataclasses.dataclass(frozen=True, slots=True)
class OpSpec:
    """Static description of one GDN-2 call; hashable, so it can key caches and jit statics."""

    batch: int
    seq_len: int
    heads: int
    dk: int
    dv: int
    dtype: str  # common floating dtype of q, k, v, w, b, g ("float32", "bfloat16", "float64")
    scale: float

    @property
    def token_heads(self) -> int:
        """``B * T * H``."""
        return self.batch * self.seq_len * self.heads

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
    ) -> OpSpec:
        """Validate the inputs of the operator and derive the spec.

        Args:
            q, k, v, w, b, g: the operator's inputs (arrays or ``ShapeDtypeStruct``).
            scale: the query scale, a real number (None: ``dk ** -0.5``).
            h0: the optional initial state.

        Returns:
            The spec.

        Raises:
            ValueError: a shape (or a non-finite scale), naming the argument, the expected and the
                actual value.
            TypeError: a dtype or a type, likewise.
        """
        arrays = {"q": q, "k": k, "v": v, "w": w, "b": b, "g": g}
        for name, x in arrays.items():
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
            if len(x.shape) != 4:
                axes = "(B, T, H, dk)" if name in KEY_AXIS_INPUTS else "(B, T, H, dv)"
                raise ValueError(
                    f"{name}: expected rank 4 {axes}, got rank {len(x.shape)} shape "
                    f"{tuple(x.shape)}"
                )
        bsz, seq, heads, dk = (int(s) for s in q.shape)
        dv = int(v.shape[3])
        for name in KEY_AXIS_INPUTS:
            _expect_shape(name, arrays[name].shape, (bsz, seq, heads, dk), "(B, T, H, dk)")
        for name in VALUE_AXIS_INPUTS:
            _expect_shape(name, arrays[name].shape, (bsz, seq, heads, dv), "(B, T, H, dv)")
        if min(bsz, heads, dk, dv) < 1:
            raise ValueError(
                f"q/v: B, H, dk and dv must be positive, got B={bsz}, H={heads}, dk={dk}, dv={dv}"
            )

        dtype = check_common_dtype(arrays)

        if h0 is not None:
            if not hasattr(h0, "shape"):
                raise TypeError(f"h0: expected an array or None, got {type(h0).__name__}")
            _expect_shape("h0", h0.shape, (bsz, heads, dk, dv), "(B, H, dk, dv)")
            h0_dtype = jnp.dtype(h0.dtype)
            allowed = ("float32", "float64") if dtype == "float64" else ("float32",)
            if h0_dtype.name not in allowed:
                raise TypeError(f"h0: expected dtype {' or '.join(allowed)}, got {h0_dtype.name}")

        scale = check_scale(scale, dk)
        return cls(
            batch=bsz,
            seq_len=seq,
            heads=heads,
            dk=dk,
            dv=dv,
            dtype=dtype,
            scale=scale,
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
