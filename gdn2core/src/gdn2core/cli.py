"""The ``gdn2`` command. Its subcommands come from the ``gdn2_commands`` hook: gdn2core's own
(``info``, :mod:`gdn2core.commands`), and those of installed plugins: the kit's ``conformance``,
the tools', a backend's own. A subcommand's module is imported only when it runs, so a broken or heavy plugin costs
the others nothing."""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import sys
from collections.abc import Sequence

import pluggy

from gdn2core import commands as builtin
from gdn2core.backend import short_error
from gdn2core.hooks import BACKENDS_GROUP, PROJECT, TOOLS_GROUP, Command, HookSpecs
from gdn2core.install import pip_command

#: Subcommands of gdn2's own distributions, for the hint when one is not installed:
#: ``{command: (distribution, folder in the repository)}``.
KNOWN_ELSEWHERE = {
    "conformance": ("gdn2-conformance", "conformance"),
    **{c: ("gdn2-tools", "tools") for c in ("bench", "memory", "mesh-report", "tpu-report")},
}


def discover_commands() -> tuple[dict[str, Command], list[str]]:
    """Every subcommand the hooks provide, and the problems met on the way.

    Returns:
        ``(commands by name, problems)``. gdn2core's own commands come first and cannot be
        replaced; of two plugins offering one name the first keeps it and the other is reported.
    """
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(HookSpecs)
    pm.register(builtin, name="gdn2core")
    problems: list[str] = []
    for group in (TOOLS_GROUP, BACKENDS_GROUP):
        for ep in md.entry_points(group=group):
            dist = ep.dist.metadata["Name"] if ep.dist is not None else "unknown"
            try:
                plugin = ep.load()
                if not pm.is_registered(plugin):
                    pm.register(plugin, name=f"{dist}:{ep.name}")
            except Exception as err:  # one broken plugin never hides the others' commands
                problems.append(f"plugin {ep.name} ({dist}): {short_error(err)}")
    commands: dict[str, Command] = {}
    impls = pm.hook.gdn2_commands.get_hookimpls()
    impls.sort(key=lambda i: i.plugin is not builtin)
    for impl in impls:
        owner = pm.get_name(impl.plugin)
        try:
            offered = list(impl.function())
        except Exception as err:
            problems.append(f"{owner}: gdn2_commands() raised {short_error(err)}")
            continue
        for cmd in offered:
            if not isinstance(cmd, Command):
                problems.append(
                    f"{owner}: gdn2_commands() gave a {type(cmd).__name__}, not a Command"
                )
            elif cmd.name in commands:
                problems.append(f"{owner}: command {cmd.name!r} ignored (already provided)")
            else:
                commands[cmd.name] = cmd
    return commands, problems


def _usage(commands: dict[str, Command], problems: list[str]) -> str:
    width = max(map(len, commands), default=8) + 2
    lines = ["usage: gdn2 {" + ",".join(commands) + "} ...", ""]
    lines += [f"  {c.name:<{width}}{c.help}" for c in commands.values()]
    if problems:
        lines += ["", "plugin problems:"] + [f"  {p}" for p in problems]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gdn2 COMMAND ARGS...``.

    Args:
        argv: the arguments after ``gdn2`` (default: ``sys.argv[1:]``).

    Returns:
        The subcommand's exit code (2 for a usage error).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    commands, problems = discover_commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(commands, problems))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    cmd = commands.get(name)
    if cmd is None:
        if name in KNOWN_ELSEWHERE:
            dist, folder = KNOWN_ELSEWHERE[name]
            print(
                f"gdn2: command {name!r} comes with {dist}, which is not installed: "
                f"{pip_command(dist, folder)}",
                file=sys.stderr,
            )
            return 2
        close = difflib.get_close_matches(name, [*commands, *KNOWN_ELSEWHERE], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        print(
            f"gdn2: unknown command {name!r}; {hint}choose from {', '.join(commands)} (installed "
            "tool and backend plugins add more; README, section Install)",
            file=sys.stderr,
        )
        return 2
    module_name, _, func_name = cmd.target.partition(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except Exception as err:
        print(
            f"gdn2 {name}: cannot load {cmd.target}: {type(err).__name__}: {err}", file=sys.stderr
        )
        return 2
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
