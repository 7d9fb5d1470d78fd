"""The pallas_tpu decode kernel on grouped value heads (``Capabilities.grouped_decode``): q, k with
their own key heads and b, g with their own gate heads, read as they are where the step's blocks
tile and repeated to the value heads in VMEM (kernels_decode._grouped_rows), else repeated in
XLA (decode_op.py); and the slots the core hands it sanitised once, not twice.

Interpret mode against the kit's decode reference (``assert_close``, the kit's decode tolerances:
float32 1e-5, bfloat16 its own; a row of the wrong head gives errors of order 1), and a
deviceless v5e compile whose kernel takes the unrepeated heads.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

import gdn2_pallas_tpu.decode_op as decode_op
from gdn2_conformance import DecodeCase, assert_close, decode_reference_outputs, make_decode_inputs
from gdn2_tools.tpu import compile_decode
from gdn2core import DecodeSpec, KernelConfig, gdn2_decode, get_backend

from .helpers import decode_plans

INTERPRET = KernelConfig(bt=16, interpret=True)

#: (N, S, H, HV, gate heads (0: H), inputs, pool, key_groups, gate_groups the plan reads), d = 64
#: (16 heads a step, 8 at N = 1: two steps).
CASES = {
    "keys-and-gates-on-8-key-heads": (3, 1, 8, 16, 0, "float32", "float32", 2, 2),
    "keys-on-4-heads-gates-on-value-heads-S3": (2, 3, 4, 16, 16, "float32", "bfloat16", 4, 1),
    "bfloat16-inputs": (2, 2, 8, 16, 0, "bfloat16", "bfloat16", 2, 2),
    "four-key-rows-of-8-heads-repeated-in-xla": (1, 2, 8, 16, 0, "float32", "float32", 1, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_interpret_reads_grouped_heads(case, monkeypatch):
    N, S, H, HV, gate_heads, dtype, pool, key_groups, gate_groups = CASES[case]
    plans = decode_plans(monkeypatch)
    shapes = []
    real = decode_op.decode_call

    def spy(q, k, v, w, b, g, *rest, plan):
        shapes.append((q.shape[2], k.shape[2], b.shape[2], g.shape[2]))
        return real(q, k, v, w, b, g, *rest, plan=plan)

    monkeypatch.setattr(decode_op, "decode_call", spy)
    decode = DecodeCase(N=N, S=S, H=H, HV=HV, gate_heads=gate_heads, dk=64, dv=64, P=N + 3, seed=4)
    x = make_decode_inputs(decode, jnp.dtype(dtype), pool)
    o, new, states = gdn2_decode(
        *x.args, x.state, state_indices=x.state_indices, return_token_states=True,
        config=INTERPRET, backend="pallas_tpu",
    )  # fmt: skip
    assert [(p.key_groups, p.gate_groups) for p in plans] == [(key_groups, gate_groups)]
    hv = lambda groups: HV // groups  # noqa: E731  (the heads the kernel gets)
    assert shapes == [(hv(key_groups), hv(key_groups), hv(gate_groups), hv(gate_groups))]
    o_ref, pool_ref, states_ref = decode_reference_outputs(x)
    state_dtype = "bfloat16" if pool == "bfloat16" else dtype
    assert_close("o (decode)", o, o_ref, dtype)
    assert_close("state (decode)", new, pool_ref, state_dtype)
    assert_close("token_states (decode)", states, states_ref, state_dtype)


def test_slots_from_the_core_are_sanitised_once(monkeypatch):
    """gdn2_decode's slots come sanitised (``spec.sanitized_slots``): the op does not sanitise them
    again; a direct call of the backend's decode (a spec without the flag) still does, so a
    slot out of range or named twice skips its sequences there too."""
    calls = []
    real = decode_op.sanitize_slots

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(decode_op, "sanitize_slots", spy)
    x = make_decode_inputs(DecodeCase(N=3, S=1, H=1, HV=2, dk=64, dv=64, P=5, seed=6))
    gdn2_decode(*x.args, x.state, state_indices=x.state_indices, config=INTERPRET,
                backend="pallas_tpu")  # fmt: skip
    assert calls == []
    spec = DecodeSpec(3, 1, 2, 2, 2, 64, 64, "float32", 0.125, 5, "float32", False, True)
    q, k, v, w, b, g = (jnp.repeat(a, 2 // a.shape[2], axis=2) for a in x.args)
    slots = jnp.asarray([1, 7, 1], jnp.int32)  # out of range, named twice: all three skipped
    o, new, _ = get_backend("pallas_tpu").decode(
        q, k, v, w, b, g, x.state, slots, spec=spec, config=INTERPRET
    )
    assert len(calls) == 1
    assert np.isnan(np.asarray(o)).all()
    assert np.asarray(new).tobytes() == np.asarray(x.state).tobytes()


def test_decode_compiles_reading_the_key_heads():
    """H = 16, HV = 32, d = 128, bfloat16, N = 8 (v5e): the kernel's q, k, b, g operands are the
    caller's 16-head arrays (no XLA op repeats them), and the step's only XLA ops are the slots'
    (sanitised once: two comparisons of every pair are one)."""
    text = compile_decode(
        "pallas_tpu", "v5e:1x1", 8, 1, 16, 32, 128, 128, "bfloat16", "bfloat16"
    ).as_text()
    call = next(ln for ln in text.splitlines() if "%gdn2_decode" in ln and "custom-call(" in ln)
    operands = call.split("operand_layout_constraints={")[1].split("}}")[0]
    assert len(re.findall(r"bf16\[8,1,16,128\]", operands)) == 4, operands  # q, k, b, g
    assert len(re.findall(r"bf16\[8,1,32,128\]", operands)) == 2, operands  # v, w
    assert not re.search(r"= bf16\[[^\]]*\]\{[^}]*\} broadcast\(", text)  # no repeat
    entry = text[text.index("\nENTRY") :]  # the step's own ops (fusion bodies come before)
    assert len(re.findall(r'op_name="jit\(step\)/reduce_or"', entry)) == 1  # slots: one check
