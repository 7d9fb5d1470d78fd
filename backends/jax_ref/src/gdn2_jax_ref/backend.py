"""The jax_ref backend: chunked WY in pure JAX, the fallback on every platform."""

from gdn2core import Backend, Capabilities, Verdict


class JaxRefBackend(Backend):
    name = "jax_ref"
    priority = 100
    capabilities = Capabilities()

    def availability(self) -> Verdict:
        return Verdict(False, "not implemented yet")

    def forward(self, q, k, v, w, b, g, h0, *, spec, config):
        raise NotImplementedError("jax_ref: not implemented yet")
