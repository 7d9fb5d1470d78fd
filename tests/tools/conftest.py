"""In-process backends for the tools tests (registered per test, then removed): the reference
(right by construction) and a deliberately wrong one."""

from __future__ import annotations

import pytest

import gdn2core
from gdn2_conformance import ReferenceBackend


class PerturbedBackend(ReferenceBackend):
    """Deliberately wrong: the reference with 5% of the value added to o. The gate must reject it."""

    name = "test_perturbed"

    def forward(self, q, k, v, w, b, g, h0, *, spec, config):
        o, h = super().forward(q, k, v, w, b, g, h0, spec=spec, config=config)
        return o + 0.05 * v.astype(o.dtype), h


@pytest.fixture
def test_backends():
    backends = [ReferenceBackend("test_reference"), PerturbedBackend()]
    for be in backends:
        gdn2core.register_backend(be, replace=True)
    yield [be.name for be in backends]
    for be in backends:
        gdn2core.unregister_backend(be.name)
