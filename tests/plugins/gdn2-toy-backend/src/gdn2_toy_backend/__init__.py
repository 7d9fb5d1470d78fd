"""A third-party gdn2 backend: the token-serial recurrence, only for small key head sizes.

Its high priority and narrow capabilities let the tests see ``backend="auto"`` pick it when it
fits and pass over it (to the next backend) when it does not.
"""

from gdn2core import Backend, Capabilities, gdn2_token_serial_reference, hookimpl


class ToySerialBackend(Backend):
    name = "toy_serial"
    priority = 1000
    capabilities = Capabilities(dk=(4, 8), dtypes=("float32",))

    def forward(self, q, k, v, w, b, g, h0, *, spec, config):
        return gdn2_token_serial_reference(q, k, v, w, b, g, spec.scale, h0)


@hookimpl
def gdn2_backend():
    return ToySerialBackend()
