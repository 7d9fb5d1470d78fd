"""Numerical diagnostics for backends: ``GDN2_FWD_DIAG=1`` reports per named stage.

Backends wrap intermediates in ``probe("stage name", x)``. With the variable unset this is the
identity and adds nothing to the traced program. With it set, a ``jax.debug.callback`` reports the
count of non-finite values and of values above ``LARGE`` in magnitude, through the ``gdn2core.diag``
logger (and stderr when no handler is configured). A probe never changes a value.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Final

import jax
import jax.numpy as jnp
import numpy as np

ENV_VAR: Final = "GDN2_FWD_DIAG"
LARGE: Final = 1e6

log = logging.getLogger("gdn2core.diag")


def enabled() -> bool:
    """Whether ``GDN2_FWD_DIAG`` is set, read at trace time (a jitted function keeps the setting
    it was traced with).

    Returns:
        True when diagnostics are on.
    """
    return os.environ.get(ENV_VAR, "").strip() not in ("", "0", "false", "False")


def _report(stage: str, nonfinite: np.ndarray, large: np.ndarray, absmax: np.ndarray) -> None:
    nonfinite, large, absmax = int(nonfinite), int(large), float(absmax)
    level = logging.WARNING if (nonfinite or large) else logging.INFO
    msg = (
        f"[gdn2 diag] {stage}: non-finite={nonfinite} above {LARGE:.0e}={large} "
        f"max|finite|={absmax:.3e}"
    )
    if log.hasHandlers():
        log.log(level, msg)
    else:
        print(msg, file=sys.stderr)


def probe[A: jax.Array](stage: str, x: A) -> A:
    """Report on ``x`` under ``GDN2_FWD_DIAG=1``.

    Args:
        stage: the name the report carries (e.g. ``"jax_ref o"``).
        x: the intermediate to inspect.

    Returns:
        ``x``, unchanged (the very object when diagnostics are off).
    """
    if not enabled():
        return x
    xf = jnp.asarray(x).astype(jnp.float32)
    finite = jnp.isfinite(xf)
    nonfinite = jnp.sum(~finite)
    large = jnp.sum(finite & (jnp.abs(xf) > LARGE))
    absmax = jnp.max(jnp.where(finite, jnp.abs(xf), 0.0), initial=0.0)
    jax.debug.callback(lambda a, b_, c: _report(stage, a, b_, c), nonfinite, large, absmax)
    return x
