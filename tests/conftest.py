"""Suite-wide setup: CPU-only JAX (libtpu is installed for compile checks and must not start)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (deviceless compiles) would log its failed device probes to /tmp/tpu_logs, ~1 GB a process.
os.environ.setdefault("TPU_LOG_DIR", "disabled")

import pytest


@pytest.fixture
def x64(gdn2_x64):
    """float64 enabled for the duration of one test (the kit's fixture, gdn2_conformance)."""
    yield
