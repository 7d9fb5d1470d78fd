"""gdn2_ragged on pallas_tpu: interpret-mode runs against the token-serial ragged reference (its
decode kernel for the leading decodes, its packed forward for the rest, both passes of a call
that stores checkpoints and drafts), and a deviceless compile for v5e that lowers every kernel
to Mosaic and updates the donated pool in place.

Tolerance: 5e-5 relative in float32. The kernels' float32 matmuls round their operands as the
TPU's MXU does at HIGHEST precision; the documented error of the chunked forward against the
token-serial loop is 1.7e-5 (docs/results.md, precision table) and the composition adds the
product of the pieces' maps; a wrong slot, piece or state gives errors of order 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gdn2_conformance import rel_err
from gdn2_tools.tpu import compile_for_tpu, topology_mesh
from gdn2core import KernelConfig, gdn2_ragged, gdn2_ragged_reference

H, HV, DK, DV, P = 1, 2, 64, 64, 12
TOL = 5e-5
INTERPRET = KernelConfig(bt=16, interpret=True)


def _tokens(t, seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    q = jax.random.normal(ks[0], (t, H, DK))
    k = jax.random.normal(ks[1], (t, H, DK)) * DK**-0.5
    v = jax.random.normal(ks[2], (t, HV, DV))
    w = jax.nn.sigmoid(jax.random.normal(ks[3], (t, HV, DV)))
    b = jax.nn.sigmoid(jax.random.normal(ks[4], (t, H, DK)))
    g = -0.3 * jax.nn.softplus(jax.random.normal(ks[5], (t, H, DK)))
    pool = 0.3 * jax.random.normal(ks[6], (P, HV, DK, DV))
    return (q, k, v, w, b, g), pool


#: Two decodes (one of 2 tokens), a padded request, a new prefill and a resumed one, padding.
KW = dict(
    cu_seqlens=[0, 1, 3, 4, 21, 26],
    state_indices=[2, 0, -1, 5, 9],
    has_initial_state=[True, True, True, False, True],
    checkpoint_every=16,
    context_lens=[15, 3, 0, 0, 30],
    checkpoint_slots=[[1, -1], [-1, -1], [-1, -1], [3, -1], [4, -1]],
    draft_slots=[[-1, -1], [6, 7], [-1, -1], [-1, -1], [8, 10]],
)


def test_mixed_step_with_decodes_checkpoints_and_drafts_in_interpret_mode():
    x, pool = _tokens(28, seed=0)
    o_ref, new_ref = gdn2_ragged_reference(*x, pool, **KW)
    o, new = gdn2_ragged(
        *x, pool, num_decodes=2, decode_len=2, backend="pallas_tpu", config=INTERPRET, **KW
    )
    assert rel_err(o, o_ref) < TOL
    assert rel_err(new, new_ref) < TOL
    untouched = [s for s in range(P) if s not in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)]
    np.testing.assert_array_equal(np.asarray(new)[untouched], np.asarray(pool)[untouched])


def test_ragged_call_compiles_to_mosaic_for_v5e_with_the_pool_in_place():
    mesh = topology_mesh("v5e:1x1")
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    t, n = 64, 5
    key = jax.ShapeDtypeStruct((t, H, 128), jnp.bfloat16, sharding=rep)
    val = jax.ShapeDtypeStruct((t, HV, 128), jnp.bfloat16, sharding=rep)
    pool = jax.ShapeDtypeStruct((P, HV, 128, 128), jnp.float32, sharding=rep)
    ints = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rep)
    cu = jax.ShapeDtypeStruct((n + 1,), jnp.int32, sharding=rep)
    ck = jax.ShapeDtypeStruct((n, 2), jnp.int32, sharding=rep)

    def step(q, k, v, w, b, g, pool, cu, idx, ctx, ck):
        return gdn2_ragged(
            q, k, v, w, b, g, pool, cu_seqlens=cu, state_indices=idx, checkpoint_every=64,
            context_lens=ctx, checkpoint_slots=ck, num_decodes=3, backend="pallas_tpu",
        )  # fmt: skip

    compiled = compile_for_tpu(
        step, key, key, val, val, key, key, pool, cu, ints, ints, ck, donate_argnums=(6,)
    )
    text = compiled.as_text()
    assert "tpu_custom_call" in text
    kernels = {name for name in ("gdn2_decode", "gdn2_fwd") if name in text}
    assert kernels == {"gdn2_decode", "gdn2_fwd"}, kernels
    assert "input_output_alias={ {1}: (6," in text
