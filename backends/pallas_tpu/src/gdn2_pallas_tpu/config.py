"""``PallasTpuConfig``: pallas_tpu's own config.

The Pallas kernels read the core fields ``bt`` (the chunk length C of the level scheme; one of
``plan.SUPPORTED_CHUNKS``, checked by ``supports()``), ``wy_eps`` (the WY damping) and
``interpret`` (TPU interpret mode, for tests off a TPU). Their scheme forms scores and the WY
inverse by levels (docs/algorithm.md), so they have no score sub-chunk, no WY micro-block and no
clip (it never forms a positive exponent: chunk_math.py); the rest of a call's blocking (heads and
chunks per grid step, the VMEM limit) follows from the shape and the VMEM byte model (plan.py,
decode_plan.py), not from a knob.

The fields the class adds are the knobs of TPU interpret mode (``pltpu.InterpretParams``), for
tests that want more of the interpreter than its defaults (one core, no race detection):

- ``interpret_detect_races``: the interpreter's happens-before race detector
  (``InterpretParams.detect_races``; ``on_race="raise"``: a race makes the call raise with
  ``RACE DETECTED`` in the message). Races between grid steps only exist across cores, so it
  is meant with ``interpret_cores > 1``.
- ``interpret_cores``: the simulated TensorCores per device (``num_cores_or_threads``): the
  "parallel" grid axes are split among them, each core runs its share on a thread of its own.
  The plans block for them as for a chip's own (plan.py: 2 cores, as on v5p, give both cores
  grid points where the heads allow), so that the blocking a two-core chip compiles is the one
  the race detector runs.
- ``interpret_seed``: the seed of the order in which the points of the "parallel" grid axes are
  visited (``random_seed``); None: the interpreter's default order (a fixed permutation).

They are refused without ``interpret=True`` (a compiled kernel has none of them): the
constructor raises, naming the knob. :meth:`PallasTpuConfig.interpret_mode` gives them to the
plans as one hashable value (:class:`InterpretMode`), which ``blocks.interpret_params`` turns into
the ``pltpu.InterpretParams`` of every ``pallas_call``.

The backend reads its config only through :meth:`PallasTpuConfig.from_config` (plan.py and
decode_plan.py; backend.py through their checks): a core ``KernelConfig`` becomes a
``PallasTpuConfig`` with the same fields (and the interpreter's defaults), and another backend's
config class (a ``JaxRefConfig``, say) is refused by name: ``config: expected a KernelConfig or
PallasTpuConfig, got JaxRefConfig`` (a refusing verdict from ``supports()`` /
``supports_decode()``, a ``TypeError`` from the plans).
"""

from __future__ import annotations

import dataclasses
from typing import Final, Self

from pydantic import Field, model_validator

from gdn2core.plugin import KernelConfig

#: The simulated cores of interpret mode at most: each runs on a thread of its own, and the
#: hosts that run these tests have a few CPU cores (a real TPU chip has 1 or 2 TensorCores).
MAX_INTERPRET_CORES: Final = 8


@dataclasses.dataclass(frozen=True, slots=True)
class InterpretMode:
    """How TPU interpret mode runs the kernels (a plan's ``interpret``; hashable).

    Attributes:
        detect_races: ``InterpretParams.detect_races`` (a race raises).
        cores: ``InterpretParams.num_cores_or_threads``.
        seed: ``InterpretParams.random_seed`` (None: the interpreter's default order).
    """

    detect_races: bool = False
    cores: int = 1
    seed: int | None = None


class PallasTpuConfig(KernelConfig):
    """The core fields (``bt``, ``wy_eps``, ``interpret``) and the knobs of interpret mode
    (``interpret_detect_races``, ``interpret_cores``, ``interpret_seed``; module docstring).
    Frozen, hashable, strict and closed like the core class."""

    interpret_detect_races: bool = Field(
        False, description="interpret mode: detect races between cores (a race raises)"
    )
    interpret_cores: int = Field(
        1, ge=1, le=MAX_INTERPRET_CORES, description="interpret mode: simulated cores per device"
    )
    interpret_seed: int | None = Field(
        None, ge=0, lt=2**32, description="interpret mode: seed of the parallel grid axes' order"
    )

    @model_validator(mode="after")
    def _interpret_knobs_need_interpret(self) -> Self:
        """The interpret-mode knobs away from their defaults need ``interpret=True``."""
        if self.interpret:
            return self
        for name in ("interpret_detect_races", "interpret_cores", "interpret_seed"):
            value, default = getattr(self, name), type(self).model_fields[name].default
            if value != default:
                raise ValueError(
                    f"{name}: a knob of TPU interpret mode, expected {default!r} without "
                    f"interpret=True, got {value!r} (pass interpret=True, or leave {name} out)"
                )
        return self

    def interpret_mode(self) -> InterpretMode | None:
        """The interpret-mode knobs as the plans carry them.

        Returns:
            None without ``interpret`` (compiled kernels), else the :class:`InterpretMode`.
        """
        if not self.interpret:
            return None
        return InterpretMode(
            detect_races=self.interpret_detect_races,
            cores=self.interpret_cores,
            seed=self.interpret_seed,
        )
