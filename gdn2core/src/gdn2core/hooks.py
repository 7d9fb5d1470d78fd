"""Every pluggy hook of gdn2, in one place, and the entry-point groups that load plugin modules.

- ``gdn2.backends``: one module per backend; the entry-point name is the backend's name. The module
  implements :meth:`HookSpecs.gdn2_backend` and may implement the other hooks.
- ``gdn2.tools``: modules of tool distributions (benchmarks, reports); they implement
  :meth:`HookSpecs.gdn2_commands`.

The core names no plugin: the ``gdn2`` command lists what the hooks hand it, and tools ask a
backend's own plugin for its report rows (:meth:`HookSpecs.gdn2_kernel_costs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import pluggy

if TYPE_CHECKING:
    from gdn2core.backend import Backend
    from gdn2core.config import KernelConfig
    from gdn2core.ops.forward.spec import OpSpec

PROJECT: Final = "gdn2"
BACKENDS_GROUP: Final = "gdn2.backends"
TOOLS_GROUP: Final = "gdn2.tools"

hookspec: Final = pluggy.HookspecMarker(PROJECT)
hookimpl: Final = pluggy.HookimplMarker(PROJECT)


@dataclasses.dataclass(frozen=True, slots=True)
class Command:
    """A ``gdn2`` subcommand.

    Attributes:
        name: the subcommand (``gdn2 NAME ...``).
        help: one line for ``gdn2 --help``.
        target: ``"module:function"``; the function takes the remaining argv (a list of str) and
            returns an exit code. The module is imported only when the subcommand runs.
    """

    name: str
    help: str
    target: str


@dataclasses.dataclass(frozen=True, slots=True)
class KernelCost:
    """One kernel of a backend, as a report row: compile-time cost and on-chip memory.

    Attributes:
        name: the kernel and what it does (e.g. ``"gdn2_fwd (inference)"``).
        flops: floating-point operations of one call.
        transcendentals: exp/log evaluations of one call.
        bytes_accessed: HBM bytes one call moves.
        min_bytes_accessed: the least HBM bytes any implementation must move (inputs and outputs
            once), or None.
        vmem_bytes: on-chip bytes of one grid step, by part (e.g. ``{"blocks": ..., "scratch":
            ..., "total": ...}``), or None.
        vmem_limit_bytes: the on-chip limit those bytes are planned against, or None.
        notes: one line on how the call is laid out (grid, blocking), or "".
    """

    name: str
    flops: float
    transcendentals: float
    bytes_accessed: float
    min_bytes_accessed: float | None = None
    vmem_bytes: dict[str, int] | None = None
    vmem_limit_bytes: int | None = None
    notes: str = ""


class HookSpecs:
    """The hooks a gdn2 plugin module may implement (decorate the functions with ``hookimpl``)."""

    @hookspec
    def gdn2_backend(self) -> Backend:
        """The backend of a ``gdn2.backends`` plugin (called once, when backends are discovered).

        Returns:
            One :class:`gdn2core.plugin.Backend` instance whose ``name`` is the entry-point name.
        """

    @hookspec
    def gdn2_commands(self) -> Sequence[Command]:
        """Subcommands this plugin adds to the ``gdn2`` command.

        Returns:
            A sequence of :class:`Command`.
        """

    @hookspec
    def gdn2_kernel_costs(self, spec: OpSpec, config: KernelConfig) -> Sequence[KernelCost] | None:
        """Report rows of this plugin's backend: one per kernel a call of ``spec`` runs.

        Called only on the plugin that provides the backend a report is about.

        Args:
            spec: the call.
            config: its kernel config.

        Returns:
            The rows, or None when the backend has no kernel-level model for this call.
        """
