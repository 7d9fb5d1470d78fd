"""The gdn2 pytest plugin (entry point ``pytest11: gdn2``): runs the conformance suite.

- ``pytest --gdn2-backend NAME`` (repeatable) adds the suite (:mod:`gdn2_conformance.suite`) for
  the installed backend NAME to the session; ``gdn2 conformance NAME`` runs just that.
- Tests of a :class:`~gdn2_conformance.suite.ConformanceSuite` subclass are parametrized over its
  ``targets`` (or the ``--gdn2-backend`` targets) and their cases (``gdn2_case``) or decode cases
  (``gdn2_decode_case``); a test runs on the targets that claim every feature it needs, and one
  that no target can run is deselected, not skipped.
- The run ends with pass/fail per backend and capability.

Importing this module imports nothing of gdn2core (every pytest session in an environment with
gdn2core installed loads it); the suite is imported only when a session uses it.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

_TARGETS = pytest.StashKey[dict]()
_ITEMS = pytest.StashKey[dict]()
_UNCLAIMED = "gdn2_unclaimed"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gdn2", "gdn2 backend conformance")
    group.addoption(
        "--gdn2-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run the gdn2 conformance suite against the installed backend NAME (repeatable)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{_UNCLAIMED}: a conformance test no target claims")
    config.stash[_TARGETS] = {}
    config.stash[_ITEMS] = {}
    config.pluginmanager.register(_Recorder(config), "gdn2-conformance-recorder")
    if config.getoption("gdn2_backend"):
        suite = Path(__file__).resolve().with_name("suite.py")
        given = {Path(a.split("::")[0]).resolve() for a in config.args}
        if suite not in given:
            config.args.append(str(suite))


def _option_targets(config: pytest.Config) -> tuple:
    cache = config.stash[_TARGETS]
    if "option" not in cache:
        from gdn2_conformance.suite import Target

        cache["option"] = tuple(Target.for_backend(n) for n in config.getoption("gdn2_backend"))
    return cache["option"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "gdn2_target" not in metafunc.fixturenames:
        return
    targets = getattr(metafunc.cls, "targets", None)
    if targets is None:
        targets = _option_targets(metafunc.config)
    feature = getattr(metafunc.function, "gdn2_feature", None)
    required = getattr(
        metafunc.function, "gdn2_requires", frozenset() if feature is None else {feature}
    )
    chosen = [t for t in targets if required <= t.claimed()]
    case_fixture = next(
        (n for n in ("gdn2_case", "gdn2_decode_case") if n in metafunc.fixturenames), None
    )
    names = ("gdn2_target",) if case_fixture is None else ("gdn2_target", case_fixture)
    if case_fixture is not None:
        cases = (
            (lambda t: t.cases()) if case_fixture == "gdn2_case" else (lambda t: t.decode_cases())
        )
        params = [pytest.param(t, c, id=f"{t.id}-{c.id}") for t in chosen for c in cases(t)]
    else:
        params = [pytest.param(t, id=t.id) for t in chosen]
    if not params:
        unclaimed = pytest.param(*(None,) * len(names), marks=pytest.mark.gdn2_unclaimed)
        params = [unclaimed]
    metafunc.parametrize(names, params)


@pytest.fixture
def gdn2_x64():
    """float64 enabled for the duration of one test."""
    import jax

    previous = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    index = config.stash[_ITEMS]
    for item in items:
        if item.get_closest_marker(_UNCLAIMED):
            drop.append(item)
            continue
        keep.append(item)
        callspec = getattr(item, "callspec", None)
        target = callspec.params.get("gdn2_target") if callspec else None
        feature = getattr(getattr(item, "function", None), "gdn2_feature", None)
        if target is not None and feature is not None:
            index[item.nodeid] = (target, feature)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


class _Recorder:
    """Counts passed and failed conformance tests per (target, feature) and prints them."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.counts: dict[tuple[str, object], list[int]] = defaultdict(lambda: [0, 0])

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        found = self.config.stash[_ITEMS].get(report.nodeid)
        if found is None:
            return
        target, feature = found
        counts = self.counts[(target.id, feature)]
        if report.failed:
            counts[1] += 1
        elif report.when == "call" and report.passed:
            counts[0] += 1

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.counts:
            return
        from gdn2_conformance.suite import Feature

        targets = {t.id: t for t, _ in self.config.stash[_ITEMS].values()}
        terminalreporter.section("gdn2 conformance: pass/fail per capability")
        for tid, target in targets.items():
            parts = []
            for feature in Feature:
                passed, failed = self.counts.get((tid, feature), (0, 0))
                if passed + failed:
                    verdict = "PASS" if failed == 0 else "FAIL"
                    parts.append(f"{feature} {verdict} ({passed}/{passed + failed} passed)")
            if not parts:
                continue
            claimed = target.claimed()
            absent = [str(f) for f in Feature if f not in claimed]
            line = f"{tid}: " + ", ".join(parts)
            if absent:
                line += f"; not claimed: {', '.join(absent)}"
            terminalreporter.write_line(line)
