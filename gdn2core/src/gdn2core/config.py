"""``KernelConfig``: the knobs every backend honours, and its presets named for what they do.

Fields (names and sections as in ``docs/algorithm.md``):

- ``bt``: chunk length C. It is part of the op's contract, not only a blocking choice:
  ``gdn2_forward(..., return_chunk_states=True)`` returns the state entering every chunk of ``bt``
  tokens, so every backend must chunk at ``bt`` (or refuse the value in ``supports()``). Cost per
  token grows with C (section 9); the TPU MXU wants C >= 64.
- ``wy_eps``: damping of the WY system, ``T = ((1 + wy_eps) I + A_kk)^-1`` (section 5.3).
  0 is the exact operator.
- ``interpret``: run the kernels of a backend that declares ``Capabilities.interpret`` (Pallas) in
  interpret mode on a host that is not one of its platforms (a CPU, for tests). The core's
  verdict reads it; it is an explicit testing option.

A backend with knobs of its own subclasses :class:`KernelConfig` in its own distribution (jax_ref:
``gdn2_jax_ref.config.JaxRefConfig`` with the score sub-chunk, the WY solver micro-block and the
clip; pallas_tpu: ``gdn2_pallas_tpu.config.PallasTpuConfig``) and reads its config only through
:meth:`KernelConfig.from_config`: a core config gets that backend's defaults for its own knobs,
and another backend's config class is refused by name (``docs/backends.md``, "A backend's own
config").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Self

from pydantic import BaseModel, ConfigDict, Field


class KernelConfig(BaseModel):
    """The core kernel config: chunk length ``bt`` (part of the op's contract: chunk states come
    one per ``bt`` tokens), WY damping ``wy_eps`` and ``interpret`` (module docstring).

    Frozen and hashable, so that it can be a static argument of ``jax.jit`` (a subclass compares
    unequal to the core class with the same fields, so jit caches keep them apart).
    Strictly typed (``bt="64"`` and ``interpret=1`` are refused, not converted), unknown fields are
    refused, and :meth:`model_copy` validates its updates like the constructor.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    bt: int = Field(64, ge=2, description="chunk length C; chunk states come one per bt tokens")
    wy_eps: float = Field(0.0, ge=0.0, lt=1.0, description="WY damping; 0 is exact")
    interpret: bool = Field(False, description="run interpret-capable kernels in interpret mode")

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

    @classmethod
    def from_config(cls, config: object) -> Self:
        """``config`` as this class: how a backend reads the config of a call.

        Args:
            config: the call's config.

        Returns:
            ``config`` itself when it is already an instance of this class; for a core
            :class:`KernelConfig` (exactly that class), this class with the same core fields and
            its own defaults for the rest (a subclass may derive them from the core fields).

        Raises:
            TypeError: ``config`` is another class (another backend's config, or not a config):
                ``config: expected a KernelConfig or JaxRefConfig, got PallasTpuConfig``.
            pydantic.ValidationError: the core fields are invalid for this class.
        """
        if isinstance(config, cls):
            return config
        if type(config) is not KernelConfig:
            raise TypeError(cls.refusal(config))
        return cls.model_validate(config.model_dump())

    @classmethod
    def refusal(cls, config: object) -> str | None:
        """Why :meth:`from_config` refuses the class of ``config``, or None when it takes it.

        For a backend's ``supports()``: ``Verdict(False, reason)`` with this reason, so that
        ``backend="auto"`` passes over a backend given another backend's config.

        Args:
            config: the call's config.

        Returns:
            None, or ``config: expected a KernelConfig or <cls>, got <class of config>``.
        """
        if isinstance(config, cls) or type(config) is KernelConfig:
            return None
        expected = "a KernelConfig" + ("" if cls is KernelConfig else f" or {cls.__name__}")
        return f"config: expected {expected}, got {type(config).__name__}"


# Presets. Forward FLOPs per token and head (docs/algorithm.md section 9, K = V = 128):
#   6CK + 4CV + C^2/3 + 6KV  ->  C=32: 139.6k,  C=64: 181.6k,  C=128: 267.6k,  C=256: 447.8k.
# The seed's bt = 256 costs 2.5x the forward FLOPs of bt = 64 for no accuracy gain, so no preset
# uses it. All presets keep wy_eps = 0 (the exact operator). A backend derives its own knobs from
# bt (docs/backends.md, section 1b).
SHORT_CHUNKS: Final = KernelConfig(bt=32)
"""C=32: least work per token (0.77x of C=64); for short sequences and small head sizes, where a
64-token chunk would be mostly padding, and on CPU where MXU width does not matter."""

DEFAULT_CONFIG: Final = KernelConfig(bt=64)
"""C=64 (the default): the balance point of section 9: 181.6 kFLOP/token/head forward, 64x128
tiles on the MXU, and 64 sequential steps at T=4096."""

LONG_CHUNKS: Final = KernelConfig(bt=128)
"""C=128: fills v5e's 128-wide MXU and halves the sequential steps, at +47% forward FLOPs over
C=64; for long sequences where the serial chunk loop dominates."""

PRESETS: Final = {
    "SHORT_CHUNKS": SHORT_CHUNKS,
    "DEFAULT_CONFIG": DEFAULT_CONFIG,
    "LONG_CHUNKS": LONG_CHUNKS,
}
"""The presets by name (the choices of the tools' ``--config``)."""

# The seed's names (after the notebook host they were first tuned on), kept as aliases: the same
# objects as the presets above, not copies.
KAGGLE_SMALL: Final = SHORT_CHUNKS
"""Alias of :data:`SHORT_CHUNKS` (the seed's name)."""

KAGGLE_MEDIUM: Final = DEFAULT_CONFIG
"""Alias of :data:`DEFAULT_CONFIG` (the seed's name)."""

KAGGLE_LARGE: Final = LONG_CHUNKS
"""Alias of :data:`LONG_CHUNKS` (the seed's name)."""
