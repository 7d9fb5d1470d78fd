"""``KernelConfig``: the blocking and numerics knobs every chunked backend reads, and its presets.

Fields (names and sections as in ``docs/algorithm.md``):

- ``bt``: chunk length C. Cost per token grows with C (section 9); the TPU MXU wants C >= 64.
- ``bc``: sub-chunk c of the decay-safe score scheme (section 5.1): diagonal c x c blocks are formed
  pairwise with masked exponents, off-diagonal blocks as matmuls through a reference row.
  Fixed to ``bt == 2 * bc``: two sub-chunks per chunk.
- ``mb``: micro-block of the blocked WY inverse (section 4, F5): diagonal mb x mb blocks by row
  recursion, the rest by matmuls. ``bc % mb == 0``.
- ``clip``: guard on any positive-exponent factor (section 5.2). The default scheme forms only
  non-positive exponents, so the clip never binds; it is a NaN guard, not an accuracy knob.
- ``wy_eps``: damping of the WY system, ``T = ((1 + wy_eps) I + A_kk)^-1`` (section 5.3).
  0 is the exact operator.
- ``interpret``: run Pallas kernels in TPU interpret mode (``pltpu.InterpretParams()``) on the CPU.
  Only the Pallas backend reads it; it is an explicit testing option.

``bc``, ``mb`` and ``clip`` are read by the pure-JAX chunked backend (jax_ref); the Pallas kernels
form their scores and WY inverse by levels (docs/algorithm.md) and read only ``bt`` and ``wy_eps``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class KernelConfig(BaseModel):
    """Frozen and hashable, so that it can be a static argument of ``jax.jit``.

    Strictly typed (``bt="64"`` and ``clip=True`` are refused, not converted), and
    :meth:`model_copy` validates its updates like the constructor.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    bt: int = Field(64, ge=2, description="chunk length C")
    bc: int = Field(32, ge=1, description="score sub-chunk c; bt == 2 * bc")
    mb: int = Field(16, ge=1, description="WY solver micro-block; bc % mb == 0")
    clip: float = Field(60.0, gt=0.0, description="guard on positive exponents (never binds)")
    wy_eps: float = Field(0.0, ge=0.0, lt=1.0, description="WY damping; 0 is exact")
    interpret: bool = Field(False, description="Pallas: run kernels in TPU interpret mode")

    @model_validator(mode="after")
    def _check_blocking(self) -> Self:
        if self.bt != 2 * self.bc:
            raise ValueError(
                f"bt must equal 2 * bc (two sub-chunks per chunk): got bt={self.bt}, bc={self.bc}"
            )
        if self.bc % self.mb != 0:
            raise ValueError(
                f"bc must be a multiple of mb (whole solver micro-blocks): got bc={self.bc}, "
                f"mb={self.mb}"
            )
        return self

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy with ``update`` applied, validated like the constructor.

        Args:
            update: fields to change.
            deep: accepted for pydantic compatibility (the fields are immutable scalars).

        Returns:
            The new config.

        Raises:
            pydantic.ValidationError: an updated field is invalid or unknown.
        """
        del deep
        return type(self).model_validate({**self.model_dump(), **(update or {})})


# Presets. Forward FLOPs per token and head (docs/algorithm.md section 9, K = V = 128):
#   6CK + 4CV + C^2/3 + 6KV  ->  C=32: 139.6k,  C=64: 181.6k,  C=128: 267.6k,  C=256: 447.8k.
# The seed's bt = 256 costs 2.5x the forward FLOPs of bt = 64 for no accuracy gain, so no preset
# uses it. All presets keep wy_eps = 0 (the exact operator).
KAGGLE_SMALL: Final = KernelConfig(bt=32, bc=16, mb=8)
"""C=32: least work per token (0.77x of C=64); for short sequences and small head sizes, where a
64-token chunk would be mostly padding, and on CPU where MXU width does not matter."""

KAGGLE_MEDIUM: Final = KernelConfig(bt=64, bc=32, mb=16)
"""C=64 (the default): the balance point of section 9: 181.6 kFLOP/token/head forward, 64x128
tiles on the MXU, and 64 sequential steps at T=4096."""

KAGGLE_LARGE: Final = KernelConfig(bt=128, bc=64, mb=16)
"""C=128: fills v5e's 128-wide MXU and halves the sequential steps, at +47% forward FLOPs over
C=64; for long sequences where the serial chunk loop dominates."""

DEFAULT_CONFIG: Final = KAGGLE_MEDIUM

PRESETS: Final = {
    "KAGGLE_SMALL": KAGGLE_SMALL,
    "KAGGLE_MEDIUM": KAGGLE_MEDIUM,
    "KAGGLE_LARGE": KAGGLE_LARGE,
}
