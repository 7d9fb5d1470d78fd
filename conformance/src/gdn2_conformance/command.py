"""``gdn2 conformance``: the suite against installed backends, a subcommand of the ``gdn2`` command
(the kit registers it through the entry-point group ``gdn2.tools``, as the tools do)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from gdn2core.plugin import Command, hookimpl


@hookimpl
def gdn2_commands() -> list[Command]:
    """The kit's subcommand.

    Returns:
        ``conformance``.
    """
    return [
        Command(
            "conformance",
            "run the conformance suite against installed backends (pass/fail per capability)",
            f"{__name__}:conformance_main",
        )
    ]


def conformance_main(argv: Sequence[str]) -> int:
    """``gdn2 conformance NAME [NAME...] [-- PYTEST ARGS]``: the suite against installed backends.

    Args:
        argv: backend names, optionally followed by ``--`` and extra pytest arguments.

    Returns:
        pytest's exit code (0: every claimed capability passed), or 2 when a name is not an
        installed, usable backend (one line on stderr, naming the installed ones; pytest does
        not start). pytest runs in a child process (so that it can rewrite the suite's asserts).
    """
    argv = list(argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    names = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="gdn2 conformance",
        description="Run gdn2's conformance suite against installed backends; the report ends "
        "with pass/fail per capability. Extra pytest arguments follow `--`.",
    )
    parser.add_argument("backends", nargs="+", metavar="NAME", help="installed backend names")
    args = parser.parse_args(names)
    from gdn2core import BackendNotFoundError, get_backend

    for name in args.backends:
        try:
            get_backend(name)
        except BackendNotFoundError as err:  # not installed, broken or contested: one line
            print(f"gdn2 conformance: {err}", file=sys.stderr)
            return 2
    # A fresh interpreter: pytest rewrites the asserts of plugin packages it imports itself. Only
    # the suite is collected (never the current directory), with no project's configuration.
    suite = Path(__file__).resolve().parent / "suite.py"
    options = [str(suite), "-p", "gdn2", "-p", "no:cacheprovider", "-c", os.devnull, "-q"]
    for name in args.backends:
        options += ["--gdn2-backend", name]
    cmd = [sys.executable, "-m", "pytest", *options, *extra]
    return subprocess.run(cmd, check=False).returncode
