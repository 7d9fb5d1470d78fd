"""Slot indices for the tests of the decode op's slot rule (``sanitize_slots``) and of the decode
kernel's step sources: random indices with repeats, negatives and values past the pool."""

from __future__ import annotations

import numpy as np


def random_slot_indices(n: int) -> tuple[np.ndarray, int]:
    """``(indices (n,), pool_size)``, seeded by ``n``: ``pool_size = max(2, n // 2)``, entries
    in ``[-3, P + 3)``, the first out of range and, when some slot is free of the others, the
    last one such slot (so a case has both a skipped and a valid sequence)."""
    rng = np.random.default_rng(n)
    pool_size = max(2, n // 2)
    idx = rng.integers(-3, pool_size + 3, size=n)
    idx[0] = pool_size  # out of range
    free = sorted(set(range(pool_size)) - set(idx[2:].tolist()))
    idx[-1] = free[0] if free else idx[-1]  # a slot no other sequence names, when there is one
    return idx, pool_size
