"""Flax NNX layers built on the GDN-2 operator (the optional ``flax`` extra).

``import gdn2core`` never imports this package; ``import gdn2core.layers`` needs
``pip install gdn2core[flax]``.
"""

try:
    import flax.nnx  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "gdn2core.layers needs Flax: pip install 'gdn2core[flax]' (flax>=0.11, optax>=0.2)"
    ) from err

from gdn2core.layers.gdn2_layer import GatedRMSNorm, GDN2Layer, ShortConv

__all__ = ["GDN2Layer", "GatedRMSNorm", "ShortConv"]
