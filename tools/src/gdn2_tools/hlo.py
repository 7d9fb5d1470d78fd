"""Collectives and Mosaic kernels of a compiled program, read from its HLO text (for tests, reports
and benchmarks)."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "collective-broadcast",
)

_OP = re.compile(
    r"=\s*(?P<type>\(.*?\)|\S+)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\("
)
_MOSAIC = re.compile(r'%(\S+) = [^\n]*custom_call_target="tpu_custom_call"')
_SHAPE = re.compile(r"\b(?P<dtype>pred|[a-z]+\d+)\[(?P<dims>[\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str  # "all-gather", ...
    shapes: tuple[str, ...]  # result shapes as written in the HLO, e.g. "f32[4,1,2,8,8]"
    bytes: int  # size of the largest of them

    def __str__(self) -> str:
        return f"{self.op} {' '.join(self.shapes)} ({self.bytes} B)"


def _nbytes(dtype: str, dims: str) -> int:
    n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    size = 1 if dtype == "pred" else max(1, np.dtype(_NP.get(dtype, "float32")).itemsize)
    return n * size


_NP = {
    "f32": "float32",
    "f64": "float64",
    "f16": "float16",
    "bf16": "float16",  # same size
    "s32": "int32",
    "u32": "uint32",
    "s64": "int64",
    "u64": "uint64",
    "s8": "int8",
    "u8": "uint8",
    "s16": "int16",
    "u16": "uint16",
}


def collective_summary(hlo_text: str) -> list[Collective]:
    """Every collective (synchronous or ``-start`` of an async pair) in compiled HLO text."""
    found = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if m is None:
            continue
        shapes = tuple(s.group(0) for s in _SHAPE.finditer(m.group("type")))
        size = max((_nbytes(s.group("dtype"), s.group("dims"))
                    for s in _SHAPE.finditer(m.group("type"))), default=0)  # fmt: skip
        found.append(Collective(m.group("op"), shapes, size))
    return found


def mosaic_kernels(hlo_text: str) -> list[str]:
    """The names of the Mosaic kernels (``tpu_custom_call`` instructions) in a compiled program's
    HLO, in order; none for a program compiled off a TPU or run in interpret mode."""
    return _MOSAIC.findall(hlo_text)
