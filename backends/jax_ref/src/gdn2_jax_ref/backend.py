"""The jax_ref backend: the chunkwise WY algorithm in pure JAX, the fallback on every platform."""

from __future__ import annotations

import jax

from gdn2_jax_ref.forward import gdn2_chunk_forward
from gdn2_jax_ref.params import ChunkParams
from gdn2_jax_ref.vjp import gdn2_chunk_trainable
from gdn2core.plugin import Backend, Capabilities, KernelConfig, OpSpec


class JaxRefBackend(Backend):
    """Any dk/dv, float32/bfloat16/float64, trainable; always available."""

    name = "jax_ref"
    priority = 100
    capabilities = Capabilities()

    def forward(
        self, q, k, v, w, b, g, h0, *, spec: OpSpec, config: KernelConfig
    ) -> tuple[jax.Array, jax.Array]:
        """The chunked forward (see :class:`gdn2core.plugin.Backend`)."""
        params = ChunkParams.from_spec(spec, config)
        o, h_final, _ = gdn2_chunk_forward(q, k, v, w, b, g, h0, params)
        return o, h_final.astype(h0.dtype)

    def forward_trainable(
        self, q, k, v, w, b, g, h0, *, spec: OpSpec, config: KernelConfig
    ) -> tuple[jax.Array, jax.Array]:
        """The chunked forward with the hand-derived backward (``vjp.py``)."""
        params = ChunkParams.from_spec(spec, config)
        o, h_final = gdn2_chunk_trainable(q, k, v, w, b, g, h0, params)
        return o, h_final.astype(h0.dtype)
