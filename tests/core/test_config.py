"""KernelConfig constraints, presets, the memory model and the config heuristic."""

import jax
import jax.numpy as jnp
import pytest
from pydantic import ValidationError

from gdn2core import (
    DEFAULT_CONFIG,
    KAGGLE_LARGE,
    KAGGLE_MEDIUM,
    KAGGLE_SMALL,
    PRESETS,
    KernelConfig,
    OpSpec,
    estimate_memory,
    get_recommended_config,
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bt": 64, "bc": 16, "mb": 8}, "bt must equal 2 \\* bc .*got bt=64, bc=16"),
        ({"bt": 64, "bc": 32, "mb": 12}, "bc must be a multiple of mb .*got bc=32, mb=12"),
        ({"clip": 0.0}, "clip\n  Input should be greater than 0"),
        ({"wy_eps": 1.0}, "wy_eps\n  Input should be less than 1"),
        ({"wy_eps": -0.1}, "wy_eps\n  Input should be greater than or equal to 0"),
        ({"tile": 3}, "tile\n  Extra inputs are not permitted"),
    ],
)
def test_config_errors_say_which_constraint(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        KernelConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bt": "64"},
        {"bt": 64.0},
        {"mb": True},
        {"clip": "60"},
        {"interpret": "yes"},
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
    assert base.model_copy(update={"bt": 32, "bc": 16}) == KernelConfig(bt=32, bc=16)
    with pytest.raises(ValidationError, match="bt must equal 2 \\* bc"):
        base.model_copy(update={"bt": 32})
    with pytest.raises(ValidationError, match="Input should be a valid integer"):
        base.model_copy(update={"bt": "64"})
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        base.model_copy(update={"tile": 3})


def test_config_is_frozen_and_a_jit_static():
    cfg = KernelConfig(bt=32, bc=16, mb=8)
    with pytest.raises(ValidationError):
        cfg.bt = 16
    assert hash(cfg) == hash(KernelConfig(bt=32, bc=16, mb=8))

    def chunks(x, config):
        return x * config.bt

    chunks = jax.jit(chunks, static_argnames="config")

    assert float(chunks(jnp.ones(()), config=cfg)) == 32.0


def test_presets_are_exact_and_ordered():
    assert DEFAULT_CONFIG is KAGGLE_MEDIUM
    assert set(PRESETS) == {"KAGGLE_SMALL", "KAGGLE_MEDIUM", "KAGGLE_LARGE"}
    assert [p.bt for p in (KAGGLE_SMALL, KAGGLE_MEDIUM, KAGGLE_LARGE)] == [32, 64, 128]
    assert all(p.wy_eps == 0.0 for p in PRESETS.values())


def _spec(B=8, T=4096, H=6, dk=128, dv=128, dtype="float32"):
    return OpSpec(B, T, H, dk, dv, dtype, dk**-0.5)


def test_estimate_memory_formula():
    spec = _spec()
    est = estimate_memory(spec, KAGGLE_MEDIUM)
    bh, n, C = 48, 64, 64
    state = 4 * bh * 128 * 128
    assert est.inputs == bh * 4096 * (6 * 128) * 4 + state
    assert est.outputs == bh * 4096 * 128 * 4 + state
    assert est.state_pass == state * n
    assert est.chunk_parallel == 4 * bh * n * (3 * C * C + C * 7 * 128)
    assert est.peak_train > est.peak_forward > est.inputs
    # bf16 halves the token tensors, not the float32 state and intermediates
    est16 = estimate_memory(_spec(dtype="bfloat16"), KAGGLE_MEDIUM)
    assert est16.inputs == bh * 4096 * 768 * 2 + state
    assert est16.chunk_parallel == est.chunk_parallel


def test_recommended_config():
    assert get_recommended_config(_spec(T=50)) is KAGGLE_SMALL
    assert get_recommended_config(_spec(T=4096)) is KAGGLE_MEDIUM
    assert get_recommended_config(_spec(T=16384)) is KAGGLE_LARGE
    assert get_recommended_config(_spec(T=16384, dv=256)) is KAGGLE_MEDIUM
