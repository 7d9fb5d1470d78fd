"""What the conformance suite runs on: the features it checks, the targets (a backend with its
config, head sizes and claimed features) and the cases of the per-case tests (chunked and
decode)."""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable

from gdn2_conformance.inputs import Case, Decay, DecodeCase
from gdn2core.config import DEFAULT_CONFIG, KernelConfig
from gdn2core.ops.forward.spec import OpSpec
from gdn2core.platform import default_platform

#: Small chunks: several chunks at tiny T, fast on a CPU. A core config: each backend derives its
#: own knobs from it (jax_ref: bc=8, wy_block=4).
SMALL_CONFIG = KernelConfig(bt=16)


class Feature(enum.StrEnum):
    """A capability the suite checks; a target claims the ones its backend has."""

    FORWARD = "forward"  # float32 o and h_final; the KDA and Gated DeltaNet reductions
    TRAINABLE = "trainable"  # float32 gradients of all seven arguments
    BFLOAT16 = "bfloat16"  # bfloat16 inputs against float32 arithmetic on the same values
    FLOAT64 = "float64"  # float64 outputs and central-difference gradients
    VMAP = "vmap"  # jit(vmap(...)) and grad of the call compose
    GVA = "gva"  # grouped value heads (the core resolves them for every backend)
    FUSED_ACTIVATIONS = "fused_activations"  # gates and L2 norm applied by the backend itself
    SEGMENTS = "segments"  # packed sequences by segment_ids (Capabilities.segments)
    VARLEN = "varlen"  # packed sequences by cu_seqlens (Capabilities.varlen)
    DECODE = "decode"  # gdn2_decode: outputs, pool, token states, untouched slots, skipped ones
    CHUNK_STATES = "chunk-states"  # gdn2_forward(..., return_chunk_states=True)
    POOLED = "pooled"  # gdn2_ragged's requests on the backend's forward_pooled
    FLOAT32_DECAY = "float32-decay"  # a float32 g beside bfloat16 inputs, kept in float32


#: Features a target can claim only when its backend declares the capability (the field of
#: :class:`~gdn2core.plugin.Capabilities`).
GATED_FEATURES: dict[Feature, str] = {
    Feature.SEGMENTS: "segments",
    Feature.VARLEN: "varlen",
    Feature.FUSED_ACTIVATIONS: "fused_activations",
    Feature.DECODE: "decode",
    Feature.CHUNK_STATES: "chunk_states",
    Feature.POOLED: "pooled",
    Feature.FLOAT32_DECAY: "float32_decay",
}


def capability(feature: Feature, *also: Feature) -> Callable:
    """Tag a suite test with the feature it checks (and any other features it needs).

    Args:
        feature: the feature (the summary counts the test under it).
        also: further features a target must claim for the test to run (e.g. TRAINABLE).

    Returns:
        A decorator that records ``feature`` and the features required on the test function.
    """

    def tag(fn):
        fn.gdn2_feature = feature
        fn.gdn2_requires = frozenset((feature, *also))
        return fn

    return tag


@dataclasses.dataclass(frozen=True)
class CaseSpec:
    """A case relative to a target: its length from the chunk length C, its head sizes by index
    into the target's ``head_sizes``. ``quick``: also in the subset of a quick target."""

    id: str
    T: Callable[[int], int]
    heads: int = 0
    B: int = 1
    H: int = 1
    h0: bool = True
    b_max: float = 1.0
    decay: Decay = Decay.MIXED
    seed: int = 0
    quick: bool = False

    def build(self, target: Target) -> Case:
        """The concrete :class:`Case` for ``target``."""
        sizes = target.head_sizes
        dk, dv = sizes[min(self.heads, len(sizes) - 1)]
        return Case(
            B=self.B, T=self.T(target.config.bt), H=self.H, dk=dk, dv=dv, h0=self.h0,
            b_max=self.b_max, decay=self.decay, seed=self.seed,
        )  # fmt: skip


