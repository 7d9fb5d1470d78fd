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
