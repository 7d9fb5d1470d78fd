"""A test-only in-process backend for the layer tests: the token-serial reference, named."""

from __future__ import annotations

import pytest

import gdn2core
from gdn2core import Backend, Capabilities, Verdict
from gdn2core.reference import gdn2_token_serial_reference


class LayerTestReference(Backend):
    name = "layer_test_reference"
    priority = 0
    capabilities = Capabilities()
    calls = 0

    def auto_selectable(self):
        return Verdict(False, "test backend: only used when named")

    def forward(self, q, k, v, w, b, g, h0, *, spec, config):
        type(self).calls += 1
        return gdn2_token_serial_reference(q, k, v, w, b, g, spec.scale, h0)


@pytest.fixture
def ref_backend():
    gdn2core.register_backend(LayerTestReference(), replace=True)
    yield LayerTestReference
    gdn2core.unregister_backend(LayerTestReference.name)
