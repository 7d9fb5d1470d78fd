"""The jax_ref backend of gdn2 (see backend.py); its own config is :class:`JaxRefConfig`."""

from gdn2_jax_ref.config import JaxRefConfig

__all__ = ["JaxRefConfig"]
