"""Flax NNX layers built on the GDN-2 operator (the optional ``flax`` extra).

``import gdn2core`` never imports this package; ``import gdn2core.layers`` needs Flax.
"""

import importlib.util

from gdn2core.install import pip_command

try:
    import flax.nnx  # noqa: F401
except Exception as err:  # pragma: no cover - depends on the environment
    if importlib.util.find_spec("flax") is None:
        raise ImportError(
            "gdn2core.layers needs Flax, which is not installed: "
            + pip_command("gdn2core", "gdn2core", "flax")
        ) from err
    raise ImportError(
        f"gdn2core.layers needs Flax, which is installed but fails to import "
        f"({type(err).__name__}: {err}); gdn2core[flax] needs flax>=0.12.10 with this JAX"
    ) from err

from gdn2core.layers.gdn2_layer import GatedRMSNorm, GDN2Cache, GDN2Layer, ShortConv
from gdn2core.layers.ragged import GDN2RaggedCache

__all__ = ["GDN2Cache", "GDN2Layer", "GDN2RaggedCache", "GatedRMSNorm", "ShortConv"]
