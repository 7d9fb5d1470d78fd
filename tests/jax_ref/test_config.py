"""jax_ref's own config: JaxRefConfig's fields and validators, the conversion of a core
KernelConfig (the seed's blocking for the presets), and the refusal of another backend's config."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from pydantic import ValidationError

from gdn2_jax_ref import JaxRefConfig
from gdn2_jax_ref.backend import JaxRefBackend
from gdn2_jax_ref.config import derived_blocking
from gdn2_jax_ref.params import ChunkParams
from gdn2_pallas_tpu.config import PallasTpuConfig
from gdn2core import (
    DEFAULT_CONFIG,
    LONG_CHUNKS,
    PRESETS,
    SHORT_CHUNKS,
    BackendNotFoundError,
    BackendUnsupportedError,
    DecodeSpec,
    KernelConfig,
    OpSpec,
    gdn2_forward,
    get_backend,
)

SPEC = OpSpec(1, 32, 1, 8, 8, "float32", 8**-0.5)
PALLAS_REFUSED = "config: expected a KernelConfig or JaxRefConfig, got PallasTpuConfig"


@pytest.mark.parametrize(
    ("core", "blocking"),
    [
        (SHORT_CHUNKS, (32, 16, 8)),
        (DEFAULT_CONFIG, (64, 32, 16)),
        (LONG_CHUNKS, (128, 64, 16)),
        (KernelConfig(bt=256), (256, 128, 16)),
        (KernelConfig(bt=16), (16, 8, 4)),
        (KernelConfig(bt=8), (8, 4, 2)),
        (KernelConfig(bt=4), (4, 2, 1)),
        (KernelConfig(bt=2), (2, 1, 1)),
        (KernelConfig(bt=80), (80, 40, 10)),  # 16 does not divide 40: its largest divisor <= 16
    ],
    ids=lambda x: f"bt{x.bt}" if isinstance(x, KernelConfig) else None,
)
def test_core_config_converts_to_the_seed_blocking(core, blocking):
    """A core config gets bc = bt / 2 and the WY micro-block the seed used with that bt (the
    presets: 32 -> 16/8, 64 -> 32/16, 128 -> 64/16), the default clip, and its own core fields."""
    cfg = JaxRefConfig.from_config(core)
    assert type(cfg) is JaxRefConfig
    assert (cfg.bt, cfg.bc, cfg.wy_block) == blocking
    assert cfg.clip == 60.0 and cfg.wy_eps == core.wy_eps and cfg.interpret == core.interpret
    assert derived_blocking(core.bt) == blocking[1:]
    assert JaxRefConfig(bt=core.bt) == cfg  # left out, bc and wy_block are derived alike


def test_conversion_keeps_core_fields_and_own_configs():
    core = KernelConfig(bt=32, wy_eps=0.125, interpret=True)
    cfg = JaxRefConfig.from_config(core)
    assert (cfg.wy_eps, cfg.interpret) == (0.125, True)
    own = JaxRefConfig(bt=16, bc=8, wy_block=2, clip=10.0)
    assert JaxRefConfig.from_config(own) is own
    assert set(JaxRefConfig.model_fields) == {"bt", "wy_eps", "interpret", "bc", "wy_block", "clip"}
    assert JaxRefConfig() == JaxRefConfig(bt=64, bc=32, wy_block=16, clip=60.0)
    assert all(JaxRefConfig.refusal(p) is None for p in PRESETS.values())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bt": 64, "bc": 16, "wy_block": 8}, "bt must equal 2 \\* bc .*got bt=64, bc=16"),
        ({"bt": 64, "bc": 16}, "bt must equal 2 \\* bc .*got bt=64, bc=16"),
        ({"bt": 15}, "bt must equal 2 \\* bc .*got bt=15, bc=7"),
        (
            {"bt": 64, "bc": 32, "wy_block": 12},
            "bc must be a multiple of wy_block .*got bc=32, wy_block=12",
        ),
        ({"wy_block": 0}, "wy_block\n  Input should be greater than or equal to 1"),
        ({"clip": 0.0}, "clip\n  Input should be greater than 0"),
        ({"mb": 16}, "mb\n  Extra inputs are not permitted"),  # the seed's name is gone
        ({"wy_eps": 1.0}, "wy_eps\n  Input should be less than 1"),
    ],
)
def test_validators_say_which_constraint(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        JaxRefConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [{"bc": "32"}, {"wy_block": True}, {"clip": "60"}, {"bt": 64.0}])
def test_fields_are_strict(kwargs):
    field = next(iter(kwargs))
    with pytest.raises(ValidationError, match=f"{field}\n  Input should be a valid"):
        JaxRefConfig(**kwargs)


def test_frozen_hashable_and_model_copy_validated():
    cfg = JaxRefConfig(bt=32)
    with pytest.raises(ValidationError):
        cfg.bc = 8
    assert hash(cfg) == hash(JaxRefConfig(bt=32, bc=16, wy_block=8))
    assert cfg.model_copy(update={"wy_block": 4}) == JaxRefConfig(bt=32, bc=16, wy_block=4)
    with pytest.raises(ValidationError, match="bc must be a multiple of wy_block"):
        cfg.model_copy(update={"wy_block": 3})


def test_chunk_params_read_the_converted_config():
    params = ChunkParams.from_spec(SPEC, KernelConfig(bt=32, wy_eps=0.5))
    assert (params.bt, params.bc, params.wy_block, params.clip, params.wy_eps) == (
        32, 16, 8, 60.0, 0.5,
    )  # fmt: skip
    own = ChunkParams.from_spec(SPEC, JaxRefConfig(bt=16, bc=8, wy_block=2, clip=5.0))
    assert (own.bt, own.bc, own.wy_block, own.clip) == (16, 8, 2, 5.0)
    with pytest.raises(TypeError, match=PALLAS_REFUSED):
        ChunkParams.from_spec(SPEC, PallasTpuConfig())


def test_another_backends_config_is_refused_by_name():
    """supports() and supports_decode() refuse a PallasTpuConfig with a verdict (so a named call
    raises with the reason and auto passes over jax_ref); an odd core bt has no blocking."""
    backend = get_backend("jax_ref")
    assert isinstance(backend, JaxRefBackend)
    for config in (KernelConfig(bt=16), JaxRefConfig(bt=16), SHORT_CHUNKS):
        assert backend.supports(SPEC, config)
    answer = backend.supports(SPEC, PallasTpuConfig())
    assert not answer and answer.reason == PALLAS_REFUSED
    odd = backend.supports(SPEC, KernelConfig(bt=15))
    assert not odd and "bt=15" in odd.reason and "even" in odd.reason
    decode = DecodeSpec(1, 1, 1, 1, 1, 8, 8, "float32", 8**-0.5, 1, "float32", False, False)
    assert backend.supports_decode(decode, KernelConfig(bt=15))  # decode reads no blocking
    refused = backend.supports_decode(decode, PallasTpuConfig())
    assert not refused and refused.reason == PALLAS_REFUSED


def test_public_op_with_another_backends_config():
    x = jnp.zeros((1, 16, 1, 8), jnp.float32)
    args = (x, x, x, x, x, x)
    with pytest.raises(BackendUnsupportedError, match=PALLAS_REFUSED):
        gdn2_forward(*args, config=PallasTpuConfig(bt=16), backend="jax_ref")
    # auto on a CPU: pallas_tpu runs only on a TPU and jax_ref refuses the config
    with pytest.raises(BackendNotFoundError, match=f"jax_ref: {PALLAS_REFUSED}"):
        gdn2_forward(*args, config=PallasTpuConfig(bt=16))
    o, _ = gdn2_forward(*args, config=JaxRefConfig(bt=8, bc=4, wy_block=2), backend="jax_ref")
    assert o.shape == x.shape
