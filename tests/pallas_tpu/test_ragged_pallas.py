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

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn2_conformance import rel_err
from gdn2_pallas_tpu.config import PallasTpuConfig
from gdn2_tools.tpu import compile_for_tpu, topology_mesh
from gdn2core import KernelConfig, gdn2_ragged, gdn2_ragged_reference

from .helpers import decode_plans, ragged_tokens

H, HV, DK, DV, P = 1, 2, 64, 64, 12
TOL = 5e-5
INTERPRET = KernelConfig(bt=16, interpret=True)


def _tokens(t, seed):
    return ragged_tokens(t, seed, H, HV, DK, DV, P)


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


def _pooled_kernel_runs(fn, *args) -> bool:
    text = str(jax.make_jaxpr(fn)(*args))
    return "gdn2_fwd_pooled" in text


#: The pooled forward's edges (bt = 16, checkpoints every 16): a decode; a new prefill of 17
#: tokens (a checkpoint after token 15); a resumed request at context 30 (14 filler tokens before
#: it, a checkpoint after its token 1); one ending on a checkpoint (context 5, 27 tokens: the
#: state after its last token goes to its slot and to a checkpoint); an empty new request (its
#: slot becomes zeros); an empty resumed one (its slot stays); a padded one; padding.
POOLED = dict(
    cu_seqlens=[0, 1, 18, 23, 50, 50, 50, 52],
    state_indices=[2, 5, 9, 0, 7, 8, -1],
    has_initial_state=[True, False, True, True, False, True, True],
    checkpoint_every=16,
    context_lens=[15, 0, 30, 5, 0, 0, 0],
    checkpoint_slots=[[1, -1], [3, -1], [4, -1], [6, 10], [-1, -1], [-1, -1], [-1, -1]],
)
POOLED_WRITTEN = (0, 1, 2, 3, 4, 5, 6, 7, 9, 10)  # every slot but 8, 11


def test_pooled_forward_reads_and_writes_the_slots_in_the_kernel():
    x, pool = _tokens(56, seed=1)

    def step(pool, *x):
        return gdn2_ragged(
            *x, pool, num_decodes=1, backend="pallas_tpu", config=INTERPRET, **POOLED
        )

    assert _pooled_kernel_runs(step, pool, *x)  # not the pieces path
    o_ref, new_ref = gdn2_ragged_reference(*x, pool, **POOLED)
    o, new = step(pool, *x)
    assert rel_err(o, o_ref) < TOL
    assert rel_err(new, new_ref) < TOL
    np.testing.assert_array_equal(np.asarray(new[7]), 0.0)  # the empty new request
    untouched = [s for s in range(P) if s not in POOLED_WRITTEN]
    np.testing.assert_array_equal(np.asarray(new)[untouched], np.asarray(pool)[untouched])


def test_pooled_forward_with_fused_gates_repeated_keys_and_races_detected():
    """b, g with HV heads (q, k repeated per value head), the gate and L2 norm in the kernel,
    two simulated cores with race detection and a random order of the head groups."""
    x, pool = _tokens(56, seed=2)
    q, k, v, w, b, g = x
    ks = jax.random.split(jax.random.PRNGKey(5), 3)
    b = jax.random.normal(ks[0], (56, HV, DK))
    g = jax.random.normal(ks[1], (56, HV, DK))
    feats = dict(
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_bw_sigmoid_in_kernel=True,
        A_log=jnp.log(jnp.array([0.5, 2.0])), dt_bias=0.1 * jax.random.normal(ks[2], (HV, DK)),
    )  # fmt: skip
    config = PallasTpuConfig(
        bt=16, interpret=True, interpret_detect_races=True, interpret_cores=2, interpret_seed=3
    )
    args = (q, k, v, w, b, g, pool)
    o_ref, new_ref = gdn2_ragged_reference(*args, **POOLED, **feats)
    o, new = gdn2_ragged(
        *args, num_decodes=1, backend="pallas_tpu", config=config, **POOLED, **feats
    )
    assert rel_err(o, o_ref) < TOL
    assert rel_err(new, new_ref) < TOL


