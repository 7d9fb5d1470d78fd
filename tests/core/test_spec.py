"""Input validation: every error names the argument and the expected versus actual value."""

import jax.numpy as jnp
import pytest

from gdn2core import OpSpec, gdn2_forward, gdn2_token_serial_reference

B, T, H, DK, DV = 2, 5, 3, 4, 6


def inputs(dtype=jnp.float32):
    key = jnp.ones((B, T, H, DK), dtype)
    val = jnp.ones((B, T, H, DV), dtype)
    return [key, key, val, val, key, key]  # q, k, v, w, b, g


def test_spec_from_valid_inputs():
    spec = OpSpec.from_inputs(*inputs())
    assert (spec.batch, spec.seq_len, spec.heads, spec.dk, spec.dv) == (B, T, H, DK, DV)
    assert spec.scale == pytest.approx(DK**-0.5)
    assert spec.dtype == "float32"
    # h0 given or not: one spec (one jit cache entry), since the backend always receives an h0
    h0 = jnp.zeros((B, H, DK, DV), jnp.float32)
    assert (
        hash(spec)
        == hash(OpSpec.from_inputs(*inputs()))
        == hash(OpSpec.from_inputs(*inputs(), h0=h0))
    )


@pytest.mark.parametrize(
    ("index", "bad_shape", "message"),
    [
        (0, (B, T, H), r"q: expected rank 4 \(B, T, H, dk\), got rank 3"),
        (
            1,
            (B, T, H, DK + 1),
            r"k: expected shape \(B, T, H, dk\) = \(2, 5, 3, 4\), got \(2, 5, 3, 5\)",
        ),
        (
            2,
            (B, T + 1, H, DV),
            r"v: expected shape \(B, T, HV, dv\) = \(2, 5, 3, 6\), got \(2, 6, 3, 6\)",
        ),
        (
            3,
            (B, T, H, DV - 1),
            r"w: expected shape \(B, T, HV, dv\) = \(2, 5, 3, 6\), got \(2, 5, 3, 5\)",
        ),
        (4, (B, T, H + 1, DK), r"b: expected shape \(B, T, H, dk\)"),
        (
            5,
            (1, T, H, DK),
            r"g: expected shape \(B, T, H, dk\) = \(2, 5, 3, 4\), got \(1, 5, 3, 4\)",
        ),
    ],
)
def test_shape_errors_name_the_argument(index, bad_shape, message):
    args = inputs()
    args[index] = jnp.ones(bad_shape)
    with pytest.raises(ValueError, match=message):
        OpSpec.from_inputs(*args)


def test_h0_shape_and_dtype():
    with pytest.raises(
        ValueError,
        match=r"h0: expected shape \(B, H, dk, dv\) = \(2, 3, 4, 6\), got \(2, 3, 6, 4\)",
    ):
        OpSpec.from_inputs(*inputs(), h0=jnp.zeros((B, H, DV, DK)))
    with pytest.raises(TypeError, match="h0: expected dtype float32, got bfloat16"):
        OpSpec.from_inputs(*inputs(), h0=jnp.zeros((B, H, DK, DV), jnp.bfloat16))


def test_dtype_errors():
    args = inputs()
    args[4] = args[4].astype(jnp.int32)
    with pytest.raises(TypeError, match="b: expected a floating dtype, got int32"):
        OpSpec.from_inputs(*args)
    args = inputs()
    args[2] = args[2].astype(jnp.bfloat16)
    with pytest.raises(TypeError, match="expected one common dtype, got .*v=bfloat16"):
        OpSpec.from_inputs(*args)
    with pytest.raises(TypeError, match="q: expected one of"):
        OpSpec.from_inputs(*inputs(jnp.float16))


@pytest.mark.parametrize("scale", ["0.5", True, jnp.ones(()), [0.5]])
def test_scale_must_be_a_real_number(scale):
    with pytest.raises(TypeError, match="scale: expected a real number or None, got"):
        OpSpec.from_inputs(*inputs(), scale=scale)


def test_scale_accepts_ints_and_numpy_floats():
    import numpy as np

    assert OpSpec.from_inputs(*inputs(), scale=1).scale == 1.0
    assert OpSpec.from_inputs(*inputs(), scale=np.float32(0.25)).scale == 0.25


@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_non_finite_scale(scale):
    with pytest.raises(ValueError, match="scale: expected a finite float"):
        OpSpec.from_inputs(*inputs(), scale=scale)


def test_public_functions_validate_before_running():
    args = inputs()
    args[0] = jnp.ones((B, T, H, DK + 1))
    with pytest.raises(ValueError, match="k: expected shape"):
        gdn2_forward(*args, backend="scan_baseline")
    with pytest.raises(ValueError, match="k: expected shape"):
        gdn2_token_serial_reference(*args)
    with pytest.raises(TypeError, match="config: expected a KernelConfig"):
        gdn2_forward(*inputs(), config={"bt": 64}, backend="scan_baseline")
