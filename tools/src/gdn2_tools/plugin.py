"""Entry point of the ``gdn2.tools`` group: the subcommands this distribution adds to ``gdn2``."""

from gdn2core.plugin import Command, hookimpl


@hookimpl
def gdn2_commands() -> list[Command]:
    """The tools' subcommands.

    Returns:
        ``bench``, ``memory``, ``mesh-report`` and ``tpu-report``.
    """
    return [
        Command(
            "bench", "time every backend (correctness-gated)", "gdn2_tools.bench.cli:bench_main"
        ),
        Command(
            "memory",
            "compiled memory of fwd+bwd per backend and shape",
            "gdn2_tools.bench.cli:memory_main",
        ),
        Command(
            "mesh-report",
            "per-chip HBM of the sharded train step on a TPU pod topology",
            "gdn2_tools.mesh_report:main",
        ),
        Command(
            "tpu-report",
            "per-kernel VMEM, FLOPs, bytes and roofline, and compiled HBM, for a TPU target",
            "gdn2_tools.tpu_report:main",
        ),
    ]
