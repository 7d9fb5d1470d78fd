"""Multi-device checks of gdn2_ragged (heads split over a mesh), run in the 8-device child process
of ``test_multidevice.py`` (skipped when fewer devices exist).

Every check compares the sharded call with the single-device token-serial ragged reference
(``gdn2_ragged_reference``) in float32, at 1e-5 relative (the chunked backends' float32 error
against the token-serial loop is ~1e-6 at these sizes), and the slots the step does not name bit
for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from gdn2_conformance import rel_err
from gdn2core import gdn2_ragged, gdn2_ragged_reference
from gdn2core.ops.ragged.mesh import head_plan
from gdn2core.ops.ragged.spec import RaggedSpec

if jax.device_count() < 8:
    pytest.skip("needs 8 devices (run through test_multidevice.py)", allow_module_level=True)

H, HV, DK, DV, P = 4, 8, 8, 6, 24
TOL = 1e-5
#: Two decodes (one of 2 tokens), a prefill, a new request, a resumed prompt, 3 padding tokens.
LENS = [1, 2, 11, 5, 7]
KW = dict(
    cu_seqlens=np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32),
    state_indices=np.array([3, 5, 7, 0, 11], np.int32),
    has_initial_state=np.array([True, True, True, False, True]),
    checkpoint_every=4,
    context_lens=np.array([3, 6, 0, 0, 2], np.int32),
    checkpoint_slots=np.array([[12, -1], [13, -1], [14, 15], [16, -1], [17, 18]], np.int32),
    draft_slots=np.array([[19, -1], [20, 21], [-1, -1], [-1, -1], [-1, -1]], np.int32),
)
NAMED = {3, 5, 7, 0, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21}
FEATURES = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)


def mesh_of(shape, names, kind=AxisType.Auto):
    devs = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devs, names, axis_types=(kind,) * len(names))


def inputs(seed=0, gate_heads=HV):
    ks = jax.random.split(jax.random.PRNGKey(seed), 9)
    t = sum(LENS) + 3
    q = jax.random.normal(ks[0], (t, H, DK))
    k = jax.random.normal(ks[1], (t, H, DK))
    v = jax.random.normal(ks[2], (t, HV, DV))
    w = jax.nn.sigmoid(jax.random.normal(ks[3], (t, HV, DV)))
    b = jax.nn.sigmoid(jax.random.normal(ks[4], (t, gate_heads, DK)))
    g = jax.random.normal(ks[5], (t, gate_heads, DK))  # raw: the fused gate
    pool = 0.3 * jax.random.normal(ks[6], (P, HV, DK, DV))
    extras = dict(
        A_log=jax.random.uniform(ks[7], (gate_heads,), minval=-1.0, maxval=0.5),
        dt_bias=0.1 * jax.random.normal(ks[8], (gate_heads, DK)),
    )
    return (q, k, v, w, b, g), pool, extras


def check(x, pool, extras, heads, **sharding):
    """The sharded step (jitted, the pool donated) against the reference; o and the pool come out
    split over ``heads`` (the PartitionSpec entry), so the sharded path ran."""
    plain = [jnp.asarray(np.asarray(a)) for a in (*x, pool)]  # one device
    o_ref, new_ref = gdn2_ragged_reference(*plain, **KW, **FEATURES, **extras)

    def step(x, pool, extras):
        return gdn2_ragged(
            *x, pool, num_decodes=2, decode_len=2, backend="jax_ref", **KW, **FEATURES,
            **extras, **sharding,
        )  # fmt: skip

    o, new = jax.jit(step, donate_argnums=(1,))(x, jnp.array(pool, copy=True), extras)
    assert rel_err(o, o_ref) < TOL
    assert rel_err(new, new_ref) < TOL
    keep = [i for i in range(P) if i not in NAMED]
    np.testing.assert_array_equal(np.asarray(new)[keep], np.asarray(pool)[keep])
    assert tuple(o.sharding.spec)[:2] == (None, heads), o.sharding
    assert tuple(new.sharding.spec)[:2] == (None, heads), new.sharding


def test_heads_over_four_devices_with_grouped_heads_decodes_and_checkpoints():
    """H = 4 key heads, HV = 8 value heads (and gates) over 4 devices: 1 key head, 2 value heads
    and the pool's 2 value heads per device; decodes, a prefill, a new and a resumed request,
    checkpoints and drafts, the fused gate (A_log and dt_bias split by heads)."""
    x, pool, extras = inputs()
    check(x, pool, extras, "heads", mesh=mesh_of((4,), ("heads",)), head_axes="heads")


def test_key_head_gates_over_two_axes_of_a_2x2_mesh():
    """b, g on the key heads (Hg = H), heads over both axes of a 2x2 mesh."""
    x, pool, extras = inputs(seed=1, gate_heads=H)
    check(x, pool, extras, ("a", "b"), mesh=mesh_of((2, 2), ("a", "b")), head_axes=("a", "b"))


def test_scalar_gates_over_four_devices():
    """GDN's scalar gates, w ``(T, HV)``, b and g ``(T, HV)``, split by heads as ``(T, heads)``
    arrays (and broadcast on each device only for its decodes)."""
    x, pool, extras = inputs(seed=3)
    x = (*x[:3], *(a[..., 0] for a in x[3:]))  # [T, HV]
    check(x, pool, extras, "heads", mesh=mesh_of((4,), ("heads",)), head_axes="heads")


def test_the_plan_follows_sharded_inputs_without_keywords():
    """Inputs on an Explicit mesh, heads sharded: the call finds the mesh and the head axes."""
    mesh = mesh_of((4,), ("y",), AxisType.Explicit)
    x, pool, extras = inputs(seed=2)
    tok, slots = (
        NamedSharding(mesh, PartitionSpec(None, "y", None)),
        NamedSharding(mesh, PartitionSpec(None, "y", None, None)),
    )
    xs = tuple(jax.device_put(a, tok) for a in x)
    spec = RaggedSpec.from_inputs(*xs, pool, **KW)
    plan = head_plan(spec, xs[0], mesh=None, head_axes=None)
    assert plan is not None and plan.head_axes == ("y",) and plan.shards == 4
    check(xs, jax.device_put(pool, slots), extras, "y")


def test_refusals_name_the_problem():
    x, pool, _ = inputs()
    spec = RaggedSpec.from_inputs(*x, pool, **KW)
    with pytest.raises(ValueError, match=r"head_axes: H=4 is not divisible by its 8 shards"):
        head_plan(spec, x[0], mesh=mesh_of((8,), ("h",)), head_axes="h")
    mesh = mesh_of((2,), ("t",), AxisType.Explicit)
    q = jax.device_put(x[0][:28], NamedSharding(mesh, PartitionSpec("t", None, None)))
    with pytest.raises(ValueError, match=r"q: its token \(first\) dimension is sharded"):
        head_plan(spec, q, mesh=None, head_axes=None)
    with pytest.raises(ValueError, match=r"head_axes: 'z' is not an axis of the mesh"):
        head_plan(spec, x[0], mesh=mesh_of((2,), ("h",)), head_axes="z")
    with pytest.raises(ValueError, match=r"head_axes: given but no mesh"):
        head_plan(spec, x[0], mesh=None, head_axes="h")
    assert head_plan(spec, x[0], mesh=None, head_axes=None) is None  # no mesh: one device


def test_pallas_tpu_pooled_forward_on_two_devices_in_interpret_mode():
    """pallas_tpu (interpret mode) under the mesh: H = 16, HV = 32 over 2 devices, 8 key heads
    per device (token-major: the pooled kernel reads the flat tokens), the engine's padding NaN;
    against the single-device reference at 5e-5 (the kernels' float32 tolerance,
    tests/pallas_tpu/test_ragged_pallas.py), the slots the step does not name bit for bit."""
    from gdn2core import KernelConfig
    from tests.pallas_tpu.helpers import ragged_tokens
    from tests.pallas_tpu.test_pooled_flat_tokens import FLAT, FLAT_PADDING, FLAT_T, FLAT_WRITTEN

    slots = 12
    x, pool = ragged_tokens(FLAT_T, 7, 16, 32, 64, 64, slots, padding_from=FLAT_PADDING)
    o_ref, new_ref = gdn2_ragged_reference(*x, pool, **FLAT)
    mesh = mesh_of((2,), ("heads",))

    def step(x, pool):
        return gdn2_ragged(
            *x, pool, num_decodes=1, backend="pallas_tpu", mesh=mesh, head_axes="heads",
            config=KernelConfig(bt=16, interpret=True), **FLAT,
        )  # fmt: skip

    assert "gdn2_fwd_pooled" in str(jax.make_jaxpr(step)(x, pool))
    o, new = jax.jit(step, donate_argnums=(1,))(x, jnp.array(pool, copy=True))
    assert rel_err(o[:FLAT_PADDING], o_ref[:FLAT_PADDING]) < 5e-5
    np.testing.assert_array_equal(np.asarray(o[FLAT_PADDING:]), 0.0)
    assert rel_err(new, new_ref) < 5e-5
    keep = [i for i in range(slots) if i not in FLAT_WRITTEN]
    np.testing.assert_array_equal(np.asarray(new)[keep], np.asarray(pool)[keep])
    assert tuple(new.sharding.spec)[:2] == (None, "heads"), new.sharding
