"""The core KernelConfig (fields, constraints, conversion to a backend's own class), its presets and
the seed's aliases, the memory model and the config heuristic."""

import jax
import jax.numpy as jnp
import pytest
from pydantic import ValidationError

import gdn2core.config
from gdn2core import (
    DEFAULT_CONFIG,
    KAGGLE_LARGE,
    KAGGLE_MEDIUM,
    KAGGLE_SMALL,
    LONG_CHUNKS,
    PRESETS,
    SHORT_CHUNKS,
    KernelConfig,
    OpSpec,
    estimate_memory,
    get_recommended_config,
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bt": 1}, "bt\n  Input should be greater than or equal to 2"),
        ({"wy_eps": 1.0}, "wy_eps\n  Input should be less than 1"),
        ({"wy_eps": -0.1}, "wy_eps\n  Input should be greater than or equal to 0"),
        ({"tile": 3}, "tile\n  Extra inputs are not permitted"),
        # a backend's knobs are not core fields (jax_ref's are in gdn2_jax_ref.JaxRefConfig)
        ({"bc": 32}, "bc\n  Extra inputs are not permitted"),
        ({"mb": 16}, "mb\n  Extra inputs are not permitted"),
        ({"clip": 60.0}, "clip\n  Extra inputs are not permitted"),
    ],
)
def test_config_errors_say_which_constraint(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        KernelConfig(**kwargs)


def test_core_fields():
    """bt, wy_eps and interpret, with their defaults; any bt >= 2 (a backend refuses the chunk
    lengths it cannot run in its supports())."""
    assert set(KernelConfig.model_fields) == {"bt", "wy_eps", "interpret"}
    assert KernelConfig() == KernelConfig(bt=64, wy_eps=0.0, interpret=False)
    assert KernelConfig(bt=15).bt == 15
    assert "chunk states come one per bt tokens" in KernelConfig.model_fields["bt"].description
    assert "contract" in KernelConfig.__doc__


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bt": "64"},
        {"bt": 64.0},
        {"bt": True},
        {"interpret": "yes"},
        {"interpret": 1},
        {"wy_eps": None},
    ],
)
def test_config_types_are_strict(kwargs):
    """A string, float or bool is never converted into an int field (or vice versa)."""
    field = next(iter(kwargs))
    with pytest.raises(ValidationError, match=f"{field}\n  Input should be a valid"):
        KernelConfig(**kwargs)


def test_model_copy_validates_its_updates():
    base = KernelConfig()
    assert base.model_copy(update={"interpret": True}).interpret
    assert base.model_copy(update={"bt": 32}) == KernelConfig(bt=32)
    with pytest.raises(ValidationError, match="Input should be a valid integer"):
        base.model_copy(update={"bt": "64"})
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        base.model_copy(update={"tile": 3})


def test_config_is_frozen_and_a_jit_static():
    cfg = KernelConfig(bt=32)
    with pytest.raises(ValidationError):
        cfg.bt = 16
    assert hash(cfg) == hash(KernelConfig(bt=32))

    def chunks(x, config):
        return x * config.bt

    chunks = jax.jit(chunks, static_argnames="config")

    assert float(chunks(jnp.ones(()), config=cfg)) == 32.0


class _MineConfig(KernelConfig):
    """A backend's own config, as docs/backends.md section 1b writes one."""

    tile: int = 128


class _OtherConfig(KernelConfig):
    pass


def test_from_config_converts_core_keeps_own_refuses_others():
    core = KernelConfig(bt=32, wy_eps=0.25, interpret=True)
    mine = _MineConfig.from_config(core)
    assert type(mine) is _MineConfig
    assert (mine.bt, mine.wy_eps, mine.interpret, mine.tile) == (32, 0.25, True, 128)
    assert _MineConfig.from_config(mine) is mine
    assert mine != core  # another class: a different jit static
    assert KernelConfig.from_config(mine) is mine  # the core reads any subclass
    assert _MineConfig.refusal(core) is None and _MineConfig.refusal(mine) is None
    message = "config: expected a KernelConfig or _MineConfig, got _OtherConfig"
    assert _MineConfig.refusal(_OtherConfig()) == message
    with pytest.raises(TypeError, match=message):
        _MineConfig.from_config(_OtherConfig())
    with pytest.raises(TypeError, match="config: expected a KernelConfig, got dict"):
        KernelConfig.from_config({"bt": 64})


def test_presets_are_named_for_what_they_do_and_exact():
    assert PRESETS == {
        "SHORT_CHUNKS": SHORT_CHUNKS,
        "DEFAULT_CONFIG": DEFAULT_CONFIG,
        "LONG_CHUNKS": LONG_CHUNKS,
    }
    assert [p.bt for p in (SHORT_CHUNKS, DEFAULT_CONFIG, LONG_CHUNKS)] == [32, 64, 128]
    assert all(type(p) is KernelConfig for p in PRESETS.values())  # every backend takes them
    assert all(p.wy_eps == 0.0 and not p.interpret for p in PRESETS.values())
    assert DEFAULT_CONFIG == KernelConfig()


def test_seed_preset_names_are_aliases():
    """The seed's KAGGLE_* names are the same objects as the presets, importable from both."""
    assert KAGGLE_SMALL is SHORT_CHUNKS
    assert KAGGLE_MEDIUM is DEFAULT_CONFIG
    assert KAGGLE_LARGE is LONG_CHUNKS
    assert gdn2core.config.KAGGLE_MEDIUM is gdn2core.KAGGLE_MEDIUM is DEFAULT_CONFIG
    assert not {"KAGGLE_SMALL", "KAGGLE_MEDIUM", "KAGGLE_LARGE"} & set(PRESETS)


def _spec(B=8, T=4096, H=6, dk=128, dv=128, dtype="float32"):
    return OpSpec(B, T, H, dk, dv, dtype, dk**-0.5)


def test_estimate_memory_formula():
    spec = _spec()
    est = estimate_memory(spec, DEFAULT_CONFIG)
    bh, n, C = 48, 64, 64
    state = 4 * bh * 128 * 128
    assert est.inputs == bh * 4096 * (6 * 128) * 4 + state
    assert est.outputs == bh * 4096 * 128 * 4 + state
    assert est.state_pass == state * n
    assert est.chunk_parallel == 4 * bh * n * (3 * C * C + C * 7 * 128)
    assert est.peak_train > est.peak_forward > est.inputs
    # bf16 halves the token tensors, not the float32 state and intermediates
    est16 = estimate_memory(_spec(dtype="bfloat16"), DEFAULT_CONFIG)
    assert est16.inputs == bh * 4096 * 768 * 2 + state
    assert est16.chunk_parallel == est.chunk_parallel


def test_recommended_config():
    assert get_recommended_config(_spec(T=50)) is SHORT_CHUNKS
    assert get_recommended_config(_spec(T=4096)) is DEFAULT_CONFIG
    assert get_recommended_config(_spec(T=16384)) is LONG_CHUNKS
    assert get_recommended_config(_spec(T=16384, dv=256)) is DEFAULT_CONFIG
