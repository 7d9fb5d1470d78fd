"""The jax_ref backend: the chunkwise WY algorithm in pure JAX, the fallback on every platform.

Its config is :class:`~gdn2_jax_ref.config.JaxRefConfig` (the core fields plus the score sub-chunk
``bc``, the WY micro-block ``wy_block`` and ``clip``), read through ``JaxRefConfig.from_config``: a
core ``KernelConfig`` gets the blocking derived from ``bt``; another backend's config class is
refused by ``supports()`` / ``supports_decode()`` with its name.
"""

from __future__ import annotations

import jax

from gdn2_jax_ref.config import JaxRefConfig
from gdn2_jax_ref.decode import gdn2_jax_decode
from gdn2_jax_ref.forward import gdn2_chunk_forward, gdn2_chunk_forward_chunk_states
from gdn2_jax_ref.params import ChunkParams
from gdn2_jax_ref.vjp import gdn2_chunk_trainable
from gdn2core.plugin import (
    YES,
    Backend,
    Capabilities,
    DecodeSpec,
    KernelConfig,
    OpExtras,
    OpSpec,
    Verdict,
)


def _config_verdict(config: KernelConfig) -> Verdict:
    """Whether ``config`` reads as a :class:`JaxRefConfig` (its class, and a core ``bt`` with a
    blocking: ``bt == 2 * bc``)."""
    refusal = JaxRefConfig.refusal(config)
    if refusal:
        return Verdict(False, refusal)
    if config.bt % 2:
        return Verdict(False, f"bt={config.bt}: jax_ref needs an even bt (bt == 2 * bc)")
    return YES


def _packing(extras: OpExtras | None) -> tuple[jax.Array | None, jax.Array | None]:
    """``(segment_ids, cu_seqlens)`` of the call (each None when absent)."""
    if extras is None:
        return None, None
    return extras.segment_ids, extras.cu_seqlens


class JaxRefBackend(Backend):
    """Any dk/dv, float32/bfloat16/float64, trainable, decode and chunk states; always
    available. Packed sequences by segment ids (resets anywhere, no padding) and by cu_seqlens
    (one h0/h_final per sequence; each sequence from a chunk boundary, see
    :mod:`gdn2_jax_ref.varlen`). The core applies fused activations in XLA and resolves grouped
    value heads before the call."""

    name = "jax_ref"
    priority = 100
    capabilities = Capabilities(
        segments=True, varlen=True, decode=True, chunk_states=True, continued=True,
        float32_decay=True,
    )  # fmt: skip

    def supports(self, spec: OpSpec, config: KernelConfig) -> Verdict:
        """A core config with an even ``bt``, or a :class:`JaxRefConfig`; not another backend's
        config class (``config: expected a KernelConfig or JaxRefConfig, got ...``)."""
        del spec
        return _config_verdict(config)

    def supports_decode(self, spec: DecodeSpec, config: KernelConfig) -> Verdict:
        """Decode reads no config, but another backend's config class is refused all the same."""
        del spec
        refusal = JaxRefConfig.refusal(config)
        return Verdict(False, refusal) if refusal else YES

    def forward(
        self,
        q,
        k,
        v,
        w,
        b,
        g,
        h0,
        *,
        spec: OpSpec,
        config: KernelConfig,
        extras: OpExtras | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """The chunked forward (see :class:`gdn2core.plugin.Backend`)."""
        params = ChunkParams.from_spec(spec, config)
        segment_ids, cu_seqlens = _packing(extras)
        continues = None if extras is None else extras.continues
        o, h_final, _ = gdn2_chunk_forward(
            q, k, v, w, b, g, h0, params, segment_ids=segment_ids, cu_seqlens=cu_seqlens,
            continues=continues,
        )  # fmt: skip
        return o, h_final.astype(h0.dtype)

    def forward_trainable(
        self,
        q,
        k,
        v,
        w,
        b,
        g,
        h0,
        *,
        spec: OpSpec,
        config: KernelConfig,
        extras: OpExtras | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """The chunked forward with the hand-derived backward (``vjp.py``)."""
        params = ChunkParams.from_spec(spec, config)
        segment_ids, cu_seqlens = _packing(extras)
        o, h_final = gdn2_chunk_trainable(q, k, v, w, b, g, h0, params, segment_ids, cu_seqlens)
        return o, h_final.astype(h0.dtype)

    def forward_chunk_states(
        self,
        q,
        k,
        v,
        w,
        b,
        g,
        h0,
        *,
        spec: OpSpec,
        config: KernelConfig,
        extras: OpExtras | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The chunked forward and every chunk-entry state (see
        :meth:`gdn2core.plugin.Backend.forward_chunk_states`; never packed, and the core applies
        the activations, so ``extras`` carries nothing here)."""
        del extras
        params = ChunkParams.from_spec(spec, config)
        o, h_final, chunks = gdn2_chunk_forward_chunk_states(q, k, v, w, b, g, h0, params)
        return o, h_final.astype(h0.dtype), chunks.astype(h0.dtype)

    def decode(
        self, q, k, v, w, b, g, state, slots, *, spec: DecodeSpec, config: KernelConfig
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Gather the slots, run the tokens, scatter the states back (``decode.py``; see
        :meth:`gdn2core.plugin.Backend.decode`)."""
        del config
        return gdn2_jax_decode(q, k, v, w, b, g, state, slots, spec)
