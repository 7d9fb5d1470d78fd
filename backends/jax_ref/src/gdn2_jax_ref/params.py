"""Static parameters of one chunkwise call: scale, blocking, damping, clip, accumulation dtype.

A frozen, hashable dataclass, so it can be a ``nondiff_argnums`` argument of the custom VJP and a
static argument of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax

from gdn2_jax_ref.config import JaxRefConfig
from gdn2core.plugin import KernelConfig, OpSpec

#: Every contraction runs at full precision of its operands (the WY solve and the state must be
#: accurate; on TPU/GPU the default f32 matmul precision is lower). Free on CPU.
einsum = functools.partial(jnp.einsum, precision=lax.Precision.HIGHEST)


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkParams:
    """What the chunkwise algorithm needs besides the arrays (names as in docs/algorithm.md)."""

    scale: float
    bt: int  # chunk length C
    bc: int  # score sub-chunk c (diagonal c x c blocks pairwise)
    wy_block: int  # WY solver micro-block (mb in docs/algorithm.md)
    wy_eps: float  # T = ((1 + wy_eps) I + A_kk)^-1
    clip: float  # guard on reference-split exponents (never binds for g <= 0)
    acc: str  # accumulation dtype: "float32", or "float64" for float64 inputs

    @classmethod
    def from_spec(cls, spec: OpSpec, config: KernelConfig) -> ChunkParams:
        """The parameters of a call of ``spec`` under ``config``, read as a
        :class:`~gdn2_jax_ref.config.JaxRefConfig` (a core config gets the derived blocking).

        Raises:
            TypeError: ``config`` is another backend's config class.
            pydantic.ValidationError: a core config's ``bt`` has no jax_ref blocking (odd).
        """
        config = JaxRefConfig.from_config(config)
        acc = "float64" if spec.dtype == "float64" else "float32"
        return cls(
            scale=float(spec.scale),
            bt=int(config.bt),
            bc=int(config.bc),
            wy_block=int(config.wy_block),
            wy_eps=float(config.wy_eps),
            clip=float(config.clip),
            acc=acc,
        )

    @property
    def acc_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.acc)
