"""Benchmark shapes: the named shape lists and the ``--shape B,T,H,DK,DV`` parser."""

from __future__ import annotations

import dataclasses
from typing import Final


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class BenchShape:
    """One problem size: batch, sequence length, heads, key and value head sizes."""

    B: int
    T: int
    H: int
    dk: int
    dv: int

    def __post_init__(self) -> None:
        if min(self.B, self.T, self.H, self.dk, self.dv) < 1:
            raise ValueError(f"every dimension of a bench shape must be >= 1, got {self}")

    @property
    def label(self) -> str:
        return f"B={self.B} T={self.T} H={self.H} dk={self.dk} dv={self.dv}"

    @property
    def token_heads(self) -> int:
        return self.B * self.T * self.H

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> BenchShape:
        return cls(int(d["B"]), int(d["T"]), int(d["H"]), int(d["dk"]), int(d["dv"]))

    def input_bytes(self, itemsize: int) -> int:
        """Bytes of q, k, b, g (dk) and v, w (dv) at ``itemsize``, plus the float32 h0."""
        per_tok = 4 * self.dk + 2 * self.dv
        return self.token_heads * per_tok * itemsize + 4 * self.B * self.H * self.dk * self.dv


def parse_shape(text: str) -> BenchShape:
    """Parse ``"B,T,H,DK,DV"`` (``DV`` optional, defaulting to ``DK``).

    Args:
        text: the shape as written on the command line.

    Returns:
        The :class:`BenchShape`.

    Raises:
        ValueError: not four or five positive integers (the message shows the expected form).
    """
    parts = [p.strip() for p in text.split(",") if p.strip()]
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
    return BenchShape(*nums)


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

SHAPE_LISTS: Final[dict[str, tuple[BenchShape, ...]]] = {"cpu": CPU_SHAPES, "seed": SEED_SHAPES}
