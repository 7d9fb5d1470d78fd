"""The README's "Porting from fla" blocks run as written, on fla-shaped inputs, and give what the
ops' own token-serial recurrences give (the port changes nothing but the import)."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_conformance import rel_err
from gdn2core import naive_recurrent_gated_delta_rule, naive_recurrent_kda

README = Path(__file__).resolve().parents[2] / "README.md"
T, H, HV, K, V = 40, 2, 4, 16, 16
#: float32 at "highest" matmul precision on both sides (rounding only, about 1e-6): 1e-5.
TOL = 1e-5


def _blocks() -> dict[str, str]:
    section = README.read_text().split("### Porting from fla", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"```python\n(.*?)```", section, re.S)
    return {
        "recurrent" if "fused_recurrent" in b else "kda" if "chunk_kda(" in b else "gdn": b
        for b in found
    }


def _inputs(scalar_gate: bool) -> dict:
    rng = np.random.default_rng(3)

    def arr(*shape, lo=-1.0, hi=1.0):
        return jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32)

    g = arr(1, T, HV) if scalar_gate else arr(1, T, HV, K)
    return dict(q=arr(1, T, H, K), k=arr(1, T, H, K), v=arr(1, T, HV, V), g=g,
                beta=arr(1, T, HV, lo=0.0), h0=arr(2, HV, K, V), A_log=arr(HV, lo=-1.0, hi=0.5),
                dt_bias=arr(HV * K), cu_seqlens=jnp.asarray([0, 15, T]))  # fmt: skip


@pytest.mark.parametrize("op", ["kda", "gdn"])
def test_readme_port_runs_and_matches_the_recurrence(op):
    block = _blocks()[op]
    assert block.startswith("# from fla.ops.")  # the fla import, commented out: the only change
    names = _inputs(scalar_gate=op == "gdn")
    with jax.default_matmul_precision("highest"):
        exec(block, names)  # the README's own code
        o, state = names["o"], names["state"]
        assert o.shape == (1, T, HV, V) and state.shape == (2, HV, K, V)
        cu = [0, 15, T]
        for n in range(2):
            part = {x: names[x][:, cu[n] : cu[n + 1]] for x in ("q", "k", "v", "g", "beta")}
            if op == "kda":
                o_n, h_n = naive_recurrent_kda(
                    **part, initial_state=names["h0"][n : n + 1], output_final_state=True,
                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                    A_log=names["A_log"], dt_bias=names["dt_bias"], lower_bound=-5.0,
                )  # fmt: skip
            else:
                o_n, h_n = naive_recurrent_gated_delta_rule(
                    **part, initial_state=names["h0"][n : n + 1], output_final_state=True,
                    use_qk_l2norm_in_kernel=True,
                )  # fmt: skip
            assert rel_err(o[:, cu[n] : cu[n + 1]], o_n) <= TOL, n
            assert rel_err(state[n : n + 1], h_n) <= TOL, n


def test_readme_decoding_block_runs_and_matches_the_recurrence():
    """The recurrent block: one new token for each of 2 sequences from their cached states."""
    block = _blocks()["recurrent"]
    assert block.startswith("# from fla.ops.gated_delta_rule import fused_recurrent")
    rng = np.random.default_rng(4)

    def arr(*shape, lo=-1.0, hi=1.0):
        return jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32)

    names = dict(q=arr(2, 1, H, K), k=arr(2, 1, H, K), v=arr(2, 1, HV, V),
                 g=arr(2, 1, HV, lo=-1.0, hi=0.0), beta=arr(2, 1, HV, lo=0.0),
                 state=arr(2, HV, K, V))  # fmt: skip
    given = dict(names)
    with jax.default_matmul_precision("highest"):
        exec(block, names)  # the README's own code
        o_r, h_r = naive_recurrent_gated_delta_rule(
            given["q"], given["k"], given["v"], given["g"], given["beta"],
            initial_state=given["state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
    assert names["o"].shape == (2, 1, HV, V) and names["state"].shape == (2, HV, K, V)
    assert rel_err(names["o"], o_r) <= TOL and rel_err(names["state"], h_r) <= TOL
