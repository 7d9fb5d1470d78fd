"""Argument checks shared by the ops' specs: the common floating dtype, the query scale, shapes, and
the state dtype of a call. The bottom layer of the core: it imports nothing of gdn2core.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax.numpy as jnp

SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float64")


def state_dtype(dtype) -> jnp.dtype:
    """The precision of the state and of every accumulator for inputs of ``dtype``.

    Args:
        dtype: the input dtype.

    Returns:
        float64 for float64 inputs, else float32.
    """
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


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


def is_float32_decay(g_dtype: Any, dtype: Any) -> bool:
    """Whether a ``g`` of ``g_dtype`` beside inputs of ``dtype`` is the float32 log decay the
    operator keeps as it is (float32 beside bfloat16)."""
    return jnp.dtype(g_dtype) == jnp.float32 and jnp.dtype(dtype) == jnp.bfloat16


def check_decay_dtype(g: Any, dtype: str) -> bool:
    """Whether ``g`` is a float32 log decay beside bfloat16 inputs (fla's layers compute the
    decay in float32 and its kernels keep it so); else ``g`` must have the inputs' ``dtype``.

    Args:
        g: the log decay (anything with a ``dtype``).
        dtype: the common dtype of the other token inputs.

    Returns:
        True for float32 ``g`` beside bfloat16 inputs, False for ``g`` in ``dtype``.

    Raises:
        TypeError: any other dtype of ``g``, naming both accepted ones.
    """
    g_dtype = jnp.dtype(g.dtype).name
    if g_dtype == dtype:
        return False
    if is_float32_decay(g_dtype, dtype):
        return True
    wanted = f"{dtype} (that of q, k, v, w, b)"
    if dtype == "bfloat16":
        wanted += " or float32 (a log decay kept in float32)"
    raise TypeError(f"g: expected dtype {wanted}, got {g_dtype}")


def check_token_dtypes(arrays: dict[str, Any]) -> tuple[str, bool]:
    """The dtypes of an op's token inputs: one common floating dtype for every array but ``g``,
    which may instead be a float32 log decay beside bfloat16 inputs (:func:`check_decay_dtype`).

    Args:
        arrays: ``{"q": q, "k": k, ..., "g": g}`` (anything with a ``dtype``).

    Returns:
        ``(dtype, float32_decay)``: the common dtype's name and whether ``g`` is float32 beside
        bfloat16 inputs.

    Raises:
        TypeError: as :func:`check_common_dtype` and :func:`check_decay_dtype`.
    """
    dtype = check_common_dtype({n: x for n, x in arrays.items() if n != "g"})
    return dtype, check_decay_dtype(arrays["g"], dtype)


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


def expect_shape(name: str, actual: Any, expected: tuple[int, ...], axes: str) -> None:
    actual = tuple(int(s) for s in actual)
    if actual != expected:
        raise ValueError(f"{name}: expected shape {axes} = {expected}, got {actual}")
