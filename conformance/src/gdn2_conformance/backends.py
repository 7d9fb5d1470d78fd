"""The token-serial reference behind the :class:`~gdn2core.plugin.Backend` interface.

For tests, for the multi-device checks and for reports that need a backend that is right by
construction (autodiff gradients, any shape, slow). Named only: ``backend="auto"`` never picks it.
"""

from __future__ import annotations

import dataclasses

from gdn2core.backend import Backend, Capabilities
from gdn2core.features.gva import repeat_keys_of
from gdn2core.ops.decode.reference import gdn2_decode_reference
from gdn2core.ops.forward.reference import token_serial


class ReferenceBackend(Backend):
    """``gdn2_token_serial_reference`` as a backend.

    Args:
        name: the name to register it under (default ``"token_serial"``).
        priority: its priority.
        capabilities: what it claims (default: everything, named only: packed sequences of both
            kinds and fused activations, which it applies token by token, the decode op, scalar gates
            and a float32 g beside bfloat16 inputs).
    """

    name = "token_serial"
    priority = 0
    capabilities = Capabilities(
        auto=False,
        segments=True,
        varlen=True,
        fused_activations=True,
        decode=True,
        scalar_gates=True,
        float32_decay=True,
    )

    def __init__(
        self,
        name: str | None = None,
        *,
        priority: int | None = None,
        capabilities: Capabilities | None = None,
    ):
        if name is not None:
            self.name = name
        if priority is not None:
            self.priority = priority
        if capabilities is not None:
            self.capabilities = capabilities

    def forward(self, q, k, v, w, b, g, h0, *, spec, config, extras=None):
        """The reference's ``(o, h_final)`` (see :class:`~gdn2core.plugin.Backend`); q, k of
        ``spec.heads / spec.key_groups`` heads (``capabilities.grouped_keys``) repeated here."""
        del config
        if spec.key_groups > 1:
            q, k = repeat_keys_of(q, k, spec.key_groups)
            spec = dataclasses.replace(spec, key_groups=1)
        return token_serial(spec, q, k, v, w, b, g, h0, extras)

    def decode(self, q, k, v, w, b, g, state, slots, *, spec, config):
        """The decode reference (see :meth:`~gdn2core.plugin.Backend.decode`)."""
        del config
        return gdn2_decode_reference(
            q, k, v, w, b, g, state, slots, spec.scale, return_token_states=spec.token_states
        ) + (() if spec.token_states else (None,))
