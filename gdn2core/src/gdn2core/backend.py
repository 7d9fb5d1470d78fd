"""What a backend is: the base class every backend distribution subclasses, and its small types.

A backend distribution exposes a module under the entry-point group ``gdn2.backends``; that module
implements the pluggy hook ``gdn2_backend()`` (see :mod:`gdn2core.hooks`) returning one instance of
a :class:`Backend` subclass.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import jax
from pydantic import BaseModel, ConfigDict

from gdn2core.config import KernelConfig
from gdn2core.spec import OpSpec


class Capabilities(BaseModel):
    """What a backend can run, as advertised by ``list_backends()`` and ``gdn2 info``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float64")
    dk: tuple[int, ...] | None = None  # None: any key head size
    dv: tuple[int, ...] | None = None  # None: any value head size
    trainable: bool = True
    platforms: tuple[str, ...] = ("cpu", "gpu", "tpu")

    def describe(self) -> str:
        heads = "any" if self.dk is None else "/".join(map(str, self.dk))
        vals = "any" if self.dv is None else "/".join(map(str, self.dv))
        parts = [
            ",".join(d.replace("float", "f").replace("bf16", "bf16") for d in self.dtypes),
            f"dk {heads}",
            f"dv {vals}",
            "trainable" if self.trainable else "forward only",
            "on " + "/".join(self.platforms),
        ]
        return "; ".join(parts)


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """A yes/no with the reason, for availability and ``supports``."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


YES: Verdict = Verdict(True)


class Backend(abc.ABC):
    """A GDN-2 implementation. Subclasses set the class attributes and implement ``forward``.

    Every array method receives validated inputs in the public layout: q, k, b, g ``(B, T, H, dk)``;
    v, w ``(B, T, H, dv)``; ``h0`` is always present (zeros when the user gave none), float32
    ``(B, H, dk, dv)`` (float64 for float64 inputs). They return ``(o, h_final)`` with o in v's
    dtype and h_final in h0's dtype.
    """

    name: ClassVar[str]
    priority: ClassVar[int]  # higher wins under backend="auto"
    capabilities: ClassVar[Capabilities]

    def availability(self) -> Verdict:
        """Whether this backend can run at all in this process (libraries, platform)."""
        return YES

    def auto_selectable(self) -> Verdict:
        """Whether ``backend="auto"`` may pick it here (a named backend ignores this)."""
        return self.availability()

    def supports(self, spec: OpSpec, config: KernelConfig) -> Verdict:
        """Whether this spec and config can run; the reason names what is refused."""
        caps = self.capabilities
        if spec.dtype not in caps.dtypes:
            return Verdict(False, f"dtype {spec.dtype} not in {caps.dtypes}")
        if caps.dk is not None and spec.dk not in caps.dk:
            return Verdict(False, f"dk={spec.dk} not in {caps.dk}")
        if caps.dv is not None and spec.dv not in caps.dv:
            return Verdict(False, f"dv={spec.dv} not in {caps.dv}")
        return YES

    @abc.abstractmethod
    def forward(
        self, q, k, v, w, b, g, h0, *, spec: OpSpec, config: KernelConfig
    ) -> tuple[jax.Array, jax.Array]:
        """Inference forward; need not be differentiable."""

    def forward_trainable(
        self, q, k, v, w, b, g, h0, *, spec: OpSpec, config: KernelConfig
    ) -> tuple[jax.Array, jax.Array]:
        """Differentiable forward (gradients in all of q, k, v, w, b, g, h0)."""
        if not self.capabilities.trainable:
            raise NotImplementedError(f"backend {self.name!r} is forward-only")
        return self.forward(q, k, v, w, b, g, h0, spec=spec, config=config)

    def __repr__(self) -> str:
        return f"<gdn2 backend {self.name!r} priority={self.priority}>"


def describe_object(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