@pytest.mark.parametrize("gate", ["softplus", "lower-bound"])
def test_decodes_apply_the_fused_activations_in_the_decode_kernel(monkeypatch, gate):
    """Decodes of 1, 3 and 2 tokens in rows of ``decode_len = 3`` (fillers in two rows) with the
    layers' activations: the decode kernel gets the raw tokens and applies them (its plan carries
    them; a filler's raw ``g = -inf`` activates to a decay of 1), against the token-serial ragged
    reference; the prefill after them on the pooled forward."""
    plans = decode_plans(monkeypatch)
    x, pool = _tokens(24, seed=6)
    ks = jax.random.split(jax.random.PRNGKey(7), 2)
    feats = dict(use_qk_l2norm_in_kernel=True, use_bw_sigmoid_in_kernel=True,
                 use_gate_in_kernel=True, A_log=jnp.log(jnp.array([0.5])))  # fmt: skip
    if gate == "softplus":
        feats["dt_bias"] = 0.1 * jax.random.normal(ks[0], (H, DK))
    else:
        feats.update(lower_bound=-2.0, allow_neg_eigval=True)
    kw = dict(cu_seqlens=[0, 1, 4, 6, 20], state_indices=[2, 0, 7, 5],
              has_initial_state=[True, True, False, True])  # fmt: skip
    o_ref, new_ref = gdn2_ragged_reference(*x, pool, **kw, **feats)
    o, new = gdn2_ragged(
        *x, pool, num_decodes=3, decode_len=3, backend="pallas_tpu", config=INTERPRET, **kw,
        **feats,
    )  # fmt: skip
    assert [p.activations is not None and p.gate for p in plans] == [True]
    assert rel_err(o, o_ref) < TOL
    assert rel_err(new, new_ref) < TOL


def test_pooled_forward_under_jit_skips_a_request_with_a_repeated_slot():
    """Traced metadata: request 2 names slot 0 as request 3 does, so both are skipped (NaN
    outputs, nothing written), exactly as the pieces path (jax_ref) does."""
    x, pool = _tokens(56, seed=3)
    kw = dict(POOLED, state_indices=jnp.asarray([2, 5, 0, 0, 7, 8, -1], jnp.int32))
    meta = {k: jnp.asarray(v) if k != "checkpoint_every" else v for k, v in kw.items()}
    every = meta.pop("checkpoint_every")

    def run(pool, meta, backend, config):
        return gdn2_ragged(
            *x, pool, num_decodes=1, checkpoint_every=every, backend=backend, config=config,
            **meta,
        )  # fmt: skip

    o, new = jax.jit(run, static_argnums=(2, 3))(pool, meta, "pallas_tpu", INTERPRET)
    o_ref, new_ref = jax.jit(run, static_argnums=(2, 3))(pool, meta, "jax_ref", None)
    skipped = np.asarray(o[18:50])
    assert np.isnan(skipped).all()
    np.testing.assert_array_equal(np.asarray(new[0]), np.asarray(pool[0]))
    keep = np.r_[0:18, 50:56]
    assert rel_err(o[keep], o_ref[keep]) < TOL
    assert rel_err(new, new_ref) < TOL


def test_a_bfloat16_pool_on_the_pooled_forward():
    """A bfloat16 pool: its slots widened to float32 when read and each stored state rounded once
    to bfloat16 when written, in the kernel."""
    x, pool = _tokens(56, seed=4)
    pool = pool.astype(jnp.bfloat16)

    def step(pool, *x):
        return gdn2_ragged(
            *x, pool, num_decodes=1, backend="pallas_tpu", config=INTERPRET, **POOLED
        )

    assert _pooled_kernel_runs(step, pool, *x)
    o_ref, new_ref = gdn2_ragged_reference(*x, pool, **POOLED)
    o, new = step(pool, *x)
    assert new.dtype == jnp.bfloat16
    # 2e-2: the pool's bfloat16 rounding of every stored state (the op's documented tolerance).
    assert rel_err(o, o_ref) < 2e-2
    assert rel_err(new.astype(jnp.float32), new_ref.astype(jnp.float32)) < 2e-2
    untouched = [s for s in range(P) if s not in POOLED_WRITTEN]
    np.testing.assert_array_equal(
        np.asarray(new.astype(jnp.float32))[untouched],
        np.asarray(pool.astype(jnp.float32))[untouched],
    )


def test_a_supports_pooled_that_raises_refuses_the_pooled_forward(monkeypatch):
    """A backend's ``supports_pooled`` that raises refuses only that path (logged): the call
    takes the pieces path on the same backend and stays right."""
    from gdn2_pallas_tpu.backend import PallasTpuBackend

    def broken(self, *args):
        raise RuntimeError("broken")

    monkeypatch.setattr(PallasTpuBackend, "supports_pooled", broken)
    x, pool = _tokens(56, seed=6)

    def step(pool, *x):
        return gdn2_ragged(
            *x, pool, num_decodes=1, backend="pallas_tpu", config=INTERPRET, **POOLED
        )

    assert not _pooled_kernel_runs(step, pool, *x)
    o_ref, new_ref = gdn2_ragged_reference(*x, pool, **POOLED)
    o, new = step(pool, *x)
    assert rel_err(o, o_ref) < TOL and rel_err(new, new_ref) < TOL


