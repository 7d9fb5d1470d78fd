"""Entry point of the ``gdn2.backends`` group: hands gdn2core this package's backend."""

from gdn2core.plugin import hookimpl


@hookimpl
def gdn2_backend():
    """The scan_baseline backend."""
    from gdn2_scan_baseline.backend import ScanBaselineBackend

    return ScanBaselineBackend()
