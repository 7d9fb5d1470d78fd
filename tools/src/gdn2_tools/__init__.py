"""gdn2-tools: the ``gdn2 bench``, ``memory``, ``mesh-report`` and ``tpu-report`` subcommands.

Modules: ``bench/`` (correctness-gated timing and compiled memory), ``mesh_report`` (per-chip HBM
of the sharded train step on a TPU pod), ``tpu_report`` (per-kernel rows from a backend's
``gdn2_kernel_costs`` hook, roofline, compiled HBM), ``tpu`` (deviceless TPU compiles),
``train_step`` (the train step every tool compiles), ``hlo`` (collectives of compiled HLO),
``preflight`` (optional dependencies, checked before any work starts).
"""
