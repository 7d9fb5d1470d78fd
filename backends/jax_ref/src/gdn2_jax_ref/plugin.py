"""Entry point of the ``gdn2.backends`` group: hands gdn2core this package's backend."""

from gdn2core.plugin import hookimpl


@hookimpl
def gdn2_backend():
    """The jax_ref backend."""
    from gdn2_jax_ref.backend import JaxRefBackend

    return JaxRefBackend()
