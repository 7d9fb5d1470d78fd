"""A subtly wrong backend: its outputs are exact, but the gradient of the log decay g is half the
true one (forward values cannot show it). The conformance kit must pass its forward and fail its
gradients."""

import jax

from gdn2_conformance import ReferenceBackend
from gdn2core.plugin import Capabilities, hookimpl


class HalfDecayGradient(ReferenceBackend):
    name = "wrong_grad"
    priority = 1
    capabilities = Capabilities(dtypes=("float32",), auto=False)

    def forward_trainable(self, q, k, v, w, b, g, h0, *, spec, config):
        g_half_grad = jax.lax.stop_gradient(g) + 0.5 * (g - jax.lax.stop_gradient(g))
        return self.forward(q, k, v, w, b, g_half_grad, h0, spec=spec, config=config)


@hookimpl
def gdn2_backend():
    return HalfDecayGradient()
