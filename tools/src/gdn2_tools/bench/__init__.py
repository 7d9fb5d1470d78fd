"""``gdn2 bench`` and ``gdn2 memory``: correctness-gated timing and compiled memory of backends.

Modules: ``shapes`` (shape lists), ``inputs`` (deterministic NumPy inputs), ``programs`` (the
fwd / bwd / fwd+bwd programs of a row), ``timing``, ``gate`` (the correctness gate and its
tolerances), ``runner`` (the loop), ``checks`` (acceptance targets), ``report`` (JSON, Markdown,
PNG), ``memory`` and ``rss_probe`` (``gdn2 memory``), ``cli``. Needs the ``bench`` extra (rich,
matplotlib) only for the progress bar, the table and the plot.
"""
