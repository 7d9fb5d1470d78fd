"""Suite-wide setup: CPU-only JAX (libtpu is installed for compile checks and must not start)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest


@pytest.fixture
def x64():
    """float64 enabled for the duration of one test."""
    previous = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)
