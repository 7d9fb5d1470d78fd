"""The pallas_tpu backend's contract: registration, capabilities, supports(), platform guard."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from gdn2core import KernelConfig, get_backend, list_backends
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.verdict import judge

from .helpers import make_inputs

SMALL = KernelConfig(bt=16)


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
    auto_cpu = judge(backend, spec, SMALL, trainable=True, auto=True, platform="cpu")
    assert not auto_cpu and "runs on tpu, this call on cpu" in auto_cpu.reason
    named_cpu = judge(backend, spec, SMALL, trainable=True, auto=False, platform="cpu")
    assert not named_cpu and "KernelConfig(interpret=True)" in named_cpu.reason
    interpret = SMALL.model_copy(update={"interpret": True})
    assert judge(backend, spec, interpret, trainable=True, auto=False, platform="cpu")
    assert judge(backend, spec, SMALL, trainable=True, auto=True, platform="tpu")


@pytest.mark.parametrize(
    ("spec", "config", "needle"),
    [
        (_spec(dk=96), SMALL, "dk=96"),
        (_spec(dv=32), SMALL, "dv=32"),
        (_spec(dtype="float64"), SMALL, "float64"),
        (_spec(), KernelConfig(bt=24), "bt=24 is not one of"),
        (_spec(dk=256, dv=256), KernelConfig(bt=256), "bt=256 is not one of"),
    ],
)
def test_verdict_refuses_with_reason(spec, config, needle):
    answer = judge(
        get_backend("pallas_tpu"), spec, config, trainable=True, auto=True, platform="tpu"
    )
    assert not answer and needle in answer.reason


@pytest.mark.parametrize(("dk", "dv"), [(64, 64), (128, 256), (256, 256)])
def test_supports_head_sizes_and_presets(dk, dv):
    from gdn2core import PRESETS

    backend = get_backend("pallas_tpu")
    for config in PRESETS.values():
        spec = _spec(dk, dv, "bfloat16", T=4096)
        assert judge(backend, spec, config, trainable=True, auto=True, platform="tpu")


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


JAX_REF_REFUSED = "config: expected a KernelConfig or PallasTpuConfig, got JaxRefConfig"


def test_another_backends_config_is_refused_by_name():
    """A JaxRefConfig (bc, wy_block and clip the kernels would silently ignore) is refused by
    supports() and supports_decode() with a verdict, so a named call raises with the reason; the
    backend's methods raise TypeError. A core config and a PallasTpuConfig are taken alike."""
    from gdn2_jax_ref.config import JaxRefConfig
    from gdn2_pallas_tpu.config import PallasTpuConfig
    from gdn2core import BackendUnsupportedError, DecodeSpec, gdn2_forward

    backend = get_backend("pallas_tpu")
    spec = _spec(dk=64, dv=64)
    assert backend.supports(spec, SMALL) and backend.supports(spec, PallasTpuConfig(bt=16))
    answer = backend.supports(spec, JaxRefConfig(bt=16))
    assert not answer and answer.reason == JAX_REF_REFUSED
    decode = DecodeSpec(1, 1, 2, 2, 2, 64, 64, "float32", 0.125, 1, "float32", False, False)
    assert backend.supports_decode(decode, SMALL)
    refused = backend.supports_decode(decode, JaxRefConfig(bt=16))
    assert not refused and refused.reason == JAX_REF_REFUSED

    args, _, _ = make_inputs(1, 16, 1, 64, 64, jnp.float32)
    with pytest.raises(BackendUnsupportedError, match=JAX_REF_REFUSED):
        gdn2_forward(*args[:6], None, args[6], JaxRefConfig(bt=16, interpret=True), "pallas_tpu")
    with pytest.raises(TypeError, match=JAX_REF_REFUSED):
        backend.forward(*args, spec=OpSpec.from_inputs(*args[:6], None, args[6]),
                        config=JaxRefConfig(bt=16, interpret=True))  # fmt: skip
