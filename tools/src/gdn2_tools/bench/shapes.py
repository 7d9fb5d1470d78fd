"""Benchmark shapes: the named shape lists and the ``--shape B,T,H,DK,DV`` parser."""

from __future__ import annotations

import dataclasses
from typing import Final


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class BenchShape:
    """One problem size: batch, sequence length, heads, key and value head sizes; optionally
    grouped value heads ``HV`` (b and g on the H key heads; 0: none) and ``seqs`` packed
    sequences per row (``segment_ids``; 1: none)."""

    B: int
    T: int
    H: int
    dk: int
    dv: int
    HV: int = 0
    seqs: int = 1

    def __post_init__(self) -> None:
        if min(self.B, self.T, self.H, self.dk, self.dv) < 1:
            raise ValueError(f"every dimension of a bench shape must be >= 1, got {self}")
        if self.HV and (self.HV < self.H or self.HV % self.H):
            raise ValueError(f"HV must be 0 or a multiple of H = {self.H}, got {self.HV}")
        if not 1 <= self.seqs <= self.T:
            raise ValueError(f"seqs must be in [1, T = {self.T}], got {self.seqs}")

    @property
    def value_heads(self) -> int:
        """HV: the heads of v, w, the state and o."""
        return self.HV or self.H

    @property
    def features(self) -> bool:
        """Whether the shape uses grouped value heads or packed sequences."""
        return bool(self.HV) or self.seqs > 1

    @property
    def label(self) -> str:
        text = f"B={self.B} T={self.T} H={self.H} dk={self.dk} dv={self.dv}"
        if self.HV:
            text += f" HV={self.HV}"
        if self.seqs > 1:
            text += f" seqs={self.seqs}"
        return text

    @property
    def token_heads(self) -> int:
        return self.B * self.T * self.H

    def as_dict(self) -> dict[str, int]:
        """The JSON form (``HV``, ``seqs`` only when set, so plain rows read as before)."""
        d = dataclasses.asdict(self)
        if not self.HV:
            del d["HV"]
        if self.seqs == 1:
            del d["seqs"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> BenchShape:
        return cls(
            int(d["B"]), int(d["T"]), int(d["H"]), int(d["dk"]), int(d["dv"]),
            int(d.get("HV", 0)), int(d.get("seqs", 1)),
        )  # fmt: skip

    def input_bytes(self, itemsize: int) -> int:
        """Bytes of q, k, b, g (dk, H heads) and v, w (dv, HV heads) at ``itemsize``, plus the
        float32 h0."""
        HV = self.value_heads
        per_tok = 4 * self.H * self.dk + 2 * HV * self.dv
        return self.B * self.T * per_tok * itemsize + 4 * self.B * HV * self.dk * self.dv


def parse_shape(text: str) -> BenchShape:
    """Parse ``"B,T,H,DK,DV"`` (``DV`` optional, defaulting to ``DK``), optionally followed by
    ``hv=N`` (grouped value heads) and ``seqs=N`` (packed sequences per row).

    Args:
        text: the shape as written on the command line.

    Returns:
        The :class:`BenchShape`.

    Raises:
        ValueError: not four or five positive integers, or an unknown or non-integer ``key=N``
            (the message shows the expected form).
    """
    parts = [p.strip() for p in text.split(",") if p.strip()]
    extra: dict[str, int] = {}
    for part in [p for p in parts if "=" in p]:
        key, _, value = part.partition("=")
        field = {"hv": "HV", "seqs": "seqs"}.get(key.strip().lower())
        if field is None or not value.strip().isdigit():
            raise ValueError(f"expected hv=N or seqs=N after B,T,H,DK[,DV], got {part!r}")
        extra[field] = int(value)
        parts.remove(part)
    if len(parts) not in (4, 5):
        raise ValueError(
            f"expected B,T,H,DK or B,T,H,DK,DV (4 or 5 integers), got {len(parts)} in {text!r}"
        )
    try:
        nums = [int(p) for p in parts]
    except ValueError as err:
        raise ValueError(f"expected integers B,T,H,DK[,DV], got {text!r}") from err
    if len(nums) == 4:
        nums.append(nums[3])
    return BenchShape(*nums, **extra)


#: The two shapes of the acceptance targets of the backend ``auto`` picks here (checks.py).
ACCEPT_REF: Final = BenchShape(2, 2048, 4, 128, 128)
"""fwd+bwd >= 4x faster than reference_grad; fwd no slower than the reference forward;
compiled fwd+bwd temp bytes below the inputs' bytes."""
ACCEPT_SCAN: Final = BenchShape(1, 1024, 2, 128, 128)
"""fwd+bwd >= 20x faster than each named-only baseline backend."""

#: ``--shapes cpu``: small enough that the whole default run takes a few minutes on 2 CPU cores,
#: and holding both acceptance shapes. The first has dk != dv and a short T for the plot.
CPU_SHAPES: Final[tuple[BenchShape, ...]] = (
    BenchShape(1, 256, 2, 64, 128),
    ACCEPT_SCAN,
    ACCEPT_REF,
)

#: ``--shapes seed``: the shapes of the seed implementation's benchmark (H=6, d=128).
SEED_SHAPES: Final[tuple[BenchShape, ...]] = (
    BenchShape(1, 1024, 6, 128, 128),
    BenchShape(4, 2048, 6, 128, 128),
    BenchShape(4, 4096, 6, 128, 128),
    BenchShape(8, 4096, 6, 128, 128),
)

#: ``--shapes packed``: the same B*T unpacked (one sequence per row) and packed (``seqs``
#: sequences per row by ``segment_ids``, starts anywhere); the report gives the packed/unpacked
#: time ratio (target <= 1.15x, :data:`PACKED_MAX_RATIO`).
PACKED_SHAPES: Final[tuple[BenchShape, ...]] = (
    BenchShape(4, 1024, 2, 64, 64),
    BenchShape(4, 1024, 2, 64, 64, seqs=8),
)
PACKED_MAX_RATIO: Final = 1.15

#: ``--shapes gva``: grouped value heads H=16, HV=32 (b, g on the key heads) next to the plain call
#: on repeated heads (H=32); a small T so that it runs on a CPU in a few minutes.
GVA_SHAPES: Final[tuple[BenchShape, ...]] = (
    BenchShape(1, 128, 16, 64, 64, HV=32),
    BenchShape(1, 128, 32, 64, 64),
)

SHAPE_LISTS: Final[dict[str, tuple[BenchShape, ...]]] = {
    "cpu": CPU_SHAPES,
    "seed": SEED_SHAPES,
    "packed": PACKED_SHAPES,
    "gva": GVA_SHAPES,
}