@pytest.mark.parametrize(
    "pool_dtype, heads, value_heads, g_dtype",
    [
        (jnp.float32, H, HV, jnp.bfloat16),
        (jnp.bfloat16, H, HV, jnp.bfloat16),
        (jnp.float32, 16, 32, jnp.bfloat16),
        (jnp.float32, 16, 32, jnp.float32),
    ],
    ids=["float32", "bfloat16", "token-major", "token-major-float32-g"],
)
def test_ragged_call_compiles_to_mosaic_for_v5e_with_the_pool_in_place(
    pool_dtype, heads, value_heads, g_dtype
):
    """H = 1 (head-major: XLA moves the inputs into the padded row) and H = 16, HV = 32
    (token-major: the pooled kernel reads the flat tokens and writes o at them, flat_tokens.py:
    no token row is gathered, none relaid out). A float32 g beside the bfloat16 tokens: both
    kernels take it as float32 (the decode kernel on the decodes' rows, the pooled one on the
    flat tokens). Neither the pool nor o is copied: the kernels write both in place."""
    mesh = topology_mesh("v5e:1x1")
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    t, n = 64, 5
    key = jax.ShapeDtypeStruct((t, heads, 128), jnp.bfloat16, sharding=rep)
    val = jax.ShapeDtypeStruct((t, value_heads, 128), jnp.bfloat16, sharding=rep)
    pool = jax.ShapeDtypeStruct((P, value_heads, 128, 128), pool_dtype, sharding=rep)
    ints = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rep)
    cu = jax.ShapeDtypeStruct((n + 1,), jnp.int32, sharding=rep)
    ck = jax.ShapeDtypeStruct((n, 2), jnp.int32, sharding=rep)
    decay = jax.ShapeDtypeStruct((t, heads, 128), g_dtype, sharding=rep)

    def step(q, k, v, w, b, g, pool, cu, idx, ctx, ck):
        return gdn2_ragged(
            q, k, v, w, b, g, pool, cu_seqlens=cu, state_indices=idx, checkpoint_every=64,
            context_lens=ctx, checkpoint_slots=ck, num_decodes=3, backend="pallas_tpu",
        )  # fmt: skip

    compiled = compile_for_tpu(
        step, key, key, val, val, key, decay, pool, cu, ints, ints, ck, donate_argnums=(6,)
    )
    text = compiled.as_text()
    assert "tpu_custom_call" in text
    kernels = {name for name in ("gdn2_decode", "gdn2_fwd_pooled") if name in text}
    assert kernels == {"gdn2_decode", "gdn2_fwd_pooled"}, kernels
    if g_dtype == jnp.float32:  # g's operand: the decodes' rows [3, 1, H, d] (the decode kernel
        # reads the key heads' rows itself), the flat tokens
        for name, g_type in (("gdn2_decode", f"f32[3,1,{heads},128]"),
                             ("gdn2_fwd_pooled", f"f32[1,{t},{heads},128]")):  # fmt: skip
            kernels = [
                line for line in text.splitlines() if f"%{name}" in line and "custom-call(" in line
            ]
            assert kernels and all(
                g_type in line.split("operand_layout_constraints={")[1] for line in kernels
            ), (name, kernels)
    assert "input_output_alias={ {1}: (6," in text
    short = "f32" if pool_dtype == jnp.float32 else "bf16"
    pool_shape = f"{short}[{P},{value_heads},128,128]"  # no copy: the kernels write in place
    assert not re.search(re.escape(pool_shape) + r"\{[^}]*\} copy\(", text)
    # nor of o: the decodes' rows go into the pooled kernel's o in place (ragged/api.py)
    assert not re.search(rf"bf16\[{t},{value_heads},128\]\{{[^}}]*\}} copy\(", text)
    if heads % 8 == 0:  # the flat tokens, in and out: no gather of a token row, no relayout
        rows = re.findall(r"= bf16\[(\d+),\d+,\d+\]\{[^}]*\} gather\(", text)
        assert [int(r) for r in rows if int(r) >= t] == [], rows
        # o never in the kernel heads' layout (T, H, G dv), whose move to (T, HV, dv) is a copy
        grouped = rf"bf16\[(1,)?{t},{heads},{128 * value_heads // heads}\]"
        assert not re.search(grouped, text), "o in the (T, H, G dv) layout"


