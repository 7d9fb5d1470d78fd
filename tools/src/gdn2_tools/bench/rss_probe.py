"""Subprocess body of ``gdn2 memory --rss``: one fwd+bwd, then the process's peak RSS as JSON.

Usage: ``python -m gdn2_tools.bench.rss_probe '{"backend": ..., "shape": {...}, "dtype": ...}'``.
Prints one JSON line: ``peak_rss_bytes`` (``ru_maxrss`` after the step), ``baseline_rss_bytes``
(after imports and input creation, before compiling) and, where the device reports it,
``device_peak_bytes``.
"""

from __future__ import annotations

import json
import resource
import sys


def _maxrss_bytes() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # Linux reports KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def main(argv: list[str]) -> int:
    req = json.loads(argv[0])
    import jax

    from gdn2_tools.bench.inputs import make_inputs
    from gdn2_tools.bench.programs import programs_for
    from gdn2_tools.bench.shapes import BenchShape

    shape = BenchShape.from_dict(req["shape"])
    xs, h0, cts = make_inputs(shape, req["dtype"])
    jax.block_until_ready((xs, h0, cts))
    baseline = _maxrss_bytes()
    progs = programs_for(req["backend"])
    jax.block_until_ready(jax.jit(progs.fwdbwd)(xs, h0, cts))
    out = {"peak_rss_bytes": _maxrss_bytes(), "baseline_rss_bytes": baseline}
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        out["device_peak_bytes"] = int(stats["peak_bytes_in_use"])
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
