"""What a backend is: the base class every backend subclasses, its capabilities and its verdicts.

A backend distribution exposes a module under the entry-point group ``gdn2.backends``; that module
implements the hook ``gdn2_backend()`` (see :mod:`gdn2core.hooks`) returning one instance of a
:class:`Backend` subclass. Backend authors import all of this from :mod:`gdn2core.plugin`.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from typing import ClassVar, Final, Literal

import jax
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from gdn2core.checks import SUPPORTED_DTYPES
from gdn2core.config import KernelConfig
from gdn2core.features.gva import resolve_spec
from gdn2core.features.pooled import PoolRequests
from gdn2core.ops.decode.spec import DecodeSpec
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.options import NO_ACTIVATIONS, OpExtras, SegmentMode

Platform = Literal["cpu", "gpu", "tpu"]
DType = Literal["float32", "bfloat16", "float64"]
PLATFORMS: Final[tuple[Platform, ...]] = ("cpu", "gpu", "tpu")

#: What a backend name may look like (it is also an entry-point name and a CLI argument).
NAME_PATTERN: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
#: Names no backend may take: ``backend="auto"`` selects, it never names a backend.
RESERVED_NAMES: Final = frozenset({"auto"})


class Capabilities(BaseModel):
    """What a backend can run, declared once; the core enforces it on every call.

    Fields:
        dtypes: input dtypes it accepts.
        dk, dv: key and value head sizes it accepts (None: any).
        trainable: whether ``forward_trainable`` gives gradients (False: forward only).
        platforms: where its kernels run natively (``backend="auto"`` picks it only there).
        auto: whether ``backend="auto"`` may pick it at all (False for baselines and references,
            which run only when named).
        interpret: whether ``KernelConfig(interpret=True)`` runs its kernels off ``platforms`` (for
            example Pallas TPU kernels in interpret mode on a CPU); named calls only.
        segments: it takes ``extras.segment_ids`` (packed sequences, resets inside a row).
        varlen: it takes ``extras.cu_seqlens`` (B = 1, h0 and h_final per sequence).
        fused_activations: it applies ``spec.activations`` itself to the raw inputs (with
            ``extras.A_log`` / ``extras.dt_bias``); otherwise the core applies them in XLA first.
        decode: whether it implements :meth:`Backend.decode` (:func:`gdn2core.gdn2_decode`).
        decode_activations: its :meth:`Backend.decode` applies ``spec.activations`` itself to
            the raw tokens (with ``extras``, a keyword passed only then); otherwise the core
            applies them in XLA first and hands it activated tokens.
        grouped_decode: under grouped value heads its :meth:`Backend.decode` takes q, k with
            their own ``spec.key_heads`` heads and b, g with their own ``spec.gate_heads``
            (value head ``j`` reads head ``j // (HV / heads)`` of each); otherwise the core
            repeats them to the ``HV`` value heads first.
        chunk_states: whether it implements :meth:`Backend.forward_chunk_states`
            (``gdn2_forward(..., return_chunk_states=True)``).
        continued: its ``forward`` takes ``extras.continues`` with ``cu_seqlens`` (sequences
            that continue the state of the one before; the ragged op's one-pass path).
        pooled: whether it implements :meth:`Backend.forward_pooled` (the ragged op's packed
            requests read and write the pool's slots themselves).
        scalar_gates: its array methods take the gates ``spec.scalar_gates`` names as one value
            per head and token (b, g ``(B, T, H)``, w ``(B, T, H)``), and return their gradients
            in that shape; otherwise the core broadcasts them to their channels first
            (``gdn2core.features.scalar_gates``).
        grouped_keys: under grouped value heads with b, g on the value heads ("repeated keys",
            ``gdn2core.features.gva``), its ``forward``, ``forward_trainable`` and
            ``forward_chunk_states`` take q, k with their own ``H`` heads (not repeated to ``HV``)
            and return dq, dk in that shape; the spec it gets says so with ``key_groups = G``
            (head ``j`` of the plain call reads key head ``j // G``); so does its
            ``forward_pooled`` (the ragged op's packed requests). Not with ``cu_seqlens``
            otherwise, nor on a mesh (the core repeats them there).
        float32_decay: its array methods (the forwards, ``decode``, ``forward_pooled``) take
            ``g`` in float32 beside bfloat16 inputs (``spec.float32_decay``; fla's layers
            compute the log decay in float32) and return its gradient in float32; otherwise the
            core casts ``g`` to the inputs' dtype first.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    dtypes: tuple[DType, ...] = Field(SUPPORTED_DTYPES, min_length=1)
    dk: tuple[PositiveInt, ...] | None = None
    dv: tuple[PositiveInt, ...] | None = None
    trainable: bool = True
    platforms: tuple[Platform, ...] = Field(PLATFORMS, min_length=1)
    auto: bool = True
    interpret: bool = False
    segments: bool = False
    varlen: bool = False
    fused_activations: bool = False
    decode: bool = False
    decode_activations: bool = False
    grouped_decode: bool = False
    chunk_states: bool = False
    continued: bool = False
    pooled: bool = False
    scalar_gates: bool = False
    grouped_keys: bool = False
    float32_decay: bool = False

    def view(self, spec: OpSpec) -> OpSpec:
        """The spec this backend sees for a call of ``spec``: grouped value heads resolved
        (:func:`gdn2core.features.gva.resolve_spec`), and no activations unless it fuses them
        (the core then applies them in XLA before the call).

        Args:
            spec: the call's spec.

        Returns:
            The backend's spec (``spec`` itself when nothing changes).
        """
        view = resolve_spec(spec)
        if view.activations.any and not self.fused_activations:
            view = dataclasses.replace(view, activations=NO_ACTIVATIONS)
        return view

    def admits(self, spec: OpSpec | DecodeSpec) -> Verdict:
        """Whether ``spec``'s dtype and head sizes are within these capabilities.

        Args:
            spec: the call's spec.

        Returns:
            A :class:`Verdict` whose reason names the refused field.
        """
        if spec.dtype not in self.dtypes:
            return Verdict(False, f"dtype {spec.dtype} not in {self.dtypes}")
        if self.dk is not None and spec.dk not in self.dk:
            return Verdict(False, f"dk={spec.dk} not in {self.dk}")
        if self.dv is not None and spec.dv not in self.dv:
            return Verdict(False, f"dv={spec.dv} not in {self.dv}")
        if isinstance(spec, DecodeSpec):  # a decode call has no packed sequences
            return YES
        if spec.segments == SegmentMode.IDS and not self.segments:
            return Verdict(False, "segment_ids: packed sequences not supported (segments=False)")
        if spec.segments == SegmentMode.CU_SEQLENS and not self.varlen:
            return Verdict(
                False, "cu_seqlens: variable-length sequences not supported (varlen=False)"
            )
        if spec.continued and not self.continued:
            return Verdict(False, "continued sequences not supported (continued=False)")
        return YES

    def describe(self) -> str:
        """One line for ``gdn2 info``: dtypes, head sizes, trainability, platforms, and every model
        feature a call to it may use: the backend's own, then those the core provides for every
        backend (grouped value heads, and the activations in XLA unless the backend fuses them),
        marked "(core)"."""
        heads = "any" if self.dk is None else "/".join(map(str, self.dk))
        vals = "any" if self.dv is None else "/".join(map(str, self.dv))
        parts = [
            ",".join(d.replace("float", "f") for d in self.dtypes),
            f"dk {heads}",
            f"dv {vals}",
            "trainable" if self.trainable else "forward only",
            "on " + "/".join(self.platforms) + (" (+interpret)" if self.interpret else ""),
        ]
        extras = [
            name
            for name, on in (
                ("decode", self.decode),
                ("chunk states", self.chunk_states),
                ("continued sequences", self.continued),
                ("pooled requests", self.pooled),
            )
            if on
        ]
        if extras:
            parts.append(" + ".join(extras))
        if not self.auto:
            parts.append("named only")
        features = [
            name
            for name, on in (
                ("segment_ids", self.segments),
                ("cu_seqlens", self.varlen),
                ("fused activations", self.fused_activations),
                ("scalar gates", self.scalar_gates),
                ("float32 g", self.float32_decay),
            )
            if on
        ]
        # the core groups or repeats the heads; the backend reads repeated keys itself
        features.append(
            "grouped value heads (core" + (", keys read grouped)" if self.grouped_keys else ")")
        )
        if not self.fused_activations:
            features.append("activations (core, XLA)")  # applied by the core before the call
        parts.append("features: " + ", ".join(features))
        return "; ".join(parts)


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """A yes or no with the reason (the reason names what is refused)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


YES: Final = Verdict(True)


class Backend(abc.ABC):
    """A GDN-2 implementation. Subclasses set the class attributes and implement ``forward``.

    Class attributes (validated when the backend is loaded; a bad one makes only this backend
    broken): ``name`` (the entry-point name), ``priority`` (an int; higher wins under
    ``backend="auto"``), ``capabilities`` (a :class:`Capabilities`), and optionally
    ``shard_map_check_vma`` (a bool: have ``shard_map`` type-check the per-shard call).

    Every array method receives validated inputs in the public layout: q, k, b, g ``(B, T, H, dk)``;
    v, w ``(B, T, H, dv)``; ``h0`` is always present (zeros when the user gave none), float32
    ``(B, H, dk, dv)`` (float64 for float64 inputs). They return ``(o, h_final)`` with o in v's
    dtype and h_final in h0's dtype. The core has already checked the capabilities, the platform
    and :meth:`supports` before a method runs.

    Model features (``docs/backends.md``): grouped value heads are resolved by the core (a backend
    sees ``spec.value_heads == spec.gate_heads == spec.heads``; with ``Capabilities.grouped_keys``,
    q and k may keep ``spec.heads / spec.key_groups`` heads). With packed sequences
    (``Capabilities.segments`` / ``varlen``) or fused activations (``fused_activations``) the core
    passes ``extras=`` (an :class:`~gdn2core.options.OpExtras`); with ``cu_seqlens``, B = 1 and h0,
    h_final are ``(N, H, dk, dv)``. With ``Capabilities.scalar_gates``, the gates that
    ``spec.scalar_gates`` names come without their channel axis, ``(B, T, H)``. A plain call never
    passes ``extras``, so a backend written
    without it keeps working for plain calls.
    """

    name: ClassVar[str]
    priority: ClassVar[int]
    capabilities: ClassVar[Capabilities]
    shard_map_check_vma: ClassVar[bool] = False

    def availability(self) -> Verdict:
        """Whether this backend can run at all in this process (e.g. an optional library).

        Returns:
            :data:`YES`, or a :class:`Verdict` saying what is missing.
        """
        return YES

    def supports(self, spec: OpSpec, config: KernelConfig) -> Verdict:
        """Refusals beyond :class:`Capabilities` (for example a blocking that does not fit).

        Args:
            spec: the call's spec (already within the capabilities).
            config: the call's kernel config.

        Returns:
            :data:`YES`, or a :class:`Verdict` naming what is refused. A method that raises is
            treated as a refusal of this call only (and logged).
        """
        del spec, config
        return YES

    @abc.abstractmethod
    def forward(
        self,
        q,
        k,
        v,
        w,
        b,
        g,
        h0,
        *,
        spec: OpSpec,
        config: KernelConfig,
        extras: OpExtras | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """Inference forward; need not be differentiable.

        Args:
            q, k, v, w, b, g, h0: the validated inputs (see the class docstring).
            spec: their spec.
            config: the kernel config.
            extras: the arrays of the model features (segment_ids, cu_seqlens, A_log, dt_bias);
                passed only when the call has packed sequences or fused activations.

        Returns:
            ``(o, h_final)``.
        """

    def forward_trainable(
        self,
        q,
        k,
        v,
        w,
        b,
        g,
        h0,
        *,
        spec: OpSpec,
        config: KernelConfig,
        extras: OpExtras | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """Differentiable forward (gradients in all of q, k, v, w, b, g, h0, and in
        ``extras.A_log`` / ``extras.dt_bias`` when present).

        The default differentiates :meth:`forward` with JAX autodiff; a backend with a custom VJP
        overrides it. Arguments and result as for :meth:`forward`.
        """
        more = {} if extras is None else {"extras": extras}
        return self.forward(q, k, v, w, b, g, h0, spec=spec, config=config, **more)

    def forward_chunk_states(
        self,
        q,
        k,
        v,
        w,
        b,
        g,
        h0,
        *,
        spec: OpSpec,
        config: KernelConfig,
        extras: OpExtras | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Inference forward that also returns the state entering every chunk of ``config.bt``
        tokens (``gdn2_forward(..., return_chunk_states=True)``). Only called when
        ``capabilities.chunk_states`` is True; never with packed sequences (the core refuses
        ``return_chunk_states`` with ``segment_ids`` or ``cu_seqlens``).

        Args:
            q, k, v, w, b, g, h0, spec, config: as for :meth:`forward`.
            extras: as for :meth:`forward`: passed only when the backend fuses the activations
                of the call (``A_log``, ``dt_bias``).

        Returns:
            ``(o, h_final, chunk_states)``: chunk_states ``(B, ceil(T / bt), H, dk, dv)`` in h0's
            dtype, entry ``i`` the state after the first ``i * bt`` tokens (entry 0 is h0).
        """
        raise NotImplementedError(f"gdn2 backend {self.name!r} has no chunk states")

    def supports_decode(self, spec: DecodeSpec, config: KernelConfig) -> Verdict:
        """Refusals of a decode call beyond :class:`Capabilities` (only asked when
        ``capabilities.decode`` is True).

        Args:
            spec: the call's resolved decode spec.
            config: the call's kernel config.

        Returns:
            :data:`YES`, or a :class:`Verdict` naming what is refused.
        """
        del spec, config
        return YES

    def decode(
        self, q, k, v, w, b, g, state, slots, *, spec: DecodeSpec, config: KernelConfig,
        extras: OpExtras | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:  # fmt: skip
        """``S`` new tokens of ``N`` sequences against a state pool (:func:`gdn2core.gdn2_decode`).
        Only called when ``capabilities.decode`` is True.

        Args:
            q, k, b, g: ``(N, S, HV, dk)``; v, w: ``(N, S, HV, dv)``: grouped value heads are
                already expanded by the core (``spec.key_heads == spec.heads``), scalar gates
                broadcast; with ``capabilities.grouped_decode``, q, k ``(N, S, spec.key_heads,
                dk)`` and b, g ``(N, S, spec.gate_heads, dk)``. Raw when
                ``spec.activations.any`` (only for a backend with
                ``capabilities.decode_activations``), else activated by the core.
            state: the pool ``(P, HV, dk, dv)`` in ``spec.state_dtype``.
            slots: ``(N,)`` int32: sequence n's slot, or -1: skip sequence n (read and write
                nothing for it; its outputs are NaN). Non-negative slots are distinct and in
                ``[0, P)``; ``spec.sanitized_slots`` says the core made them so
                (:func:`gdn2core.plugin.sanitize_slots`), False for a direct call.
            spec: the resolved decode spec.
            config: the kernel config.
            extras: with ``spec.activations.any``: ``A_log`` ``(HV,)`` and ``dt_bias``
                ``(HV, dk)`` of a fused gate, in the state dtype (None when absent); the
                keyword is passed only then.

        Returns:
            ``(o, new_state, token_states)``: o ``(N, S, HV, dv)`` in v's dtype; the pool with the
            named slots replaced by the state after the last token, rounded once to the pool's
            dtype, and every other slot bit for bit as given; token_states
            ``(N, S, HV, dk, dv)`` in the pool's dtype when ``spec.token_states``, else None.
        """
        raise NotImplementedError(f"gdn2 backend {self.name!r} has no decode op")

    def supports_pooled(
        self, spec: OpSpec, config: KernelConfig, requests: PoolRequests, pool_dtype: str
    ) -> Verdict:
        """Refusals of a pooled forward beyond :meth:`supports` (only asked when
        ``capabilities.pooled`` is True); a refused call takes the ragged op's pieces path on
        the same backend.

        Args:
            spec: the packed requests' spec, as :meth:`forward` would see it (``cu_seqlens``).
            config: the call's kernel config.
            requests: their slots (:class:`~gdn2core.features.pooled.PoolRequests`).
            pool_dtype: the pool's dtype.

        Returns:
            :data:`YES`, or a :class:`Verdict` naming what is refused.
        """
        del spec, config, requests, pool_dtype
        return YES

    def forward_pooled(
        self, q, k, v, w, b, g, pool, *, spec: OpSpec, config: KernelConfig, extras: OpExtras,
        requests: PoolRequests,
    ) -> tuple[jax.Array, jax.Array]:  # fmt: skip
        """Packed requests that start from and write to the slots of a pool
        (:mod:`gdn2core.features.pooled`). Only called when ``capabilities.pooled`` is True and
        :meth:`supports_pooled` agreed.

        Args:
            q, k, v, w, b, g: one packed row ``(1, T, H, d)`` as for :meth:`forward` with
                ``cu_seqlens``, grouped value heads resolved: with ``G = HV / spec.heads``,
                the ``spec.dv`` value columns of head ``h`` are the pool's value heads
                ``h G ... h G + G - 1``, ``spec.dv / G`` columns each; with
                ``Capabilities.grouped_keys`` and ``spec.key_groups > 1``, q and k keep their
                ``spec.heads / spec.key_groups`` heads.
            pool: ``(P, HV, dk, dv)``, HV the call's value heads.
            spec, config: as for :meth:`forward`.
            extras: ``cu_seqlens`` (the requests' offsets) and the fused gates' parameters.
            requests: the slots each request reads and writes.

        Returns:
            ``(o, pool)``: o ``(1, T, H, dv)`` in v's dtype (zero on tokens of no request and
            of padded requests: ``writes`` -1 and ``starts`` ``FROM_ZEROS``); the
            pool with the written slots replaced (rounded once to its dtype) and every other
            slot bit for bit as given.
        """
        raise NotImplementedError(f"gdn2 backend {self.name!r} has no pooled forward")

    def __repr__(self) -> str:
        return f"<gdn2 backend {self.name!r} priority={self.priority}>"


def validate_backend(backend: object) -> Backend:
    """Check every field a backend declares; the error names the field and what it holds.

    Args:
        backend: what a plugin's hook (or ``register_backend``) handed over.

    Returns:
        ``backend``, now known to be a well-formed :class:`Backend`.

    Raises:
        TypeError: not a Backend, or a field of the wrong type.
        ValueError: a field of the right type with a bad value (e.g. a reserved name).
    """
    if not isinstance(backend, Backend):
        raise TypeError(
            f"expected a gdn2core.plugin.Backend instance, got {type(backend).__name__}"
        )
    name = getattr(backend, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {_show(name)}")
    if not NAME_PATTERN.fullmatch(name) or name in RESERVED_NAMES:
        raise ValueError(
            f"name: expected letters, digits, '_', '.', '-' (not starting with a digit) and not "
            f"{sorted(RESERVED_NAMES)}, got {name!r}"
        )
    priority = getattr(backend, "priority", None)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"priority: expected an int, got {_show(priority)}")
    caps = getattr(backend, "capabilities", None)
    if not isinstance(caps, Capabilities):
        raise TypeError(f"capabilities: expected a gdn2core.plugin.Capabilities, got {_show(caps)}")
    check_vma = getattr(backend, "shard_map_check_vma", False)
    if not isinstance(check_vma, bool):
        raise TypeError(f"shard_map_check_vma: expected a bool, got {_show(check_vma)}")
    return backend


def short_error(err: BaseException, limit: int = 200) -> str:
    """An exception in one line: ``Type: message`` (for pydantic errors, each field and what is
    wrong with it), cut to ``limit`` characters, never a traceback or a plugin registry dump.

    Args:
        err: the exception.
        limit: the longest message kept.

    Returns:
        The line.
    """
    errors = getattr(err, "errors", None)
    if callable(errors) and type(err).__name__ == "ValidationError":
        parts = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors()[:3]]
        text = "; ".join(parts)
    else:
        text = (str(err).strip().splitlines() or [""])[0]
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(err).__name__}: {text}"


def _show(value: object) -> str:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{type(value).__name__} {text}"