def test_gdn_ragged_call_compiles_with_scalar_gates_and_grouped_keys():
    """GDN at Qwen3-Next-like heads (H = 16, HV = 32, beta and the decay per value head, as
    ``(T, HV)`` scalar gates): the pooled kernel's operands are q and k on their own 16 heads
    (read grouped, not repeated to 32 in XLA), v, and the gates as float32 scalar blocks, none
    ``(.., 128)`` wide; the decode kernel gets its gates broadcast (the decode op's rule)."""
    mesh = topology_mesh("v5e:1x1")
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    t, n, heads, value_heads = 64, 5, 16, 32
    key = jax.ShapeDtypeStruct((t, heads, 128), jnp.bfloat16, sharding=rep)
    val = jax.ShapeDtypeStruct((t, value_heads, 128), jnp.bfloat16, sharding=rep)
    gate = jax.ShapeDtypeStruct((t, value_heads), jnp.bfloat16, sharding=rep)
    pool = jax.ShapeDtypeStruct((P, value_heads, 128, 128), jnp.bfloat16, sharding=rep)
    ints = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rep)
    cu = jax.ShapeDtypeStruct((n + 1,), jnp.int32, sharding=rep)

    def step(q, k, v, w, b, g, pool, cu, idx):
        return gdn2_ragged(q, k, v, w, b, g, pool, cu_seqlens=cu, state_indices=idx,
                           num_decodes=3, backend="pallas_tpu")  # fmt: skip

    text = compile_for_tpu(step, key, key, val, gate, gate, gate, pool, cu, ints,
                           donate_argnums=(6,)).as_text()  # fmt: skip
    calls = [
        line for line in text.splitlines() if "%gdn2_fwd_pooled" in line and "custom-call(" in line
    ]
    assert calls, "no pooled kernel"
    operands = calls[0].split("operand_layout_constraints={")[1].split("}}")[0]
    wide = re.findall(r"bf16\[1,\d+,(\d+),128\]", operands)  # the token arrays' heads
    assert sorted(wide) == ["16", "16", "32"], operands  # q, k on the key heads; v
    assert len(re.findall(r"f32\[1,\d+,\d+,8,\d+\]", operands)) == 3, operands  # w, b, g


def test_ragged_call_under_a_head_mesh_compiles_to_mosaic_for_v5e_2x2():
    """gdn2_ragged on pallas_tpu with H = 32, HV = 32 * 2 split over the 4 chips of a v5e 2x2
    slice (8 key heads per chip: the token-major pooled kernel on each), the pool's value heads
    split with them and donated: the kernels lower to Mosaic inside the shard_map and update
    the pool in place."""
    mesh = topology_mesh("v5e:2x2")
    heads, value_heads, t, n = 32, 64, 64, 5
    split = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))  # noqa: E731
    key = jax.ShapeDtypeStruct((t, heads, 128), jnp.bfloat16, sharding=split(None, "x", None))
    val = jax.ShapeDtypeStruct((t, value_heads, 128), jnp.bfloat16, sharding=split(None, "x"))
    pool = jax.ShapeDtypeStruct((P, value_heads, 128, 128), jnp.float32, sharding=split(None, "x"))
    ints = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=split())
    cu = jax.ShapeDtypeStruct((n + 1,), jnp.int32, sharding=split())

    def step(q, k, v, w, b, g, pool, cu, idx):
        return gdn2_ragged(
            q, k, v, w, b, g, pool, cu_seqlens=cu, state_indices=idx, num_decodes=2,
            backend="pallas_tpu", mesh=mesh, head_axes="x",
        )  # fmt: skip

    compiled = compile_for_tpu(step, key, key, val, val, key, key, pool, cu, ints,
                               donate_argnums=(6,))  # fmt: skip
    text = compiled.as_text()
    assert "tpu_custom_call" in text and "gdn2_fwd_pooled" in text and "gdn2_decode" in text
    assert "input_output_alias={ {1}: (6," in text
    per_chip = f"f32[{P},{value_heads // 4},128,128]"  # the pool's shard, never copied
    assert not re.search(re.escape(per_chip) + r"\{[^}]*\} copy\(", text)
