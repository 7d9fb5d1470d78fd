"""``gdn2 bench --serve``: a serving step through gdn2_ragged, gated against the ragged reference,
then timed beside the separate decode and forward calls; a wrong backend is rejected and never
timed; the TPU static estimate of the call next to its HBM bound."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest

import gdn2core
from gdn2_conformance import ReferenceBackend
from gdn2_tools.bench.cli import bench_main
from gdn2_tools.bench.serve import Heads, Scenario, Step, hbm_bound_us, state_dma_us
from gdn2core import gdn2_ragged

TINY = ["-H", "2", "--value-heads", "4", "--dk", "64", "--dv", "64", "--repeats", "2"]


class WrongForward(ReferenceBackend):
    """The reference with 5% of v added to o: the gate must reject a ragged call on it."""

    name = "test_wrong_ragged"

    def forward(self, q, k, v, w, b, g, h0, *, spec, config, extras=None):
        o, h = super().forward(q, k, v, w, b, g, h0, spec=spec, config=config, extras=extras)
        return o + 0.05 * v.astype(o.dtype), h


@pytest.fixture
def wrong_backend():
    gdn2core.register_backend(WrongForward(), replace=True)
    yield WrongForward.name
    gdn2core.unregister_backend(WrongForward.name)


def _run(tmp_path, *argv):
    rc = bench_main(["--serve", *argv, "--out", str(tmp_path)])
    return (
        rc,
        json.loads((tmp_path / "serve.json").read_text()),
        (tmp_path / "serve.md").read_text(),
    )


def test_scenarios_and_their_metadata():
    s = Scenario.parse("64x1+2x2048")
    assert s.label == "64 decodes + 2 prefills of 2048" and s.n_decodes == 64
    assert s.tokens == 64 + 4096 and s.small(64).text == "4x1+2x165"
    assert Scenario.parse("256x1").label == "256 decodes"
    assert Scenario.parse("8x4096").n_decodes == 0
    assert Scenario.parse("4x3+1x9", decode_len=4).label == "4 decodes of 3 + 1 prefill of 9"
    with pytest.raises(ValueError, match="COUNTxLEN"):
        Scenario.parse("64+2x2048")
    step = Step.build(s, 64, seed=0)
    # the prompts meet 2048 / 64 checkpoints each; decode i at context 63 + 61 i meets one when
    # 64 divides 64 + 61 i: i = 0
    assert step.stored == 2 * 32 + 1 and step.pool_size == 66 + step.stored
    named = np.concatenate([step.state_indices, step.checkpoint_slots[step.checkpoint_slots >= 0]])
    assert sorted(named) == list(range(step.pool_size))  # every slot named once
    assert not step.has_initial_state[64:].any() and step.has_initial_state[:64].all()
    plain = Step.build(s, None, seed=0)
    assert plain.checkpoint_slots is None and plain.pool_size == 66


def test_state_dmas_are_priced_as_the_kernel_moves_them():
    """The packed forward's slot writes are staged (float32 through the vector registers) and
    run behind the chunks: in a compute-bound kernel they cost the staging and the last write;
    where the kernels' time is below the step's HBM bound they cost the difference. Slots move in
    the pool's dtype; the separate calls move none by DMA."""
    s = Scenario.parse("64x1+2x2048")
    step = Step.build(s, 64, seed=0)
    f32, bf16 = (Heads(16, 32, 128, 128, "float32", dt) for dt in ("float32", "bfloat16"))
    slot = 32 * 128 * 128  # elements of one slot
    # 2 prompts written and their 64 checkpoints (the decode's checkpoint is XLA's); none read
    staging = 66 * slot * 4 / 4096 / 1.5e9 * 1e6
    busy = 1e6  # us: a kernel far slower than the step's HBM bound
    got = [state_dma_us("ragged", s, step, h, "v5e", busy) for h in (f32, bf16)]
    assert got[0] == pytest.approx(staging + slot * 4 / 819e9 * 1e6)
    assert got[1] == pytest.approx(staging + slot * 2 / 819e9 * 1e6)
    bound = hbm_bound_us(s, step, f32, "v5e")
    fast = state_dma_us("ragged", s, step, f32, "v5e", 0.0)  # an HBM-bound kernel
    assert fast == pytest.approx(got[0] + bound)
    assert state_dma_us("separate", s, step, f32, "v5e", busy) == 0.0
    decodes = Scenario.parse("8x1")  # no packed forward: nothing written by it, nothing added
    assert state_dma_us("ragged", decodes, Step.build(decodes, 64, seed=0), f32, "v5e", 0.0) == 0
    resumed = Step.build(s, 64, seed=0)
    resumed.has_initial_state[64:] = True  # the prompts resume: their slots read, synchronously
    read = state_dma_us("ragged", s, resumed, f32, "v5e", busy) - got[0]
    assert read == pytest.approx(2 * slot * 4 / 819e9 * 1e6)


