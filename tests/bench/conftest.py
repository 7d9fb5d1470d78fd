"""Test-only in-process backends for the bench tests (registered per test, then removed)."""

from __future__ import annotations

import pytest

import gdn2core
from gdn2core import Backend, Capabilities
from gdn2core.reference import gdn2_token_serial_reference


class ReferenceBackend(Backend):
    """The token-serial reference behind the Backend interface (correct by construction)."""

    name = "test_reference"
    priority = 0
    capabilities = Capabilities()

    def auto_selectable(self):
        return gdn2core.Verdict(False, "test backend: only used when named")

    def forward(self, q, k, v, w, b, g, h0, *, spec, config):
        return gdn2_token_serial_reference(q, k, v, w, b, g, spec.scale, h0)


class PerturbedBackend(ReferenceBackend):
    """Deliberately wrong: the reference with 1% of the value added to o. The gate must reject it."""

    name = "test_perturbed"

    def forward(self, q, k, v, w, b, g, h0, *, spec, config):
        o, h = super().forward(q, k, v, w, b, g, h0, spec=spec, config=config)
        return o + 0.05 * v.astype(o.dtype), h


@pytest.fixture
def test_backends():
    backends = [ReferenceBackend(), PerturbedBackend()]
    for be in backends:
        gdn2core.register_backend(be, replace=True)
    yield [be.name for be in backends]
    for be in backends:
        gdn2core.unregister_backend(be.name)
