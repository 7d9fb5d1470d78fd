"""A test-only in-process backend for the layer tests: the token-serial reference, counting its
calls."""

from __future__ import annotations

import pytest

import gdn2core
from gdn2_conformance import ReferenceBackend


class LayerTestReference(ReferenceBackend):
    name = "layer_test_reference"
    calls = 0

    def forward(self, q, k, v, w, b, g, h0, *, spec, config, extras=None):
        type(self).calls += 1
        return super().forward(q, k, v, w, b, g, h0, spec=spec, config=config, extras=extras)


@pytest.fixture
def ref_backend():
    gdn2core.register_backend(LayerTestReference(), replace=True)
    yield LayerTestReference
    gdn2core.unregister_backend(LayerTestReference.name)
