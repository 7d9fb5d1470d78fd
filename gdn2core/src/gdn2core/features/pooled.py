"""Packed requests against a pool of states: what a backend with ``Capabilities.pooled`` receives.

The ragged op's requests after its decodes are a packed row (``extras.cu_seqlens``, ``N + 1``
offsets into the row's ``T`` tokens; tokens before ``cu_seqlens[0]`` or from ``cu_seqlens[N]`` on
belong to no request: they are not computed and their ``o`` is zero). A padded request (``writes``
``-1`` and ``starts`` :data:`FROM_ZEROS`) writes nothing and its ``o`` is zero too, so the core
needs no pass over ``o`` after the backend. Request ``n`` starts from
a slot of the pool, from zeros or from NaN (:attr:`PoolRequests.starts`), and its final state goes
to a slot (:attr:`PoolRequests.writes`). Stored states (prefix checkpoints) are taken after the
tokens :attr:`PoolRequests.stored_tokens` names, at absolute positions that are multiples of
:attr:`PoolRequests.stored_every`, so a backend whose chunk divides it can align every stored
state with the end of a chunk (``positions % C`` filler tokens before the request).

Every slot named (a start, a write, a stored state) is named once per call, and no request reads
a slot another writes: the core's rules for invalid values (``ragged_slots``) guarantee it, so a
backend may read and write the pool in place in any order of requests.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Final

import jax

#: :attr:`PoolRequests.starts` below 0: the request starts from zeros ...
FROM_ZEROS: Final = -1
#: ... or from NaN (a request skipped for an invalid slot: NaN outputs, nothing written).
FROM_NAN: Final = -2


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["starts", "writes", "positions", "stored_tokens", "stored_slots"],
    meta_fields=["stored_every"],
)
@dataclasses.dataclass(frozen=True)
class PoolRequests:
    """The slots of the packed requests of one call (``N`` requests).

    Attributes:
        starts: ``(N,)`` int32: the slot request ``n`` starts from, or :data:`FROM_ZEROS`,
            :data:`FROM_NAN`.
        writes: ``(N,)`` int32: the slot its final state goes to, ``-1``: none.
        positions: ``(N,)`` int32: the absolute position of its first token (tokens processed
            before this call), or None without stored states.
        stored_tokens: ``(N, M)`` int32: the local tokens after which a state is stored (the
            ``m``-th multiple of ``stored_every`` past ``positions[n]``), ``-1``: none; or None.
        stored_slots: ``(N, M)`` int32: the slot of each, ``-1``: not stored; or None.
        stored_every: the stored states' period (static), or None.
    """

    starts: jax.Array
    writes: jax.Array
    positions: Any = None
    stored_tokens: Any = None
    stored_slots: Any = None
    stored_every: int | None = None

    @property
    def stores(self) -> bool:
        """Whether the call stores states between its requests' tokens."""
        return self.stored_every is not None
