"""The kernels' chunk math that runs outside a kernel too (plain JAX on the CPU): the lower-half
rows of a level and the WY inverse by levels, against NumPy in float64; the products per unit
(the compiled kernels) against the batched ones (interpret mode)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_pallas_tpu import chunk_math as cm
from gdn2_pallas_tpu import matmul
from gdn2_pallas_tpu.matmul import MatmulPrecision, mm, mm_nt, mm_tn, traced_for


@pytest.mark.parametrize("C", [64, 128])
def test_lower_rows_of_every_tile_level(C):
    x = np.arange(2 * C * 3, dtype=np.float32).reshape(2, C, 3)
    for level in range(3, cm.n_levels(C)):  # h = 8 and up: whole sublane tiles
        h = 1 << level
        rows = np.array([r for r in range(C) if r & h])  # the lower halves, in order
        np.testing.assert_array_equal(np.asarray(cm.lower_rows(jnp.asarray(x), h)), x[:, rows])
        new = -np.ones((2, C // 2, 3), np.float32)
        expected = x.copy()
        expected[:, rows] = new
        got = cm.with_lower_rows(jnp.asarray(x), jnp.asarray(new), h)
        np.testing.assert_array_equal(np.asarray(got), expected)
        # the level's pairs restricted to those rows
        full = np.asarray(cm.level_pairs(C, level))
        np.testing.assert_array_equal(np.asarray(cm.lower_level_pairs(C, level)), full[rows])


@pytest.mark.parametrize(("C", "wy_eps"), [(64, 0.0), (64, 1e-3), (32, 0.25), (16, 0.0)])
def test_wy_inverse_by_levels_matches_the_dense_inverse(C, wy_eps):
    rng = np.random.default_rng(C)
    # Entries of size 0.1: |T| stays O(1), so float32 products leave ~1e-6 of it; a wrong level
    # (its correction on the wrong rows, the level-0 term without its square) gives O(0.1).
    A = np.tril(0.1 * rng.standard_normal((3, C, C)), -1)  # [U, C, C] f64
    T = cm.wy_inverse(jnp.asarray(A, jnp.float32), wy_eps, MatmulPrecision.F32)
    expected = np.linalg.inv((1.0 + wy_eps) * np.eye(C) + A)
    err = np.max(np.abs(np.asarray(T, np.float64) - expected))
    assert err < 1e-5 * np.max(np.abs(expected)), err
    assert np.max(np.abs(np.triu(np.asarray(T), 1))) == 0.0  # lower triangular


@pytest.mark.parametrize("precision", list(MatmulPrecision))
def test_products_per_unit_equal_the_batched_ones(precision):
    # The compiled kernels multiply unit by unit (matmul._dot), interpret mode batches: the same
    # products, so the results must agree to the last bit (up to float32 summation order: none
    # differs here, as each output is one dot product of the same operands either way).
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.standard_normal((5, 16, 32)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((5, 32, 8)), jnp.float32)
    bt = jnp.swapaxes(b, 1, 2)
    for name, fn, args in (
        ("mm", mm, (a, b)),
        ("mm_nt", mm_nt, (a, bt)),
        ("mm_tn", mm_tn, (jnp.swapaxes(a, 1, 2), b)),
    ):
        per_unit = fn(*args, precision)
        batched = traced_for(lambda f=fn, x=args: f(*x, precision), True)()
        expected = np.einsum("umk,ukn->umn", np.asarray(a, np.float64), np.asarray(b, np.float64))
        np.testing.assert_array_equal(np.asarray(per_unit), np.asarray(batched), err_msg=name)
        # and both are the product (bf16 rounding of the operands: 2^-8 relative, summed over 32)
        assert np.max(np.abs(np.asarray(per_unit) - expected)) < 0.1, name


@pytest.mark.parametrize(
    ("mxu_depth", "depth"),
    [(128, 64), (128, 128), (256, 128)],
    ids=["v5e-2-pass", "v5e-3-pass", "v6e-2-pass"],
)
@pytest.mark.parametrize("precision", [MatmulPrecision.BF16X3, MatmulPrecision.BF16X3_SPLIT])
def test_bf16x3_products_against_float64(precision, mxu_depth, depth):
    """float32 products in bf16x3, per unit and batched, every orientation, against NumPy in
    float64, for an MXU ``mxu_depth`` deep (v5e 128, v6e 256): two passes at a contraction of
    at most half of it (``[a_hi | a_lo] @ [b_hi ; b_hi]`` and ``a_hi @ b_lo``), three above
    (Mosaic's own on a TPU; written out in interpret mode, or here float32 on the CPU).
    ``hi*hi + hi*lo + lo*hi`` leaves the dropped ``lo*lo`` (2^-18 of each term) and float32
    rounding: about 5e-6 of the largest entry at these sizes (measured); the bound 5e-5 is 10x
    that and 40x below what a dropped ``hi*lo`` or ``lo*hi`` leaves (each 2^-9 of a term: about
    2e-3)."""
    rng = np.random.default_rng(depth)
    a = jnp.asarray(rng.standard_normal((3, 64, depth)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((3, depth, 128)), jnp.float32)
    bt, at = jnp.swapaxes(b, 1, 2), jnp.swapaxes(a, 1, 2)
    expected = np.einsum("umk,ukn->umn", np.asarray(a, np.float64), np.asarray(b, np.float64))
    for name, fn, args in (
        ("mm", mm, (a, b)),
        ("mm_nt", mm_nt, (a, bt)),
        ("mm_tn", mm_tn, (at, b)),
    ):
        for batched in (False, True):
            got = traced_for(lambda f=fn, x=args: f(*x, precision), batched, mxu_depth)()
            err = np.max(np.abs(np.asarray(got, np.float64) - expected)) / np.max(np.abs(expected))
            assert err < 5e-5, (name, batched, err)


def test_float32_products_pack_to_half_the_plans_mxu_depth():
    """The kernels trace their products for the plan's MXU (``traced_for(..., plan.mxu_depth)``):
    a 128-deep float32 product is two passes on v6e's 256-deep MXU and three on v5e's, visible
    as the number of products in its program; outside a kernel, v5e's depth."""
    import jax

    a = jnp.ones((1, 64, 128), jnp.float32)
    b = jnp.ones((1, 128, 128), jnp.float32)

    def products(mxu_depth):
        body = traced_for(lambda: mm(a, b, MatmulPrecision.BF16X3_SPLIT), False, mxu_depth)
        return str(jax.make_jaxpr(body)()).count("dot_general")

    assert (products(128), products(256)) == (3, 2)
    assert matmul._HALF_PASS.get() == matmul.DEFAULT_MXU_DEPTH // 2  # reset after tracing


def test_batching_is_set_only_while_a_kernel_is_traced():
    assert not matmul._BATCHED.get()
    assert traced_for(matmul._BATCHED.get, True)() is True
    assert traced_for(matmul._BATCHED.get, False)() is False
    assert not matmul._BATCHED.get()


@pytest.mark.parametrize("batched", [False, True], ids=["per-unit", "batched"])
def test_row_sums_on_the_mxu_against_float64_cumsums(batched):
    """chunk_math.row_sums_on_mxu (the bfloat16 backward's Γ and dg) against NumPy's float64
    cumsums, per unit (the compiled kernels) and batched (interpret mode). One piece of
    bfloat16 numbers: float32 sums of the exact values, so within float32 rounding of the sums
    (64 terms: 1e-6 of the largest partial sum); two pieces of float32 values: each term to 16
    significant bits (2^-16 of it, 1.5e-5) before the same sums. A wrong matrix (the reverse
    sum for the exclusive one, the diagonal in or out) is off by a whole term, O(1)."""
    rng = np.random.default_rng(7)
    U, C, d = 3, 64, 128
    g = np.asarray(jnp.asarray(-rng.exponential(2.0, (U, C, d)), jnp.bfloat16), np.float64)
    a, b = rng.standard_normal((2, U, C, d))
    ones = np.tril(np.ones((C, C)))
    want_g = np.einsum("rs,usd->urd", ones, g)  # inclusive
    want_ab = np.einsum("rs,usd->urd", ones.T, a) + np.einsum("rs,usd->urd", ones - np.eye(C), b)

    def run(terms, parts):
        body = functools.partial(cm.row_sums_on_mxu, terms, parts)
        return np.asarray(traced_for(body, batched)(), np.float64)

    got_g = run([(jnp.asarray(g, jnp.float32), "inclusive")], 1)
    assert np.max(np.abs(got_g - want_g)) <= 1e-6 * np.max(np.abs(want_g))
    terms = [(jnp.asarray(a, jnp.float32), "reverse"), (jnp.asarray(b, jnp.float32), "exclusive")]
    got_ab = run(terms, 2)
    assert np.max(np.abs(got_ab - want_ab)) <= 2**-16 * C * max(np.abs(a).max(), np.abs(b).max())
