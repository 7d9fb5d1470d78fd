"""gdn2_tools.op_times: per-op times from a profiler trace, device planes before the host's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from gdn2_tools import op_times


@dataclasses.dataclass
class _Event:
    name: str
    duration_ns: float


@dataclasses.dataclass
class _Line:
    name: str
    events: list


@dataclasses.dataclass
class _Plane:
    name: str
    lines: list


@dataclasses.dataclass
class _Profile:
    planes: list


def test_device_ops_summed_per_call_and_the_host_left_out():
    # A TPU trace's shape: the device plane's "XLA Ops" line holds the kernels; the host plane's
    # XLA threads (the launches) must not be added to them.
    # A TPU trace names an op by its HLO text; its name is kept.
    bwd = "%gdn2_bwd.1 = (bf16[8,6,4096,128]{3,2,1,0}) custom-call(bf16[8,6,4096,128] %q)"
    ops = [(bwd, 2e6), (bwd, 2e6), ("%fusion = f32[8] fusion(f32[8] %x)", 1e5)]
    ops += [("%gdn2_fwd_train.1 = (bf16[8]) custom-call()", 1e6)] * 2
    device = _Plane(
        "/device:TPU:0",
        [
            _Line("XLA Ops", [_Event(name, ns) for name, ns in ops]),
            _Line("XLA Modules", [_Event("jit_step", 7e6), _Event("jit_step", 7e6)]),
        ],
    )
    host = _Plane("/host:CPU", [_Line("tf_XLAExecute/1", [_Event("launch", 9e9)])])
    got = op_times.from_profile(_Profile([host, device]), calls=2)
    assert got.ms == {"gdn2_bwd.1": 2.0, "gdn2_fwd_train.1": 1.0, "fusion": 0.05}
    assert list(got.ms) == ["gdn2_bwd.1", "gdn2_fwd_train.1", "fusion"]
    assert got.module_ms == 7.0  # the programs: the ops and the gaps between them
    assert "/device:TPU:0/XLA Modules" in got.lines


def test_a_trace_without_ops_lists_its_lines():
    got = op_times.from_profile(_Profile([_Plane("/device:TPU:0", [_Line("Steps", [])])]), 1)
    assert got.ms == {} and got.lines == ("/device:TPU:0/Steps",) and got.module_ms is None


def test_calls_must_be_positive():
    with pytest.raises(ValueError, match="calls: expected at least 1, got 0"):
        op_times.from_profile(_Profile([]), 0)


def test_a_cpu_run_reads_the_host_ops():
    # A real trace on this machine: the program's tanh is among its ops, and no event of the
    # host's runtime (thread pools: "::" in their names) is; a 512-square float32 product and
    # tanh take well above a microsecond each.
    x = jnp.ones((512, 512), jnp.float32)
    compiled = jax.jit(lambda a: jnp.tanh(a) @ a).lower(x).compile()
    jax.block_until_ready(compiled(x))
    got = op_times.op_times(compiled, (x,), calls=3)
    assert "wrapped_tanh" in got.ms and got.module_ms is None, got
    assert all(ms > 1e-3 and "::" not in name for name, ms in got.ms.items()), got
