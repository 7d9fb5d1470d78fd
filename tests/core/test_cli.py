"""The gdn2 command."""

import subprocess
import sys

from gdn2core.cli import main


def test_info_lists_every_backend_with_availability(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("jax_ref", "scan_baseline", "pallas_tpu"):
        assert name in out
    assert "jax 0." in out and "platform cpu" in out


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "gdn2core.cli", "info"], capture_output=True, text=True, check=True
    )
    assert "backend" in out.stdout and "priority" in out.stdout


def test_unknown_command_is_an_error(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
