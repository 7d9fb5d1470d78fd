"""One more run, on a fresh worker, for a test whose pytest-xdist worker process died under it.

A worker running the Pallas interpret-mode tests has died of a segmentation fault inside XLA's CPU
compiler three times so far (once on JAX 0.11.2, twice on 0.12 in ``make test-full``), each time
in another test, and never when that test ran again; likely a race: the interpreter compiles each
kernel's body on a thread of its own while the test's thread may be compiling too. Such a test has
not failed: it never got to its checks. xdist reports it as failed ("worker crashed") and goes on. This plugin, on the
controller, puts the test back in the queue once (``sched.mark_test_pending``, xdist's hook
``pytest_handlecrashitem``) and reports the crashed run as ``rerun``:

- a test that fails its checks fails at once (that is a report from the worker, not a crash);
- a test whose worker dies twice fails (the second crash is reported as xdist reports it);
- every crash stays visible: the terminal summary lists the tests that were run again and why,
  and the worker's own fault report (Python's faulthandler) is in the output above it.
"""

from __future__ import annotations

from typing import Any

import pytest

RERUN = "rerun"


class WorkerCrashRerun:
    """The controller's plugin (module docstring)."""

    def __init__(self) -> None:
        self.crashed: list[str] = []  # node ids, in the order their workers died

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport, sched: Any) -> None:
        if crashitem in self.crashed:  # the second crash of this test: reported as a failure
            return
        self.crashed.append(crashitem)
        sched.mark_test_pending(crashitem)
        report.outcome = RERUN  # type: ignore[assignment]

    def pytest_report_teststatus(self, report: pytest.TestReport):
        if report.outcome == RERUN:
            return RERUN, "R", ("RERUN", {"yellow": True})
        return None

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.crashed:
            return
        terminalreporter.write_sep("=", "tests run again after their worker crashed", yellow=True)
        for nodeid in self.crashed:
            terminalreporter.write_line(
                f"{nodeid}: its worker died (see the fault report above); run once more on a "
                f"fresh worker, whose result is the one counted"
            )


def register(config: pytest.Config) -> None:
    """Register the plugin on an xdist controller (not on its workers, not without xdist)."""
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(WorkerCrashRerun(), "gdn2-worker-crash-rerun")
