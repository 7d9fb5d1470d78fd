"""examples/serve.py runs end to end (a subprocess, tiny shapes, about 25 s on the CPU here).

The script checks itself: every request's greedy tokens from the continuous-batching loop
against the same request generated alone through the layer's plain serving call, exit status 1
on a mismatch. The settings make every path run: requests sharing a prefix (prefix-cache hits),
prompts longer than a step's budget (chunked prefill), drafts accepted and rolled back (a vocab
of 8 makes a random-weight model agree with some drafts), slots freed and reused.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import gdn2core

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "serve.py"
SMALL = (
    "--requests", "12", "--prefixes", "2", "--max-prompt", "40", "--every", "8", "--budget", "32",
    "--max-running", "4", "--prefix-slots", "8", "--drafts", "2", "--vocab", "8", "--d-model",
    "32", "--layers", "1", "--heads", "2", "--head-dim", "8", "--max-new", "12",
)  # fmt: skip


def test_serve_matches_each_request_generated_alone():
    assert gdn2core.get_backend("jax_ref").availability()
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", "jax_ref", *SMALL],
        capture_output=True, text=True, timeout=240, env=env, check=False,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, f"serve.py failed:\n{out}\n{proc.stderr}"
    assert "check: 12 of 12 requests generate the same tokens as alone (greedy)" in out, out
    assert "MISMATCH" not in out, out
    assert re.search(r"served 12 requests in \d+ steps, .* tokens/s run", out), out
    assert re.search(r"step latency: mean [\d.]+ ms", out), out
    hits = re.search(r"prefix cache: (\d+) of 12 requests hit", out)
    assert hits and int(hits.group(1)) > 0, out
    drafts = re.search(
        r"drafts: (\d+) of (\d+) accepted .*; decodes with every draft accepted: (\d+);", out
    )
    assert drafts and int(drafts.group(1)) > 0 and int(drafts.group(3)) > 0, out
    assert int(drafts.group(1)) < int(drafts.group(2)), out  # some rolled back
