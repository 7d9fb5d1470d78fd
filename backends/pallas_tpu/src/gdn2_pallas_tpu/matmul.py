"""Matrix products inside the kernels, at an explicit MXU precision.

Every product runs on a batch of units (axis 0: one unit is one chunk of one head) with float32
accumulation. The precision is spelled out in the operands rather than left to a compiler flag, so
that TPU interpret mode on a CPU computes what the TPU computes:

- ``BF16``: both operands rounded to bfloat16, one MXU pass. Used for bfloat16 inputs.
- ``BF16X3``: each float32 operand split into a bfloat16 high part and a bfloat16 remainder;
  ``hi*hi + hi*lo + lo*hi`` in three MXU passes (the ``lo*lo`` term, below float32 rounding of
  the result for these magnitudes, is dropped). Used for float32 inputs. On a TPU this is Mosaic's
  own ``Precision.HIGH`` (``bf16x3``, 13% faster than the same passes written out: static cycle
  estimate of the float32 forward); in TPU interpret mode the passes are written out
  (``BF16X3_SPLIT``), so that a CPU computes the TPU's rounding rather than exact float32.
  A product whose contraction is at most half as deep as the target's MXU (v5e's is 128 deep:
  the chunk's ``C = 64``, in ``T``, ``A_qk``, the state updates ``K̃^T R``; v6e's 256: every
  product of ``d = 128`` too) would fill half of each of Mosaic's three passes; on a TPU and in
  interpret mode alike it runs as two full ones instead, ``[a_hi | a_lo] @ [b_hi ; b_hi]``
  (``hi*hi + lo*hi``, at twice the depth) and ``a_hi @ b_lo``: the same three terms
  (:func:`_bf16x3_packed`; the depth is the plan's, :func:`traced_for`).
- ``F32``: ``Precision.HIGHEST`` (the full float32 product, about six passes); for the few tiny
  products whose exactness matters more than their cost.

docs/algorithm.md section 10 ("Precision") has the measured errors of each choice.
"""

from __future__ import annotations

import contextvars
import enum
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
BF16 = jnp.bfloat16

#: The MXU's contraction depth assumed outside a kernel (:func:`traced_for` sets the plan's): v5e's.
DEFAULT_MXU_DEPTH = 128

