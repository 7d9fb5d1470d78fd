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
    # the capability flags, then what the core provides for every backend
    core = "grouped value heads (core), activations (core, XLA)"
    assert scan_row.rstrip().endswith(f"features: segment_ids, cu_seqlens, float32 g, {core}")
    jax_row = next(ln for ln in out.splitlines() if ln.startswith("jax_ref"))
    assert jax_row.rstrip().endswith(f"features: segment_ids, cu_seqlens, float32 g, {core}")
    pallas_row = next(ln for ln in out.splitlines() if ln.startswith("pallas_tpu"))
    assert pallas_row.rstrip().endswith(
        "fused activations, scalar gates, float32 g, grouped value heads (core, keys read grouped)"
    )
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
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'; choose from info" in err and "did you mean" not in err
    assert main(["infos"]) == 2
    assert "unknown command 'infos'; did you mean 'info'? choose from" in capsys.readouterr().err


@pytest.mark.parametrize(
    "names, hint",
    [
        (["nosuch"], "'nosuch' is not one of gdn2's own backends: install the package"),
        (["jax_ref", "jax-ref"], "did you mean 'jax_ref'?"),
    ],
)
def test_conformance_refuses_a_backend_that_is_not_installed_in_one_line(
    names, hint, capsys, monkeypatch
):
    """``gdn2 conformance nosuch`` printed pytest's 38-line traceback: now one line naming the
    installed backends, exit 2, and pytest does not start."""
    from gdn2_conformance import command

    def no_pytest(*args, **kwargs):
        raise AssertionError(f"pytest started: {args}")

    monkeypatch.setattr(command.subprocess, "run", no_pytest)
    assert main(["conformance", *names]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    bad = names[-1]
    assert line.startswith(f"gdn2 conformance: gdn2 backend {bad!r} is not installed (installed: ")
    assert "jax_ref" in line and "scan_baseline" in line and hint in line, line
    assert captured.out == ""


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


def test_conformance_runs_pytest_for_installed_backends(monkeypatch):
    """The names check lets installed backends through to the suite (pytest stubbed here: the
    real run is tests/conformance)."""
    import types

    from gdn2_conformance import command

    seen = []
    monkeypatch.setattr(
        command.subprocess,
        "run",
        lambda cmd, check: seen.append(cmd) or types.SimpleNamespace(returncode=0),
    )
    assert main(["conformance", "jax_ref", "scan_baseline", "--", "-k", "forward"]) == 0
    (cmd,) = seen
    assert cmd[1:3] == ["-m", "pytest"] and cmd[-2:] == ["-k", "forward"]
    assert "--gdn2-backend jax_ref --gdn2-backend scan_baseline" in " ".join(cmd)
