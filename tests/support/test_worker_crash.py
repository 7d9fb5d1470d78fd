"""The suite's rerun of a test whose xdist worker crashed (tests/support/worker_crash.py), on a
throwaway suite run in a subprocess: a test that crashes once passes on its second run, a test
that crashes every time fails, a failed check fails at once and is not run again, and the
summary names each crash."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITE = """
import os
import signal
from pathlib import Path

MARK = Path(os.environ["GDN2_CRASH_MARK"])


def test_crashes_once():
    if not MARK.exists():
        MARK.write_text("crashed")
        os.kill(os.getpid(), signal.SIGSEGV)


def test_crashes_every_time():
    os.kill(os.getpid(), signal.SIGSEGV)


def test_fails_its_check():
    Path(str(MARK) + ".fails").open("a").write("ran\\n")
    assert 1 == 2


def test_passes():
    pass
"""
CONFTEST = """
from tests.support import worker_crash


def pytest_configure(config):
    worker_crash.register(config)
"""


def test_a_crashed_test_runs_once_more_and_a_failed_one_does_not(tmp_path):
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    mark = tmp_path / "crash-mark"
    env = dict(os.environ, GDN2_CRASH_MARK=str(mark), PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "1", "--max-worker-restart=5", "-p",
         "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = run.stdout
    assert run.returncode == 1, out
    assert "2 failed, 2 passed, 2 rerun" in out, out
    assert "FAILED test_suite.py::test_fails_its_check" in out, out
    assert "crashed while running 'test_suite.py::test_crashes_every_time'" in out, out
    assert "test_crashes_once" not in out.split("short test summary info")[1], out
    assert (tmp_path / "crash-mark.fails").read_text() == "ran\n"  # run once, not again
    summary = out.split("tests run again after their worker crashed")[1]
    assert "test_suite.py::test_crashes_once: its worker died" in summary, out
    assert "test_suite.py::test_crashes_every_time: its worker died" in summary, out
