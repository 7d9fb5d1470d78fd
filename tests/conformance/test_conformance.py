"""The shared conformance suite: every variant of variants.py against the token-serial reference.

Each check compares outputs, h_final and all seven gradients (loss = sum(o * do) + sum(h * dh))
with ``rel = max|actual - expected| / max|expected|``. Tolerances are keyed by dtype:

- float32: the chunked algorithm sums in another order than the serial scan and forms the WY
  inverse explicitly; ALGORITHM.md section 5.4 measures 2e-6 to 1e-5 for this in float32. Strong
  decay and erase gates up to 2 (negative eigenvalues) amplify rounding a few-fold, so outputs
  and states get 1e-4 and gradients (longer chains of products) 3e-4.
- bfloat16: inputs are the same bf16 values for both sides (the reference runs them in float32),
  so the difference is the backend's bf16 matmul operands: a few ulps of 2^-8 = 3.9e-3 over
  ~dk-term sums, hence 3e-2 for outputs and 6e-2 for gradients.
- float64: the same derivation in float64, rounding only: 1e-9.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2core import gdn2_forward, gdn2_forward_trainable, gdn2_token_serial_reference
from tests.conformance.variants import VARIANTS, Variant
from tests.support.inputs import Case, Inputs, make_inputs, rel_err
from tests.support.numpy_ref import gated_deltanet_numpy_loop, kda_numpy_loop

TOL_FWD = {"float32": 1e-4, "bfloat16": 3e-2, "float64": 1e-9}
TOL_GRAD = {"float32": 3e-4, "bfloat16": 6e-2, "float64": 1e-9}
GRAD_NAMES = ("q", "k", "v", "w", "b", "g", "h0")


def cases_for(variant: Variant) -> list[Case]:
    """T below one chunk, T = 1, T not a multiple of the chunk; dk != dv both ways; with and
    without h0; b in (0, 1) and (0, 2); weak, mixed and strong (g = -30) decay."""
    C = variant.config.bt
    square, *others = variant.head_sizes
    wide = others[0] if others else square
    tall = others[1] if len(others) > 1 else wide
    cases = [
        Case(B=2, T=2 * C + 3, H=2, dk=square[0], dv=square[1], h0=True, b_max=2.0, seed=1),
        Case(B=1, T=2 * C + 1, H=1, dk=wide[0], dv=wide[1], h0=True, decay="strong", seed=2),
    ]
    if variant.full:
        cases += [
            Case(
                B=1,
                T=max(1, C // 2 - 1),
                H=2,
                dk=square[0],
                dv=square[1],
                h0=False,
                decay="weak",
                seed=3,
            ),
            Case(B=1, T=1, H=1, dk=wide[0], dv=wide[1], h0=True, seed=4),
            Case(
                B=1,
                T=C + 5,
                H=2,
                dk=tall[0],
                dv=tall[1],
                h0=False,
                b_max=2.0,
                decay="strong",
                seed=5,
            ),
        ]
    return cases


PARAMS = [
    pytest.param(variant, case, id=f"{variant.id}-{case.id}")
    for variant in VARIANTS
    for case in cases_for(variant)
]


def loss_fn(fn, x: Inputs, **kw):
    def loss(q, k, v, w, b, g, h0):
        o, h = fn(q, k, v, w, b, g, h0=h0, **kw)
        return jnp.sum(o.astype(x.do.dtype) * x.do) + jnp.sum(h * x.dh)

    return loss


def reference_grads(x: Inputs, h0):
    return jax.jit(jax.grad(loss_fn(gdn2_token_serial_reference, x), argnums=tuple(range(7))))(
        *x.args, h0
    )


def check_forward(variant: Variant, x: Inputs, ref: Inputs, tol: float):
    o, h = gdn2_forward(*x.args, h0=x.h0, config=variant.config, backend=variant.backend)
    o_ref, h_ref = gdn2_token_serial_reference(*ref.args, h0=ref.h0)
    assert o.dtype == x.v.dtype and o.shape == x.v.shape
    assert h.dtype == (jnp.float64 if x.q.dtype == jnp.float64 else jnp.float32)
    assert rel_err(o, o_ref) < tol, ("o", rel_err(o, o_ref))
    assert rel_err(h, h_ref) < tol, ("h_final", rel_err(h, h_ref))


def check_grads(variant: Variant, x: Inputs, ref: Inputs, tol: float):
    h0 = x.h0 if x.h0 is not None else jnp.zeros(x.dh.shape, x.dh.dtype)
    loss = loss_fn(gdn2_forward_trainable, x, config=variant.config, backend=variant.backend)
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(7))))(*x.args, h0)
    expected = reference_grads(ref, h0)
    for name, got, want in zip(GRAD_NAMES, grads, expected, strict=True):
        assert got.shape == want.shape, name
        assert rel_err(got, want) < tol, (name, rel_err(got, want))


@pytest.mark.parametrize(("variant", "case"), PARAMS)
def test_float32(variant, case):
    x = make_inputs(case)
    check_forward(variant, x, x, TOL_FWD["float32"])
    if variant.trainable:
        check_grads(variant, x, x, TOL_GRAD["float32"])


@pytest.mark.parametrize(
    ("variant", "case"), [p for p in PARAMS if "bfloat16" in p.values[0].dtypes]
)
def test_bfloat16_against_float32_reference(variant, case):
    x = make_inputs(case).astype(jnp.bfloat16)
    ref = x.astype(jnp.float32)  # the same bf16 values, computed in float32
    check_forward(variant, x, ref, TOL_FWD["bfloat16"])
    if variant.trainable:
        check_grads(variant, x, ref, TOL_GRAD["bfloat16"])


FLOAT64_VARIANTS = [v for v in VARIANTS if v.float64 and v.trainable]


@pytest.mark.parametrize("variant", FLOAT64_VARIANTS, ids=lambda v: v.id)
def test_float64_gradients_against_central_differences(variant, x64):
    """Derivation-independent: directional derivatives of the backend's own loss."""
    case = cases_for(variant)[1]  # strong decay, dk != dv, h0
    x = make_inputs(case, jnp.float64)
    check_forward(variant, x, x, TOL_FWD["float64"])
    loss = jax.jit(
        loss_fn(gdn2_forward_trainable, x, config=variant.config, backend=variant.backend)
    )
    primals = (*x.args, x.h0)
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(7))))(*primals)
    rng = np.random.default_rng(7)
    eps = 1e-6
    for i, name in enumerate(GRAD_NAMES):
        d = jnp.asarray(rng.standard_normal(primals[i].shape))
        plus = [p + eps * d if j == i else p for j, p in enumerate(primals)]
        minus = [p - eps * d if j == i else p for j, p in enumerate(primals)]
        fd = (loss(*plus) - loss(*minus)) / (2 * eps)
        ad = jnp.sum(grads[i] * d)
        # O(eps^2) truncation and O(1e-16 / eps) rounding, relative: 1e-6 is far above both
        # and far below any wrong term.
        assert abs(float(fd - ad)) <= 1e-6 * max(1.0, abs(float(ad))), (name, fd, ad)


