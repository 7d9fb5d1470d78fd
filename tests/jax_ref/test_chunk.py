"""Blocking of the time axis: padding, chunk layout, group plan."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_jax_ref import chunk
from gdn2_jax_ref.chunk import Blocking, from_chunks, load_group, pad_time, store_group, to_chunks


@pytest.mark.parametrize("T", [1, 7, 16, 17, 40])
def test_to_chunks_round_trip_and_zero_padding(T):
    x = jnp.asarray(np.random.default_rng(T).standard_normal((2, T, 3, 5)), jnp.float32)
    xc = to_chunks(x, 8, jnp.float32)  # [N, B, H, C, d]
    N = -(-T // 8)
    assert xc.shape == (N, 2, 3, 8, 5)
    # token t of chunk n is x[:, n * 8 + t]; the padded tail is exactly zero
    flat = np.asarray(jnp.transpose(xc, (1, 0, 3, 2, 4)).reshape(2, N * 8, 3, 5))
    np.testing.assert_array_equal(flat[:, :T], np.asarray(x))
    np.testing.assert_array_equal(flat[:, T:], 0.0)
    np.testing.assert_array_equal(np.asarray(from_chunks(xc, T, jnp.float32)), np.asarray(x))


@pytest.mark.parametrize(
    ("T", "row_bytes", "group_bytes"), [(1, 4, 1 << 20), (1000, 4096, 1 << 16), (33 * 64, 64, 4096)]
)
def test_group_plan(T, row_bytes, group_bytes):
    blk = Blocking.plan(T, 64, row_bytes, group_bytes)
    n_chunks = -(-T // 64)
    g_max = max(1, group_bytes // (row_bytes * 64))
    assert blk.group <= g_max
    assert blk.n_chunks >= n_chunks
    assert blk.n_chunks - n_chunks < blk.n_groups  # less than one padded chunk per group
    assert blk.padded_len == blk.n_chunks * 64


def test_group_load_store_round_trip():
    blk = Blocking(seq_len=37, bt=4, group=2, n_groups=5)  # 40 padded tokens
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 37, 3, 5)), jnp.float32)
    xp = pad_time(x, blk)
    assert xp.shape == (2, 40, 3, 5)
    buf = jnp.zeros_like(xp)
    for i in range(blk.n_groups):
        grp = load_group(xp, i, blk, jnp.float32)  # [G, B, H, C, d]
        assert grp.shape == (2, 2, 3, 4, 5)
        buf = store_group(buf, grp, i, blk)
    np.testing.assert_array_equal(np.asarray(buf), np.asarray(xp))


def test_group_bytes_is_read_at_call_time(monkeypatch):
    monkeypatch.setattr(chunk, "GROUP_BYTES", 1)
    assert Blocking.plan(640, 64, 16).group == 1
