"""The pallas_tpu backend's contract: registration, capabilities, supports(), platform guard."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from gdn2core import KernelConfig, get_backend, list_backends
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.verdict import verdict

from .helpers import make_inputs

SMALL = KernelConfig(bt=16, bc=8, mb=8)


def _spec(dk=128, dv=128, dtype="float32", T=64):
    return OpSpec(1, T, 2, dk, dv, dtype, dk**-0.5)


def test_registered_with_capabilities():
    info = {i.name: i for i in list_backends()}["pallas_tpu"]
    assert not info.broken and info.priority == 200
    caps = get_backend("pallas_tpu").capabilities
    assert caps.dk == (64, 128, 256) and caps.dv == (64, 128, 256)
    assert caps.dtypes == ("float32", "bfloat16") and caps.trainable
    assert caps.platforms == ("tpu",) and caps.interpret and caps.auto


def test_verdict_here_and_on_a_tpu():
    """Off a TPU: auto never picks it, a named call needs interpret mode; on a TPU: both yes."""
    backend = get_backend("pallas_tpu")
    spec = _spec()
    auto_cpu = verdict(backend, spec, SMALL, trainable=True, auto=True, platform="cpu")
    assert not auto_cpu and "runs on tpu, this call on cpu" in auto_cpu.reason
    named_cpu = verdict(backend, spec, SMALL, trainable=True, auto=False, platform="cpu")
    assert not named_cpu and "KernelConfig(interpret=True)" in named_cpu.reason
    interpret = SMALL.model_copy(update={"interpret": True})
    assert verdict(backend, spec, interpret, trainable=True, auto=False, platform="cpu")
    assert verdict(backend, spec, SMALL, trainable=True, auto=True, platform="tpu")


@pytest.mark.parametrize(
    ("spec", "config", "needle"),
    [
        (_spec(dk=96), SMALL, "dk=96"),
        (_spec(dv=32), SMALL, "dv=32"),
        (_spec(dtype="float64"), SMALL, "float64"),
        (_spec(), KernelConfig(bt=24, bc=12, mb=6), "bt=24 is not one of"),
        (_spec(dk=256, dv=256), KernelConfig(bt=256, bc=128, mb=16), "bt=256 is not one of"),
    ],
)
def test_verdict_refuses_with_reason(spec, config, needle):
    answer = verdict(
        get_backend("pallas_tpu"), spec, config, trainable=True, auto=True, platform="tpu"
    )
    assert not answer and needle in answer.reason


@pytest.mark.parametrize(("dk", "dv"), [(64, 64), (128, 256), (256, 256)])
def test_supports_head_sizes_and_presets(dk, dv):
    from gdn2core import PRESETS

    backend = get_backend("pallas_tpu")
    for config in PRESETS.values():
        spec = _spec(dk, dv, "bfloat16", T=4096)
        assert verdict(backend, spec, config, trainable=True, auto=True, platform="tpu")


def test_cpu_without_interpret_fails_with_fix():
    """Eagerly: raises at the call. Under jit (the target platform is only known at lowering):
    the compiled CPU computation raises at run time with the same message."""
    args, _, _ = make_inputs(1, 8, 1, 64, 64, jnp.float32)
    backend = get_backend("pallas_tpu")
    spec = OpSpec.from_inputs(*args[:6], None, args[6])
    with pytest.raises(RuntimeError, match="interpret=True"):
        backend.forward(*args, spec=spec, config=SMALL)

    def f(*a):
        return backend.forward(*a, spec=spec, config=SMALL)

    with pytest.raises(Exception, match="interpret=True"):
        jax.block_until_ready(jax.jit(f)(*args))