def test_serve_bench_gates_and_times_against_the_separate_calls(tmp_path):
    rc, data, md = _run(
        tmp_path, "--scenario", "2x1+1x40", "--checkpoint-every", "16", *TINY
    )  # fmt: skip
    assert rc == 0
    rows = {(r["kind"], r["every"]): r for r in data["rows"]}
    assert set(rows) == {("ragged", None), ("separate", None), ("ragged", 16)}
    for r in rows.values():
        assert r["status"] == "ok" and r["gate"]["ok"] and len(r["times_s"]) == 2, r
        assert r["backend"] == "jax_ref"  # auto's pick on this CPU
    assert rows["ragged", 16]["stored"] == 3  # the prompt's 16, 32; decode 0 at context 63
    takes = "num_decodes" in inspect.signature(gdn2_ragged).parameters
    assert data["decode_keywords_passed"] == takes
    assert rows["ragged", None]["decode_keywords"] == (
        {"num_decodes": 2, "decode_len": 1} if takes else {}
    )
    assert "| 2 decodes + 1 prefill of 40 | gdn2_ragged | none | jax_ref | ok |" in md
    assert (
        "| 2 decodes + 1 prefill of 40 | gdn2_ragged | every 16 (3 stored) | jax_ref | ok |" in md
    )


def test_serve_bench_rejects_a_wrong_backend(tmp_path, wrong_backend):
    rc, data, _ = _run(
        tmp_path, "--scenario", "1x20", "--checkpoint-every", "0", "--no-separate",
        "--backend", wrong_backend, *TINY,
    )  # fmt: skip
    assert rc == 1
    (row,) = data["rows"]
    assert row["status"] == "rejected" and "times_s" not in row
    assert row["gate"]["failures"][0].startswith("o: rel err")


@pytest.mark.tpu_compile
def test_serve_bench_tpu_static_estimate(tmp_path):
    """The ragged call, the separate calls and the call with checkpoints on the backend auto
    picks on a TPU (H = 1, HV = 2 grouped value heads, d = 64, v5e; compile-time analysis)."""
    rc, data, md = _run(
        tmp_path, "--no-timing", "--tpu", "v5e", "--scenario", "2x1+1x64",
        "--checkpoint-every", "32", "-H", "1", "--value-heads", "2", "--dk", "64", "--dv", "64",
    )  # fmt: skip
    assert rc == 0, [r.get("error") for r in data["static"]]
    rows = {(r["kind"], r["every"]): r for r in data["static"]}
    assert set(rows) == {("ragged", None), ("separate", None), ("ragged", 32)}
    for r in rows.values():
        assert r["backend"] == "pallas_tpu" and r["kernel_us"] > 0
        assert r["total_us"] >= r["kernel_us"] and "not a measurement" in r["estimate"]
    scenario = Scenario.parse("2x1+1x64")
    slots = (2 + 3) * 2 * 64 * 64 * 4  # two decodes read, three requests written; float32
    tokens = 66 * (4 * 1 * 64 + 3 * 2 * 64) * 4  # q, k, b, g on 1 head; v, w, o on 2
    heads = Heads(1, 2, 64, 64, "float32", "float32")
    bound = hbm_bound_us(scenario, Step.build(scenario, None, seed=0), heads, "v5e")
    assert bound == pytest.approx((slots + tokens) / 819e9 * 1e6)
    assert rows["ragged", None]["bound_us"] == pytest.approx(bound)
    assert rows["ragged", 32]["stored"] == 3  # the prompt's 32, 64; decode 0 at context 63
    assert "compile-time analysis" in md and "| v5e | 2 decodes + 1 prefill of 64 |" in md