#: Whether a batch of units' products is one batched ``dot_general`` (TPU interpret mode, which
#: dispatches every product on its own: ``U`` of them took three times as long in the tests) or
#: ``U`` two-dimensional ones (the compiled kernels; :func:`_dot` says why). The same products
#: either way. Set while a kernel body is traced (:func:`traced_for`); per unit outside one.
_BATCHED = contextvars.ContextVar("gdn2_pallas_tpu_batched_units", default=False)
#: The deepest contraction that ``BF16X3`` packs into two passes (:func:`_bf16x3_packed`): half
#: the target MXU's depth. Static estimate of the float32 train step's kernels (B=1 T=1024 H=6):
#: v5e 250,802 -> 222,449 cycles; v6e 223,743 -> 174,928 (docs/algorithm.md section 10).
_HALF_PASS = contextvars.ContextVar("gdn2_pallas_tpu_half_pass", default=DEFAULT_MXU_DEPTH // 2)


def traced_for(body: Callable, interpret: bool, mxu_depth: int = DEFAULT_MXU_DEPTH) -> Callable:
    """``body`` (a kernel) traced with its products batched in interpret mode, per unit else,
    and its float32 products packed for an MXU ``mxu_depth`` deep (``Plan.mxu_depth``)."""

    def traced(*args, **kwargs):
        tokens = _BATCHED.set(interpret), _HALF_PASS.set(mxu_depth // 2)
        try:
            return body(*args, **kwargs)
        finally:
            _BATCHED.reset(tokens[0])
            _HALF_PASS.reset(tokens[1])

    return traced


class MatmulPrecision(enum.Enum):
    """How a kernel product uses the MXU (see the module docstring)."""

    BF16 = "bf16"
    BF16X3 = "bf16x3"
    BF16X3_SPLIT = "bf16x3-split"
    F32 = "f32"

    def for_interpret(self) -> MatmulPrecision:
        """The precision that computes the same rounding in TPU interpret mode."""
        return MatmulPrecision.BF16X3_SPLIT if self is MatmulPrecision.BF16X3 else self


def split_bf16(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x ~= hi + lo`` with both parts bfloat16 (``hi`` is ``x`` rounded, ``lo`` the rest)."""
    hi = x.astype(BF16)
    lo = (x.astype(F32) - hi.astype(F32)).astype(BF16)
    return hi, lo


def split_bf16_exact(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x = hi + mid + lo`` exactly for float32 ``x``, each part bfloat16 (8 significant bits
    each: 24 in all, a float32's; the rests ``x - hi`` and ``x - hi - mid`` are exact in float32).
    An infinite or NaN ``x`` (or one whose ``hi`` overflows) is ``hi`` alone, ``mid = lo = 0``."""
    x = x.astype(F32)
    hi = x.astype(BF16)
    hi32 = hi.astype(F32)  # (Mosaic takes isfinite of float32 only)
    rest = jnp.where(jnp.isfinite(hi32), x - hi32, 0.0)
    mid = rest.astype(BF16)
    lo = (rest - mid.astype(F32)).astype(BF16)
    return hi, mid, lo


def _dot(a: jax.Array, b: jax.Array, contract, precision: MatmulPrecision) -> jax.Array:
    """The product of every unit, each as its own two-dimensional product, stacked.

    Not one batched ``dot_general``: Mosaic rounds a three-dimensional float32 array to bfloat16
    into half-filled (8, 128) tiles (one pack per float32 vreg) and then repacks them into the
    (16, 128) tiles the MXU reads (an unpack and a pack more per vreg), where a two-dimensional
    one is one pack per two vregs. Those conversions were a third of the vector ALU's work in
    the kernels (static estimate, B = 1, T = 1024, H = 6, v5e, bf16: the forward kernel 62,218
    -> 54,165 cycles, the backward 110,070 -> 100,993, from this alone)."""
    if _BATCHED.get():
        return _dot_any(a, b, (contract, ((0,), (0,))), precision)  # batch over axis 0 (units)
    (ca,), (cb,) = contract
    dims = (((ca - 1,), (cb - 1,)), ((), ()))  # of one unit's [m, k] and [k, n] (or [n, k])
    return jnp.stack([_dot_any(a[u], b[u], dims, precision) for u in range(a.shape[0])])


def _dot_any(a: jax.Array, b: jax.Array, dims, precision: MatmulPrecision) -> jax.Array:
    (ca,), _ = dims[0]
    three_terms = precision in (MatmulPrecision.BF16X3, MatmulPrecision.BF16X3_SPLIT)
    if three_terms and a.shape[ca] <= _HALF_PASS.get():  # half a pass deep: two full ones
        return _bf16x3_packed(a, b, dims)
    if precision is MatmulPrecision.F32:
        return lax.dot_general(
            a.astype(F32),
            b.astype(F32),
            dims,
            precision=lax.Precision.HIGHEST,
            preferred_element_type=F32,
        )
    if precision is MatmulPrecision.BF16:
        return lax.dot_general(a.astype(BF16), b.astype(BF16), dims, preferred_element_type=F32)
    if precision is MatmulPrecision.BF16X3:
        return lax.dot_general(
            a.astype(F32),
            b.astype(F32),
            dims,
            precision=lax.Precision.HIGH,
            preferred_element_type=F32,
        )
    a_hi, a_lo = split_bf16(a)
    b_hi, b_lo = split_bf16(b)

    def one_pass(x, y):
        return lax.dot_general(x, y, dims, preferred_element_type=F32)

    return one_pass(a_hi, b_hi) + (one_pass(a_hi, b_lo) + one_pass(a_lo, b_hi))


def _bf16x3_packed(a: jax.Array, b: jax.Array, dims) -> jax.Array:
    """``hi*hi + hi*lo + lo*hi`` of ``a``, ``b`` (``dims``: ``lax.dot_general``'s) in two MXU
    passes: ``[a_hi | a_lo]`` against ``[b_hi ; b_hi]``, concatenated along the contraction (a
    product half the MXU deep fills one pass with both terms), and ``a_hi`` against ``b_lo``."""
    (ca,), (cb,) = dims[0]
    a_hi, a_lo = split_bf16(a)
    b_hi, b_lo = split_bf16(b)
    both = lax.dot_general(
        jnp.concatenate([a_hi, a_lo], axis=ca),
        jnp.concatenate([b_hi, b_hi], axis=cb),
        dims,
        preferred_element_type=F32,
    )  # hi*hi + lo*hi
    return both + lax.dot_general(a_hi, b_lo, dims, preferred_element_type=F32)


def mm(a: jax.Array, b: jax.Array, precision: MatmulPrecision) -> jax.Array:
    """``a @ b`` per unit: [U, m, k] x [U, k, n] -> [U, m, n] float32."""
    return _dot(a, b, ((2,), (1,)), precision)


def mm_nt(a: jax.Array, b: jax.Array, precision: MatmulPrecision) -> jax.Array:
    """``a @ b^T`` per unit: [U, m, k] x [U, n, k] -> [U, m, n] float32."""
    return _dot(a, b, ((2,), (2,)), precision)


def mm_tn(a: jax.Array, b: jax.Array, precision: MatmulPrecision) -> jax.Array:
    """``a^T @ b`` per unit: [U, k, m] x [U, k, n] -> [U, m, n] float32."""
    return _dot(a, b, ((1,), (1,)), precision)


def mm_shared(
    a: jax.Array, b_of: Callable[[int | None], jax.Array], units: int, precision: MatmulPrecision
) -> jax.Array:
    """``a @ b`` per unit with one ``a`` [m, k] for every unit: ``b_of(u)`` is unit u's [k, n]
    (formed from its two-dimensional slices, so that a bfloat16 cast inside it is two-dimensional,
    :func:`_dot`), ``b_of(None)`` all units' [U, k, n] at once (interpret mode's one batched
    product) -> [U, m, n] float32."""
    if _BATCHED.get():
        b = b_of(None)
        a = jnp.broadcast_to(a, (b.shape[0], *a.shape))
        return _dot_any(a, b, (((2,), (1,)), ((0,), (0,))), precision)
    dims = (((1,), (0,)), ((), ()))
    return jnp.stack([_dot_any(a, b_of(u), dims, precision) for u in range(units)])
