"""The ``gdn2`` command. ``gdn2 info`` lives here; other subcommands are loaded on demand from the
modules in ``SUBCOMMANDS`` so that ``gdn2 info`` stays light and a missing optional dependency of
one subcommand breaks only that one."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Final

#: name -> ("module:function", help); the function takes the remaining argv, returns an exit code.
SUBCOMMANDS: Final[dict[str, tuple[str, str]]] = {
    "bench": ("gdn2core.bench.cli:bench_main", "time every backend (correctness-gated)"),
    "memory": ("gdn2core.bench.cli:memory_main", "compiled peak memory per backend and shape"),
    "tpu-report": (
        "gdn2_pallas_tpu.report:main",
        "per-kernel VMEM, compiled HBM, FLOPs, bytes and roofline for a TPU target",
    ),
    "mesh-report": (
        "gdn2core.sharding.report:main",
        "per-chip HBM of the sharded train step on a TPU pod topology",
    ),
}


def info_main(argv: Sequence[str]) -> int:
    argparse.ArgumentParser(prog="gdn2 info", description="List gdn2 backends.").parse_args(argv)
    import jax

    from gdn2core import list_backends
    from gdn2core.platform import default_platform

    rows = []
    for info in list_backends():
        caps = info.capabilities.describe() if info.capabilities else "-"
        state = "yes" if info.available else f"no: {info.reason}"
        prio = "-" if info.priority is None else str(info.priority)
        rows.append((info.name, info.version, state, prio, caps))
    header = ("backend", "version", "available", "priority", "capabilities")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*header))
    print(line.format(*("-" * w for w in widths)))
    for row in rows:
        print(line.format(*row))
    if not rows:
        print("(no backend installed: pip install gdn2-jax-ref)")
    print(f"\njax {jax.__version__}, platform {default_platform()}, devices {jax.device_count()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = ["info", *SUBCOMMANDS]
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: gdn2 {" + ",".join(names) + "} ...\n")
        print(f"  {'info':<12} list the discovered backends, their availability and capabilities")
        for name, (_, help_) in SUBCOMMANDS.items():
            print(f"  {name:<12} {help_}")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "info":
        return info_main(rest)
    if cmd not in SUBCOMMANDS:
        print(f"gdn2: unknown command {cmd!r}; choose from {', '.join(names)}", file=sys.stderr)
        return 2
    target, _ = SUBCOMMANDS[cmd]
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        print(f"gdn2 {cmd}: unavailable ({err}); is its package installed?", file=sys.stderr)
        return 2
    return int(getattr(module, func_name)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
