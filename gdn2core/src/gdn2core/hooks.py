"""The pluggy hook specification of the ``gdn2.backends`` entry-point group."""

from __future__ import annotations

from typing import Final

import pluggy

PROJECT: Final = "gdn2"
ENTRY_POINT_GROUP: Final = "gdn2.backends"

hookspec: Final = pluggy.HookspecMarker(PROJECT)
hookimpl: Final = pluggy.HookimplMarker(PROJECT)


class BackendSpec:
    """Hooks a backend plugin module implements."""

    @hookspec
    def gdn2_backend(self):
        """Return one :class:`gdn2core.backend.Backend` instance (called once per plugin)."""
