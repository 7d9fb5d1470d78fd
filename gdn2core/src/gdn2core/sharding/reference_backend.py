"""An in-process backend wrapping the token-serial reference, for tests and the mesh report while
no chunked backend is available. Register it with :func:`register_reference_backend`."""

from __future__ import annotations

from gdn2core.backend import Backend, Capabilities, Verdict
from gdn2core.reference import gdn2_token_serial_reference

NAME = "token_serial"


class TokenSerialBackend(Backend):
    """``gdn2_token_serial_reference`` as a backend (autodiff gradients). Never auto-selected."""

    name = NAME
    priority = 1
    capabilities = Capabilities()

    def auto_selectable(self) -> Verdict:
        return Verdict(False, "reference: only used when named")

    def forward(self, q, k, v, w, b, g, h0, *, spec, config):
        return gdn2_token_serial_reference(q, k, v, w, b, g, spec.scale, h0)


def register_reference_backend() -> str:
    """Register (or re-register) the reference backend; returns its name."""
    from gdn2core.registry import register_backend

    register_backend(TokenSerialBackend(), replace=True)
    return NAME
