"""The programs timed per row: forward, backward and forward+backward.

A row is a backend name, or :data:`REFERENCE_ROW` (``"reference_grad"``): the token-serial
reference, whose ``fwd`` is the reference forward and whose gradients are ``jax.vjp`` through it.

- ``fwd(xs, h0) -> (o, h_final)``: the inference forward (``gdn2_forward``).
- ``vjp_fwd(xs, h0) -> ((o, h_final), vjp_fn)``: the trainable forward with its residuals.
- ``bwd(vjp_fn, cts) -> grads``: the backward alone, from saved residuals.
- ``fwdbwd(xs, h0, cts) -> (o, h_final, grads)``: one training step's operator work.

``grads`` is ``(dq, dk, dv, dw, db, dg, dh0)`` for cotangents ``cts = (do, dh)``. ``fwd``,
``vjp_fwd`` and ``fwdbwd`` take an optional last argument ``opts``: a dict of non-differentiable
keywords of the call (the ``segment_ids`` of a packed row, see ``inputs.make_options``), traced as
an input of the compiled program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from gdn2core.config import KernelConfig
from gdn2core.ops.forward.api import gdn2_forward, gdn2_forward_trainable
from gdn2core.ops.forward.reference import gdn2_token_serial_reference

REFERENCE_ROW = "reference_grad"
MODES = ("fwd", "bwd", "fwdbwd")
MODE_LABELS = {"fwd": "forward", "bwd": "backward", "fwdbwd": "fwd+bwd"}


@dataclasses.dataclass(frozen=True)
class Programs:
    name: str
    fwd: Callable
    vjp_fwd: Callable
    bwd: Callable
    fwdbwd: Callable


def _make(name: str, infer: Callable, train: Callable) -> Programs:
    def fwd(xs, h0, opts=None):
        return infer(*xs, h0, **(opts or {}))

    def vjp_fwd(xs, h0, opts=None):
        return jax.vjp(lambda xs_, h0_: train(*xs_, h0_, **(opts or {})), xs, h0)

    def bwd(vjp_fn, cts):
        dxs, dh0 = vjp_fn(cts)
        return (*dxs, dh0)

    def fwdbwd(xs, h0, cts, opts=None):
        (o, h), vjp_fn = jax.vjp(lambda xs_, h0_: train(*xs_, h0_, **(opts or {})), xs, h0)
        dxs, dh0 = vjp_fn(cts)
        return o, h, (*dxs, dh0)

    return Programs(name, fwd, vjp_fwd, bwd, fwdbwd)


def reference_programs() -> Programs:
    """The programs of the ``reference_grad`` row (the token-serial reference, autodiff)."""

    def reference(q, k, v, w, b, g, h0, **opts):
        return gdn2_token_serial_reference(q, k, v, w, b, g, None, h0, **opts)

    return _make(REFERENCE_ROW, reference, reference)


def backend_programs(name: str, config: KernelConfig | None = None) -> Programs:
    """The programs of a backend row (the public ops with ``backend=name``)."""

    def infer(q, k, v, w, b, g, h0, **opts):
        return gdn2_forward(q, k, v, w, b, g, None, h0, config, name, **opts)

    def train(q, k, v, w, b, g, h0, **opts):
        return gdn2_forward_trainable(q, k, v, w, b, g, None, h0, config, name, **opts)

    return _make(name, infer, train)


def programs_for(name: str, config: KernelConfig | None = None) -> Programs:
    """The programs of row ``name`` (a backend, or ``reference_grad``)."""
    return reference_programs() if name == REFERENCE_ROW else backend_programs(name, config)
