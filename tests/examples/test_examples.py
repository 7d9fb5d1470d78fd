"""The examples run end to end (as subprocesses, tiny shapes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import gdn2core

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _backend() -> str:
    """jax_ref: what users get on a CPU (a dev dependency; missing, the test fails)."""
    assert gdn2core.get_backend("jax_ref").availability()
    return "jax_ref"


def _run(script: str, *args: str, timeout: float = 240) -> str:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_minimal_usage():
    name = _backend()
    out = _run(
        "minimal_usage.py",
        "--backend",
        name,
        "--B",
        "1",
        "--T",
        "16",
        "--H",
        "1",
        "--dk",
        "8",
        "--dv",
        "16",
    )
    assert f"backend: {name}" in out
    assert "forward: o (1, 16, 1, 16) float32" in out
    assert "all gradients finite" in out


def test_train_gdn2_layer():
    name = _backend()
    out = _run(
        "train_gdn2_layer.py",
        "--backend",
        name,
        "--steps",
        "1",
        "--B",
        "1",
        "--T",
        "16",
        "--d-model",
        "16",
        "--heads",
        "1",
        "--head-dim",
        "8",
    )
    assert f"backend: {name}" in out
    assert "step 0: loss" in out and "loss before" in out


# A tiny MQAR run: seconds, not a learning check.
TINY_MQAR = (
    "--steps", "2", "--batch", "4", "--pairs", "4", "--vocab", "16", "--d-model", "16",
    "--layers", "1", "--heads", "1", "--head-dim", "8", "--eval-every", "2",
    "--eval-batches", "1", "--no-progress",
)  # fmt: skip


def test_train_mqar_smoke():
    name = _backend()
    out = _run("train_mqar.py", "--backend", name, *TINY_MQAR)
    assert f"backend: {name}" in out
    assert "final eval accuracy" in out


@pytest.mark.parametrize("variant", ["kda", "gdn"])
def test_train_mqar_variants_smoke(variant):
    name = _backend()
    out = _run("train_mqar.py", "--backend", name, "--variant", variant, *TINY_MQAR)
    assert f"mixer: {variant}; backend: {name}" in out
    assert "final eval accuracy" in out


def test_train_mqar_two_devices():
    """``--devices 2``: two simulated CPU devices, the batch sharded over a 1-D mesh."""
    name = _backend()
    out = _run("train_mqar.py", "--backend", name, "--devices", "2", *TINY_MQAR)
    assert "devices: 2 cpu; mesh {'data': 2}" in out, out
    assert "batch sharded 2 per device" in out, out
    assert "final eval accuracy" in out, out


def test_generate_prefill_and_decode_match_one_forward():
    """A few training steps, then prefill + decode steps: the script checks the served logits
    against one forward itself (exit status 1 on a mismatch)."""
    name = _backend()
    tiny = (
        "--train-steps", "2", "--batch", "4", "--gen-batch", "2", "--pairs", "4", "--vocab", "16",
        "--d-model", "16", "--layers", "1", "--heads", "1", "--head-dim", "8", "--chunk", "4",
    )  # fmt: skip
    out = _run("generate.py", "--backend", name, *tiny)
    assert f"backend: decode {name}" in out, out
    assert "prefill 9 tokens + 3 decode steps x 2 sequences" in out, out
    assert "relative error" in out and "tokens/s" in out, out


def test_train_mqar_packed_smoke():
    """``--packed 2``: rows of two MQAR examples marked by segment_ids (the learning check, same
    accuracy as unpacked, is the full run: docs/results.md, MQAR demo)."""
    name = _backend()
    out = _run("train_mqar.py", "--backend", name, "--packed", "2", *TINY_MQAR)
    assert "packed: 2 examples per row, 2 rows of 24 tokens (segment_ids)" in out, out
    assert "final eval accuracy" in out, out