def _beta_inputs(case: Case, scalar_decay: bool):
    x = make_inputs(case, jnp.float32)
    rng = np.random.default_rng(case.seed + 100)
    beta = jnp.asarray(
        1 / (1 + np.exp(-rng.standard_normal((case.B, case.T, case.H)))), jnp.float32
    )
    b = jnp.broadcast_to(beta[..., None], x.b.shape)
    w = jnp.broadcast_to(beta[..., None], x.w.shape)
    g = jnp.broadcast_to(x.g[..., :1], x.g.shape) if scalar_decay else x.g
    return x, beta, b, w, g


def _run_with_beta_gates(variant: Variant, scalar_decay: bool, decay: str, seed: int):
    """The backend with b = w = beta (and optionally scalar g): inputs, beta, g and its output."""
    dk, dv = variant.head_sizes[0]
    case = Case(B=1, T=2 * variant.config.bt + 3, H=2, dk=dk, dv=dv, decay=decay, seed=seed)
    x, beta, b, w, g = _beta_inputs(case, scalar_decay=scalar_decay)
    o, h = gdn2_forward(
        x.q, x.k, x.v, w, b, g, scale=0.5, h0=x.h0, config=variant.config, backend=variant.backend
    )
    return x, beta, g, o, h


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.id)
def test_reduces_to_kimi_delta_attention(variant):
    """b = w = beta: KDA, written independently (tests/support/numpy_ref.py)."""
    x, beta, g, o, h = _run_with_beta_gates(variant, False, "strong", 21)
    o_np, h_np = kda_numpy_loop(x.q, x.k, x.v, g, beta, 0.5, x.h0)
    assert rel_err(o, o_np) < TOL_FWD["float32"]
    assert rel_err(h, h_np) < TOL_FWD["float32"]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.id)
def test_reduces_to_gated_deltanet(variant):
    """Additionally scalar g: Gated DeltaNet in its own transposed convention."""
    x, beta, g, o, h = _run_with_beta_gates(variant, True, "mixed", 22)
    o_np, h_np = gated_deltanet_numpy_loop(x.q, x.k, x.v, g[..., 0], beta, 0.5, x.h0)
    assert rel_err(o, o_np) < TOL_FWD["float32"]
    assert rel_err(h, h_np) < TOL_FWD["float32"]


@pytest.mark.parametrize(
    "variant", [v for v in VARIANTS if v.trainable and v.vmap], ids=lambda v: v.id
)
def test_jit_vmap_and_grad_compose(variant):
    """jit(vmap(...)) over an extra leading axis equals the per-slice calls; grad of a loss that
    uses both o and h_final is finite."""
    case = Case(
        B=1,
        T=variant.config.bt + 3,
        H=1,
        dk=variant.head_sizes[0][0],
        dv=variant.head_sizes[0][1],
        seed=23,
    )
    xs = [make_inputs(Case(**{**case.__dict__, "seed": s})) for s in (0, 1, 2)]
    stacked = [jnp.stack([getattr(x, n) for x in xs]) for n in ("q", "k", "v", "w", "b", "g", "h0")]

    def run(q, k, v, w, b, g, h0):
        return gdn2_forward_trainable(
            q, k, v, w, b, g, h0=h0, config=variant.config, backend=variant.backend
        )

    o, h = jax.jit(jax.vmap(run))(*stacked)
    for i, x in enumerate(xs):
        o_i, h_i = run(*x.args, x.h0)
        assert rel_err(o[i], o_i) < TOL_FWD["float32"]
        assert rel_err(h[i], h_i) < TOL_FWD["float32"]

    def loss(*args):
        o, h = run(*args)
        return jnp.sum(o**2) + jnp.sum(h)

    grads = jax.grad(loss, argnums=tuple(range(7)))(*[s[0] for s in stacked])
    assert all(bool(jnp.all(jnp.isfinite(gr))) for gr in grads)
