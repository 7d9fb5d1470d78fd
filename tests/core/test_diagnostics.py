"""GDN2_FWD_DIAG: reports per stage, never changes a value, and is free when off."""

import logging

import jax
import jax.numpy as jnp

from gdn2core.diagnostics import probe


def test_probe_reports_nonfinite_and_large(monkeypatch, caplog):
    monkeypatch.setenv("GDN2_FWD_DIAG", "1")
    caplog.set_level(logging.INFO, logger="gdn2core.diag")
    x = jnp.array([1.0, jnp.nan, jnp.inf, 2e6, -3e7, 5.0])
    y = jax.jit(lambda a: probe("unit stage", a) * 1.0)(x)
    jax.effects_barrier()
    err = caplog.text
    assert "[gdn2 diag] unit stage: non-finite=2 above 1e+06=2 max|finite|=3.000e+07" in err
    assert jnp.array_equal(y, x, equal_nan=True)


def test_probe_is_identity_and_silent_when_off(monkeypatch, capsys):
    monkeypatch.delenv("GDN2_FWD_DIAG", raising=False)
    x = jnp.array([jnp.nan, 1.0])
    jaxpr = jax.make_jaxpr(lambda a: probe("stage", a))(x)
    assert "callback" not in str(jaxpr)
    assert probe("stage", x) is x
    assert capsys.readouterr().err == ""


def test_probe_does_not_change_gradients(monkeypatch):
    monkeypatch.setenv("GDN2_FWD_DIAG", "1")
    grad = jax.grad(lambda a: jnp.sum(probe("g", a) ** 2))(jnp.arange(3.0))
    assert jnp.array_equal(grad, 2 * jnp.arange(3.0))


def test_nan_input_gives_nonfinite_outputs_and_diag_reports_them(monkeypatch, caplog):
    """docs/operator.md, "NaN and Inf inputs": a NaN in channel 0 of v at one token of head 1
    makes that channel's output at that token and every later one non-finite, and h_final's
    column 0 of head 1; head 0 stays finite; GDN2_FWD_DIAG=1 logs the non-finite counts."""
    from gdn2_conformance import Case, make_inputs
    from gdn2core import gdn2_forward

    monkeypatch.setenv("GDN2_FWD_DIAG", "1")
    caplog.set_level(logging.INFO, logger="gdn2core.diag")
    inp = make_inputs(Case(B=1, T=40, H=2, dk=16, dv=16, seed=3))
    v = inp.v.at[0, 17, 1, 0].set(jnp.nan)
    o, h = gdn2_forward(inp.q, inp.k, v, inp.w, inp.b, inp.g, backend="jax_ref")
    jax.effects_barrier()
    assert bool(jnp.isfinite(o[0, :, 0]).all()) and bool(jnp.isfinite(h[0, 0]).all())
    assert not bool(jnp.isfinite(o[0, 17:, 1, 0]).any())
    assert not bool(jnp.isfinite(h[0, 1, :, 0]).any())
    assert "[gdn2 diag] jax_ref o: non-finite=" in caplog.text
    assert "[gdn2 diag] jax_ref h_final: non-finite=" in caplog.text