#: T below one chunk, T = 1, T not a multiple of the chunk; dk != dv both ways; with and without
#: h0; b in (0, 1) and (0, 2) (negative eigenvalues); weak, mixed and strong (g = -30) decay.
CASES: tuple[CaseSpec, ...] = (
    CaseSpec("chunks", lambda C: 2 * C + 3, B=2, H=2, b_max=2.0, seed=1, quick=True),
    CaseSpec("strong", lambda C: 2 * C + 1, heads=1, decay=Decay.STRONG, seed=2, quick=True),
    CaseSpec("short", lambda C: max(1, C // 2 - 1), H=2, h0=False, decay=Decay.WEAK, seed=3),
    CaseSpec("one-token", lambda C: 1, heads=1, seed=4),
    CaseSpec(
        "tall", lambda C: C + 5, heads=2, H=2, h0=False, b_max=2.0, decay=Decay.STRONG, seed=5
    ),
)


@dataclasses.dataclass(frozen=True)
class DecodeCaseSpec:
    """A decode case relative to a target: ``S`` from the chunk length C, head sizes by index into
    the target's ``head_sizes`` (as :class:`CaseSpec`)."""

    id: str
    S: Callable[[int], int]
    N: int = 2
    H: int = 1
    HV: int = 1
    gate_heads: int = 0
    heads: int = 0
    P: int = 0
    b_max: float = 1.0
    decay: Decay = Decay.MIXED
    seed: int = 0
    quick: bool = False

    def build(self, target: Target) -> DecodeCase:
        """The concrete :class:`DecodeCase` for ``target``."""
        sizes = target.head_sizes
        dk, dv = sizes[min(self.heads, len(sizes) - 1)]
        return DecodeCase(
            N=self.N, S=self.S(target.config.bt), H=self.H, HV=self.HV,
            gate_heads=self.gate_heads, dk=dk, dv=dv, P=self.P, b_max=self.b_max,
            decay=self.decay, seed=self.seed,
        )  # fmt: skip


#: One token against a larger pool (slots in a random order); grouped value heads with b, g per
#: key head and strong decay, b up to 2, no indices; b, g per value head, dk != dv; a whole chunk of
#: tokens (speculative verification).
DECODE_CASES: tuple[DecodeCaseSpec, ...] = (
    DecodeCaseSpec("one-token", lambda C: 1, N=3, H=2, HV=2, P=5, seed=11, quick=True),
    DecodeCaseSpec(
        "gva", lambda C: 5, N=2, H=1, HV=2, heads=1, b_max=2.0, decay=Decay.STRONG, seed=12,
        quick=True,
    ),
    DecodeCaseSpec(
        "gva-value-gates", lambda C: 3, N=2, H=1, HV=2, gate_heads=2, heads=2, P=4, seed=13
    ),
    DecodeCaseSpec("chunk", lambda C: C, N=1, H=1, HV=1, P=3, seed=14),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Target:
    """A backend as the suite runs it: the config, head sizes and claimed features.

    Attributes:
        backend: the backend name.
        config: the kernel config of every call.
        head_sizes: ``(dk, dv)`` pairs; the first square, then dk < dv, then dk > dv.
        features: the features claimed (None: what the backend declares, see
            :func:`declared_features`). Either way a target never claims a feature its backend
            does not declare the capability of (:data:`GATED_FEATURES`): see :meth:`claimed`.
        quick: run only the cases marked quick (for expensive targets).
        name: the test-id prefix (default: the backend name).
    """

    backend: str
    config: KernelConfig = SMALL_CONFIG
    head_sizes: tuple[tuple[int, int], ...] = ((8, 8), (8, 12), (12, 6))
    features: frozenset[Feature] | None = None
    quick: bool = False
    name: str = ""

    @property
    def id(self) -> str:
        """The test-id prefix."""
        return self.name or self.backend

    def claimed(self) -> frozenset[Feature]:
        """The features this target's tests run for: :attr:`features` (or the declared ones),
        less the gated features whose capability the backend does not declare.

        Returns:
            The claimed features.

        Raises:
            BackendNotFoundError: the backend is not installed.
        """
        declared = declared_features(self.backend, interpret=self.config.interpret)
        features = declared if self.features is None else self.features
        return frozenset(f for f in features if f not in GATED_FEATURES or f in declared)

    def cases(self) -> list[Case]:
        """The concrete cases of this target."""
        return [spec.build(self) for spec in CASES if spec.quick or not self.quick]

    def decode_cases(self) -> list[DecodeCase]:
        """The concrete decode cases of this target."""
        return [spec.build(self) for spec in DECODE_CASES if spec.quick or not self.quick]

    @classmethod
    def for_backend(cls, name: str) -> Target:
        """The target of an installed backend, derived from its declared capabilities.

        Head sizes: the two smallest declared key and value sizes (8 and 12 when any size
        goes); config: the first of :data:`CONFIG_CANDIDATES` the backend accepts, in interpret
        mode when this host is not one of its platforms and it supports that; features:
        :func:`declared_features`.

        Args:
            name: the backend name.

        Returns:
            The target.

        Raises:
            BackendNotFoundError: the backend is not installed.
            ValueError: no candidate config is accepted here (the message says why).
        """
        from gdn2core.registry import get_backend
        from gdn2core.verdict import judge

        backend = get_backend(name)
        caps = backend.capabilities
        ks = sorted(caps.dk) if caps.dk else [8, 12]
        k0, k1 = ks[0], ks[min(1, len(ks) - 1)]
        if caps.dv:
            vs = sorted(caps.dv)
            v0, v1 = vs[0], vs[min(1, len(vs) - 1)]
            square = (k0, k0 if k0 in vs else v0)
        else:
            v0, v1 = max(1, k1 // 2), k0 + 4
            square = (k0, k0)
        heads = tuple(dict.fromkeys((square, (k0, v1), (k1, v0))))
        here = default_platform()
        interpret = here not in caps.platforms and caps.interpret
        dtype = "float32" if "float32" in caps.dtypes else caps.dtypes[0]
        spec = OpSpec(1, 16, 1, heads[0][0], heads[0][1], dtype, 1.0)
        reasons = []
        for candidate in CONFIG_CANDIDATES:
            config = candidate.model_copy(update={"interpret": interpret})
            answer = judge(backend, spec, config, trainable=False, auto=False, platform=here)
            if answer:
                break
            reasons.append(f"bt={config.bt}: {answer.reason}")
        else:
            raise ValueError(f"gdn2 backend {name!r} accepts no config here: {'; '.join(reasons)}")
        return cls(name, config, heads, declared_features(name, interpret=interpret))


#: Configs :meth:`Target.for_backend` tries, in order.
CONFIG_CANDIDATES: tuple[KernelConfig, ...] = (
    SMALL_CONFIG,
    DEFAULT_CONFIG,
)


@functools.cache
def declared_features(name: str, *, interpret: bool = False) -> frozenset[Feature]:
    """The features an installed backend's capabilities declare.

    FORWARD and GVA always (the core resolves grouped value heads for every backend); TRAINABLE,
    BFLOAT16, FLOAT64 from trainability and dtypes; the gated features (:data:`GATED_FEATURES`:
    SEGMENTS, VARLEN, FUSED_ACTIVATIONS, DECODE, CHUNK_STATES, POOLED, FLOAT32_DECAY) from their ``Capabilities`` fields
    (for a backend that does not fuse the activations the core applies them in XLA, tested once
    in gdn2's own tests, not per backend); VMAP unless run in interpret mode (JAX's TPU
    interpret mode does not batch a ``pallas_call``; a target that batches it anyway claims VMAP
    explicitly).

    Args:
        name: the backend name.
        interpret: whether the target runs in interpret mode.

    Returns:
        The features.

    Raises:
        BackendNotFoundError: the backend is not installed.
    """
    from gdn2core.registry import get_backend

    caps = get_backend(name).capabilities
    features = {Feature.FORWARD, Feature.GVA}
    features |= {Feature.TRAINABLE} if caps.trainable else set()
    features |= {Feature.BFLOAT16} if "bfloat16" in caps.dtypes else set()
    features |= {Feature.FLOAT64} if "float64" in caps.dtypes else set()
    features |= {f for f, flag in GATED_FEATURES.items() if getattr(caps, flag)}
    features |= set() if interpret else {Feature.VMAP}
    return frozenset(features)
