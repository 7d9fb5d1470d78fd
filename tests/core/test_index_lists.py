"""Index arguments given as Python lists or tuples (segment_ids, cu_seqlens, state_indices) are
taken as ``jnp.asarray`` of them: the call equals the one with arrays, bit for bit (the same
arrays reach the backend); a list that is no integer array is refused naming the argument.

The backend is the token-serial reference registered in-process (quick to trace): the lists are
converted in the core, before any backend sees them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn2core
from gdn2_conformance import DecodeCase, ReferenceBackend, make_decode_inputs
from gdn2core import OpSpec, gdn2_decode, gdn2_forward, gdn2_forward_trainable

B, T, H, K = 1, 8, 2, 4
IDS = [[0, 0, 0, 1, 1, 2, 2, 2]]
CU = (0, 3, 5, 8)
REF = "index_lists_reference"


@pytest.fixture(autouse=True, scope="module")
def _reference():
    gdn2core.register_backend(ReferenceBackend(REF), replace=True)
    yield
    gdn2core.unregister_backend(REF)


@pytest.fixture(scope="module")
def xs():
    keys = jax.random.split(jax.random.key(0), 6)
    q, k, v, w, b, g = (jax.random.normal(key, (B, T, H, K)) for key in keys)
    return q, k, v, w, jax.nn.sigmoid(b), -jax.nn.softplus(g)


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_segment_ids_and_cu_seqlens_as_lists(xs):
    as_array = gdn2_forward(*xs, backend=REF, segment_ids=jnp.asarray(IDS))
    _same(gdn2_forward(*xs, backend=REF, segment_ids=IDS), as_array)
    _same(gdn2_forward(*xs, backend=REF, segment_ids=tuple(map(tuple, IDS))), as_array)
    _same(gdn2_forward_trainable(*xs, backend=REF, segment_ids=IDS)[0], as_array[0])
    h0 = jnp.zeros((3, H, K, K))
    varlen = gdn2_forward(*xs, None, h0, backend=REF, cu_seqlens=jnp.asarray(CU))
    _same(gdn2_forward(*xs, None, h0, backend=REF, cu_seqlens=CU), varlen)
    _same(gdn2_forward(*xs, None, h0, backend=REF, cu_seqlens=list(CU)), varlen)
    # the values of a list are still checked
    with pytest.raises(ValueError, match=r"cu_seqlens: expected cu_seqlens\[-1\] = T = 8, got 9"):
        gdn2_forward(*xs, None, h0, backend=REF, cu_seqlens=[0, 3, 5, 9])
    spec = OpSpec.from_inputs(*xs, None, None, segment_ids=IDS)  # the spec alone, too
    assert spec.segments == "segment_ids"


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("segment_ids", [[0, 0], [1]], "segment_ids: expected an integer array or a .*list of "
         "integers, got a list that is not one"),
        ("cu_seqlens", ["a", "b"], "cu_seqlens: expected an integer array or a .*list of integers"),
        ("segment_ids", [[0.0] * T], "segment_ids: expected an integer dtype, got float32"),
        ("segment_ids", {"ids": 1}, "segment_ids: expected an integer array or a list of "
         "integers, got dict"),
    ],
)  # fmt: skip
def test_a_list_that_is_no_integer_array_is_named(xs, name, value, message):
    with pytest.raises(TypeError, match=message):
        gdn2_forward(*xs, backend=REF, **{name: value})


def test_state_indices_as_a_list():
    x = make_decode_inputs(DecodeCase(N=3, S=1, H=2, HV=2, dk=8, dv=8, P=5, seed=1))
    indices = [int(i) for i in np.asarray(x.state_indices)]
    as_array = gdn2_decode(*x.args, x.state, state_indices=jnp.asarray(indices), backend=REF)
    _same(gdn2_decode(*x.args, x.state, state_indices=indices, backend=REF), as_array)
    _same(gdn2_decode(*x.args, x.state, state_indices=tuple(indices), backend=REF), as_array)
    with pytest.raises(ValueError, match=r"state_indices: expected each slot named at most once"):
        gdn2_decode(*x.args, x.state, state_indices=[0, 0, 1], backend=REF)
    with pytest.raises(TypeError, match="state_indices: expected an integer array or a .*list"):
        gdn2_decode(*x.args, x.state, state_indices=[0, [1], 2], backend=REF)
