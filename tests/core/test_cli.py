"""The gdn2 command: subcommands come from hooks; ``gdn2 info`` tells what a call would do."""

import subprocess
import sys

import pytest

from gdn2core.cli import discover_commands, main
from tests.support.plugins import fake_distribution, installed_plugins, on_path, write_dist_info


def test_info_lists_every_backend_with_its_verdict_here(capsys, monkeypatch):
    monkeypatch.delenv("GDN2_BACKEND", raising=False)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln.split()[1:6] for ln in out.splitlines()[2:5]}
    assert rows["pallas_tpu"] == ["0.1.0", "ok", "200", "no", "(1)"]
    assert rows["jax_ref"] == ["0.1.0", "ok", "100", "yes", "yes"]
    assert rows["scan_baseline"][3:] == ["yes", "no"]
    scan_row = next(ln for ln in out.splitlines() if ln.startswith("scan_baseline"))
    assert scan_row.rstrip().endswith("features: segment_ids, cu_seqlens")  # the capability flags
    assert (
        "pallas_tpu (gdn2-pallas-tpu): (1) runs on tpu, this call on cpu; KernelConfig(interpret=True)"
        in out
    )
    assert "scan_baseline: (2) used only when named" in out
    assert "jax 0." in out and "platform cpu" in out
    assert "GDN2_BACKEND is not set" in out


def test_info_shows_the_environment_variable(capsys, monkeypatch):
    monkeypatch.setenv("GDN2_BACKEND", "nope")
    assert main(["info"]) == 0
    assert "GDN2_BACKEND=nope: calls with backend='auto' run 'nope' (NOT INSTALLED" in (
        capsys.readouterr().out
    )
    monkeypatch.setenv("GDN2_BACKEND", "scan_baseline")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "GDN2_BACKEND=scan_baseline: calls with backend='auto' run 'scan_baseline'." in out


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "gdn2core.cli", "info"], capture_output=True, text=True, check=True
    )
    assert "backend" in out.stdout and "priority" in out.stdout


def test_unknown_command_is_an_error(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_subcommands_come_from_hooks(tmp_path, capsys):
    """gdn2core's own, the tools', and a third-party backend's own subcommand."""
    with installed_plugins(tmp_path, "gdn2-toy-backend"):
        commands, problems = discover_commands()
        assert {"info", "conformance", "bench", "memory", "mesh-report", "tpu-report"} <= set(
            commands
        )
        assert commands["toy-hello"].target == "gdn2_toy_backend:hello_main" and not problems
        assert main(["toy-hello", "world"]) == 0
    assert "hello from toy_serial world" in capsys.readouterr().out


def test_a_broken_plugin_costs_only_its_own_commands(tmp_path, capsys):
    source = (
        "from gdn2core.plugin import Command, hookimpl\n\n@hookimpl\ndef gdn2_commands():\n"
        "    return [Command('info', 'hijack', 'x:y'), 'not a command']\n"
    )
    (tmp_path / "fault_tool.py").write_text(source)
    write_dist_info(tmp_path, "bad-tool", "1.0", {"gdn2.tools": {"bad": "fault_tool"}})
    fake_distribution(
        tmp_path, "bad-import", {"fault_imp": "import nope_nope\n"}, {"imp": "fault_imp"}
    )
    with on_path(tmp_path, prefixes=("fault_",)):
        commands, problems = discover_commands()
        assert commands["info"].target == "gdn2core.commands:info_main"
        assert any("command 'info' ignored" in p for p in problems), problems
        assert any("gave a str, not a Command" in p for p in problems), problems
        assert any("plugin imp (bad-import): ModuleNotFoundError" in p for p in problems), problems
        assert main(["--help"]) == 0
        assert "plugin problems:" in capsys.readouterr().out
        assert main(["info"]) == 0


def test_a_command_of_an_uninstalled_distribution_says_how_to_install(monkeypatch, capsys):
    from gdn2core import cli

    real = cli.discover_commands
    monkeypatch.setattr(
        cli,
        "discover_commands",
        lambda: ({k: v for k, v in real()[0].items() if k != "conformance"}, []),
    )
    assert main(["conformance", "jax_ref"]) == 2
    err = capsys.readouterr().err
    assert "comes with gdn2-conformance" in err and "gdn2-conformance @ git+" in err
    assert "#subdirectory=conformance" in err


def test_conformance_needs_a_name():
    with pytest.raises(SystemExit):
        main(["conformance"])
