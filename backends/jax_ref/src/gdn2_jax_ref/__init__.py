"""The jax_ref backend of gdn2 (see backend.py)."""
