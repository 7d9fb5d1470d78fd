"""Suite-wide setup: CPU-only JAX (libtpu is installed for compile checks and must not start)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (deviceless compiles) would log its failed device probes to /tmp/tpu_logs, ~1 GB a process.
os.environ.setdefault("TPU_LOG_DIR", "disabled")

import pytest

from tests.support import worker_crash
from tests.tiers import is_full, is_slow


def pytest_configure(config):
    """A test whose xdist worker crashed runs once more (tests/support/worker_crash.py)."""
    worker_crash.register(config)


def pytest_collection_modifyitems(config, items):
    """Mark the tests of the full tier and the long sweeps (tests/tiers.py): `make test` runs the
    rest."""
    quick = set()  # test functions with a parametrization in the quick tier already
    for item in items:
        function = item.nodeid.split("[")[0]
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
        elif is_full(item.nodeid, function not in quick):
            item.add_marker(pytest.mark.full)
        else:
            quick.add(function)


@pytest.fixture
def x64(gdn2_x64):
    """float64 enabled for the duration of one test (the kit's fixture, gdn2_conformance)."""
    yield
