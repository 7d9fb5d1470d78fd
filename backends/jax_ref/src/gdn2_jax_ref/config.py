"""``JaxRefConfig``: jax_ref's own config, the core :class:`~gdn2core.plugin.KernelConfig` plus the
knobs of the chunkwise algorithm only this backend has (names and sections as in
``docs/algorithm.md``):

- ``bc``: sub-chunk c of the decay-safe score scheme (section 5.1): diagonal c x c blocks are formed
  pairwise with masked exponents, off-diagonal blocks as matmuls through a reference row.
  Fixed to ``bt == 2 * bc``: two sub-chunks per chunk.
- ``wy_block`` (the seed's ``mb``): micro-block of the blocked WY inverse (section 4, F5):
  diagonal ``wy_block x wy_block`` blocks by row recursion, the rest by matmuls.
  ``bc % wy_block == 0``.
- ``clip``: guard on any positive-exponent factor (section 5.2). The default scheme forms only
  non-positive exponents, so the clip never binds; it is a NaN guard, not an accuracy knob.

Left out, ``bc`` and ``wy_block`` follow from ``bt`` (:func:`derived_blocking`):
``JaxRefConfig(bt=32)`` is ``JaxRefConfig(bt=32, bc=16, wy_block=8)``. The backend reads its config
only through :meth:`JaxRefConfig.from_config`: a core ``KernelConfig`` gets the derived blocking and
the default clip, and another backend's config class is refused by name.
"""

from __future__ import annotations

from typing import Any, Final, Self

from pydantic import Field, model_validator

from gdn2core.plugin import KernelConfig

#: The largest WY micro-block the derived blocking uses.
MAX_DERIVED_WY_BLOCK: Final = 16


def derived_blocking(bt: int) -> tuple[int, int]:
    """``(bc, wy_block)`` for a chunk of ``bt`` tokens when they are not given.

    ``bc = bt // 2`` (two sub-chunks); ``wy_block`` the largest divisor of ``bc`` not above
    ``min(16, bc // 2)`` (two or more micro-blocks per sub-chunk, at most 16 wide). The seed's
    presets: bt=32 -> (16, 8), bt=64 -> (32, 16), bt=128 -> (64, 16); small test chunks: bt=16 ->
    (8, 4), bt=8 -> (4, 2).

    Args:
        bt: the chunk length (an odd one gives a ``bc`` the validator then refuses).

    Returns:
        ``(bc, wy_block)``.
    """
    bc = max(1, bt // 2)
    cap = max(1, min(MAX_DERIVED_WY_BLOCK, bc // 2))
    return bc, max(d for d in range(1, cap + 1) if bc % d == 0)


class JaxRefConfig(KernelConfig):
    """The core fields (``bt``, ``wy_eps``, ``interpret``) plus ``bc``, ``wy_block`` and ``clip``
    (module docstring). Frozen, hashable, strict and closed like the core class."""

    bc: int = Field(32, ge=1, description="score sub-chunk c; bt == 2 * bc")
    wy_block: int = Field(16, ge=1, description="WY solver micro-block; bc % wy_block == 0")
    clip: float = Field(60.0, gt=0.0, description="guard on positive exponents (never binds)")

    @model_validator(mode="before")
    @classmethod
    def _derive_blocking(cls, data: Any) -> Any:
        """Fill in ``bc`` and ``wy_block`` from ``bt`` (:func:`derived_blocking`) when left out."""
        if not isinstance(data, dict) or ("bc" in data and "wy_block" in data):
            return data
        bt = data.get("bt", cls.model_fields["bt"].default)
        if type(bt) is not int:  # left to the field's own (strict) validation
            return data
        bc = data.get("bc", derived_blocking(bt)[0])
        filled = {"bc": bc}
        if type(bc) is int and bc >= 1:
            filled["wy_block"] = derived_blocking(2 * bc)[1]
        return {**filled, **data}

    @model_validator(mode="after")
    def _check_blocking(self) -> Self:
        if self.bt != 2 * self.bc:
            raise ValueError(
                f"bt must equal 2 * bc (two sub-chunks per chunk): got bt={self.bt}, bc={self.bc}"
            )
        if self.bc % self.wy_block != 0:
            raise ValueError(
                f"bc must be a multiple of wy_block (whole solver micro-blocks): got bc={self.bc}, "
                f"wy_block={self.wy_block}"
            )
        return self
