"""One ordered table of a kernel's refs by name: the ``pallas_call`` arguments and the body's refs.

A kernel lists its refs once, in Pallas's order (scalar prefetch, inputs, outputs, scratch)::

    table = refs.Table(
        refs.Input("q", io.in_specs(K), q),  # a list of specs: one ref each, a tuple in the body
        refs.Input("starts", blocks.starts_spec(plan, step_of), starts),  # None: absent
        refs.Output("o", io.out_spec(V), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        refs.Scratch("S", pltpu.VMEM((hb, K, V), F32)),
        aliases={"state_in": "state_out"},  # input -> output (in place), by name
    )
    pl.pallas_call(table.kernel(body, BodyRefs), in_specs=table.in_specs, ...)(*table.operands)

An absent entry (a ``None`` array or shape) has no ref and no operand, and the body gets ``None``
for its name (as jax's ``pallas/ops/tpu/flash_attention.py`` passes absent refs). ``body``
receives ``BodyRefs(**refs by name)``: a dataclass whose fields are the table's names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

KINDS = ("prefetch", "input", "output", "scratch")  # Pallas's order of a kernel's refs


def _group(x) -> list:
    return list(x) if isinstance(x, list | tuple) else [x]


@dataclasses.dataclass(frozen=True)
class Ref:
    """One entry. ``spec``: a BlockSpec (input, output) or a scratch shape, or a list of them (one
    ref each; the body gets a tuple). ``value``: the operand (prefetch, input: the same array for
    every ref of a list), the ShapeDtypeStruct(s) (output), the shape(s) (scratch); None: absent."""

    kind: str
    name: str
    spec: Any
    value: Any

    @property
    def group(self) -> bool:
        return isinstance(self.spec, list | tuple)

    def pairs(self) -> list[tuple[Any, Any]]:
        """``(spec, value)`` of each ref; none when absent."""
        if self.value is None:
            return []
        specs = _group(self.spec)
        one = self.kind in ("prefetch", "input")  # one operand, for every ref of the entry
        return list(
            zip(specs, [self.value] * len(specs) if one else _group(self.value), strict=True)
        )


def Prefetch(name: str, array) -> Ref:  # a scalar-prefetch operand (SMEM, seen by index maps)
    return Ref("prefetch", name, None, array)


def Input(name: str, spec, array) -> Ref:
    return Ref("input", name, spec, array)


def Output(name: str, spec, shape) -> Ref:
    return Ref("output", name, spec, shape)


def Scratch(name: str, shape) -> Ref:
    return Ref("scratch", name, shape, shape)


class Table:
    """The entries of one kernel in order, and the ``pallas_call`` arguments built from them."""

    def __init__(self, *entries: Ref, aliases: Mapping[str, str] | None = None):
        names = [e.name for e in entries]
        assert len(set(names)) == len(names), f"duplicate ref names: {names}"
        kinds = [KINDS.index(e.kind) for e in entries]
        assert kinds == sorted(kinds), f"entries must come in the order {KINDS}"
        self.entries = entries
        pairs = lambda *kinds: [p for e in entries if e.kind in kinds for p in e.pairs()]  # noqa: E731
        self.num_scalar_prefetch = len(pairs("prefetch"))
        self.operands = [array for _, array in pairs("prefetch", "input")]
        self.in_specs = [spec for spec, _ in pairs("input")]
        self.out_specs = [spec for spec, _ in pairs("output")]
        self.out_shape = [shape for _, shape in pairs("output")]
        self.scratch_shapes = [shape for shape, _ in pairs("scratch")]
        self.input_output_aliases = {
            self._index(src, ("prefetch", "input")): self._index(dst, ("output",))
            for src, dst in (aliases or {}).items()
        }

    def _index(self, name: str, kinds: tuple[str, ...]) -> int:
        """The operand (or output) index of the present one-ref entry ``name``."""
        present = [e for e in self.entries if e.kind in kinds]
        i = [e.name for e in present].index(name)
        assert len(present[i].pairs()) == 1, f"{name!r} is absent or has several refs"
        return sum(len(e.pairs()) for e in present[:i])

    def bind(self, refs) -> dict[str, Any]:
        """The kernel's refs (in Pallas's order) by name: a ref, a tuple for a list, or None."""
        it = iter(refs)
        bound = {}
        for e in self.entries:
            got = tuple(next(it) for _ in e.pairs())
            bound[e.name] = (got if e.group else got[0]) if got else None
        assert next(it, None) is None, "the kernel got more refs than its table has"
        return bound

    def kernel(self, body: Callable, refs_type: type) -> Callable:
        """The Pallas kernel: ``body(refs_type(**refs by name))``."""

        def kernel(*refs):
            return body(refs_type(**self.bind(refs)))

        return kernel
