"""Deviceless TPU compiles (libtpu's compiler; no TPU needed): topologies, meshes, and the compiled
forward or train step of any backend. Used by ``gdn2 memory --target``, ``gdn2 mesh-report``,
``gdn2 tpu-report`` and the tests."""

from __future__ import annotations

import functools
import os
from typing import Any, Final

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gdn2_tools.chips import CHIPS
from gdn2core.config import KernelConfig
from gdn2core.ops.forward.api import gdn2_forward

#: One chip of each TPU generation the tools compile for (chips.py).
TOPOLOGIES: Final = {name: chip.topology for name, chip in CHIPS.items()}


@functools.cache
def topology_mesh(topology: str, axis: str = "x") -> Mesh:
    """A 1-D mesh over the devices of a TPU topology, for deviceless compiles.

    Args:
        topology: e.g. ``"v5e:1x1"`` or ``"v5e:2x4"``.
        axis: the mesh axis name.

    Returns:
        The mesh (its devices are descriptions; nothing opens a TPU).
    """
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu must not try to open a TPU
    # A deviceless compile opens no TPU: do not let another process's libtpu lockfile stop it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # Off a TPU host libtpu logs its failed device probes to /tmp/tpu_logs, about 1 GB per
    # process; the compile needs none of it.
    os.environ.setdefault("TPU_LOG_DIR", "disabled")
    # Off a TPU VM there is no metadata server and no worker list: say so, instead of letting
    # libtpu print a multi-line INVALID_ARGUMENT error to stderr before every compile.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    return Mesh(np.array(list(topo.devices)), (axis,))


def compile_for_tpu(fn, *args: Any, donate_argnums: tuple[int, ...] = ()):
    """``jax.jit(fn)`` traced on ``args`` (``ShapeDtypeStruct`` on a TPU mesh), lowered for TPU,
    compiled.

    Args:
        fn: the function.
        *args: its abstract arguments.
        donate_argnums: arguments whose buffers the program may reuse for its outputs.

    Returns:
        The compiled executable (``.as_text()``, ``.memory_analysis()``).
    """
    jitted = jax.jit(fn, donate_argnums=donate_argnums)
    return jitted.trace(*args).lower(lowering_platforms=("tpu",)).compile()


#: The gates a family op passes as one value per head and token (``--gates``): KDA's beta as the
#: erase and write gates, GDN's beta and decay; ``"...-broadcast"``: the same inputs broadcast to
#: their channels in XLA before the op (what the op costs a backend that takes only full gates).
SCALAR_GATES: Final = {
    "": (),
    "kda": ("w", "b"),
    "gdn": ("w", "b", "g"),
    "kda-broadcast": ("w", "b"),
    "gdn-broadcast": ("w", "b", "g"),
}


def _broadcast_gates(w, b, g, dk: int, dv: int):
    """Scalar gates ``(B, T, H)`` broadcast to ``(B, T, H, d)`` (full gates pass as they are)."""
    wide = lambda x, d: x if x.ndim == 4 else jnp.broadcast_to(x[..., None], (*x.shape, d))  # noqa: E731
    return wide(w, dv), wide(b, dk), wide(g, dk)


def gate_keywords(gate: str, H: int, dk: int) -> dict:
    """The op's keywords of a fused gate on ``H`` heads: ``""`` none; ``"softplus"``
    (``use_gate_in_kernel`` with ``A_log``, ``dt_bias``); a number, the lower-bound gate with
    that ``lower_bound`` (its bounded fast path in pallas_tpu). ``A_log`` and ``dt_bias`` are
    zeros: values do not change the compiled program."""
    if not gate:
        return {}
    kw = {"use_gate_in_kernel": True, "A_log": jnp.zeros((H,)), "dt_bias": jnp.zeros((H, dk))}
    if gate != "softplus":
        kw["lower_bound"] = float(gate)
    return kw


def compile_op(
    backend: str,
    topology: str,
    mode: str,
    B: int,
    T: int,
    H: int,
    dk: int,
    dv: int,
    dtype: str,
    config: KernelConfig,
    *,
    segments: bool = False,
    value_heads: int = 0,
    value_gates: bool = False,
    gate: str = "",
    gates: str = "",
    decay_dtype: str = "",
):
    """Compile one backend's forward, or its train step, for a TPU topology.

    Args:
        backend: the backend name (called through the public ops).
        topology: e.g. ``"v5e:1x1"``.
        mode: ``"forward"`` (``gdn2_forward``), ``"chunk-states"`` (``gdn2_forward`` with
            ``return_chunk_states=True``) or ``"train"`` (value and gradients of
            ``sum(o * do) + sum(h_final * dh)`` in all seven arguments).
        B, T, H, dk, dv: the shape.
        dtype: the input dtype.
        config: the kernel config.
        segments: pass ``segment_ids`` (B, T) int32 as a further argument (packed sequences; the
            values are unknown at compile time, so a sequence may start at any token).
        value_heads: grouped value heads: v, w, h0 and the cotangents with this many heads
            (q, k, b, g keep ``H``); 0: ``H``.
        value_gates: with ``value_heads``, b and g on the value heads too (as Qwen3-Next's
            beta and decay), not on the key heads.
        gate: the gate fused in the op (:func:`gate_keywords`): ``""`` none, ``"softplus"``, or
            a lower bound such as ``"-5"`` (the lower-bound gate).
        gates: ``"kda"`` or ``"gdn"``: the gates :data:`SCALAR_GATES` names are ``(B, T, H)``
            scalar gates, as ``chunk_kda`` / ``chunk_gated_delta_rule`` pass them; with
            ``"-broadcast"`` the program broadcasts them in XLA before the op; ``""``: all per
            channel.
        decay_dtype: g's dtype, ``""`` for ``dtype`` (``"float32"`` beside bfloat16: fla's
            layers' float32 log decay).

    Returns:
        The compiled executable.
    """
    from gdn2_tools.train_step import input_specs, train_step

    mesh = topology_mesh(topology)
    scalar = SCALAR_GATES[gates]
    g_dtype = jnp.dtype(decay_dtype) if decay_dtype else None
    specs = input_specs(mesh, B, T, H, dk, dv, dtype=jnp.dtype(dtype), scalar_gates=scalar,
                        decay_dtype=g_dtype)  # fmt: skip
    if value_heads and value_heads != H:  # v, w, h0, do, dh on the value heads
        grouped = input_specs(mesh, B, T, value_heads, dk, dv, dtype=jnp.dtype(dtype),
                              scalar_gates=scalar, decay_dtype=g_dtype)  # fmt: skip
        on_values = (2, 3, 4, 5, 6, 7, 8) if value_gates else (2, 3, 6, 7, 8)
        specs = tuple(grouped[i] if i in on_values else x for i, x in enumerate(specs))
    elif value_gates:
        raise ValueError(f"value_gates: expected value_heads != H = {H}, got {value_heads}")
    replicated = NamedSharding(mesh, PartitionSpec())
    extra = (jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=replicated),) if segments else ()
    fused = gate_keywords(gate, value_heads if value_gates else H, dk)
    widen = gates.endswith("-broadcast")
    if mode in ("forward", "chunk-states"):
        more = {"return_chunk_states": True} if mode == "chunk-states" else {}
        more.update(fused)

        def fwd(q, k, v, w, b, g, h0, segment_ids=None):
            if widen:
                w, b, g = _broadcast_gates(w, b, g, dk, dv)
            return gdn2_forward(q, k, v, w, b, g, h0=h0, segment_ids=segment_ids, config=config,
                                backend=backend, **more)  # fmt: skip

        return compile_for_tpu(fwd, *specs[:7], *extra)
    if mode != "train":
        raise ValueError(f"mode: expected 'forward', 'chunk-states' or 'train', got {mode!r}")

    def step(*args):
        segment_ids = args[9] if segments else None
        # with widen, the gates' gradients flow back through their broadcast
        gates_in = functools.partial(_broadcast_gates, dk=dk, dv=dv) if widen else None
        run = train_step(gates=gates_in, backend=backend, config=config, segment_ids=segment_ids,
                         **fused)  # fmt: skip
        return run(*args[:9])

    return compile_for_tpu(step, *specs, *extra)


def compile_decode(
    backend: str,
    topology: str,
    N: int,
    S: int,
    H: int,
    HV: int,
    dk: int,
    dv: int,
    dtype: str,
    pool_dtype: str = "float32",
    *,
    pool_size: int | None = None,
    token_states: bool = False,
    config: KernelConfig | None = None,
    decay_dtype: str | None = None,
    gate: str = "",
    gate_heads: int | None = None,
):
    """Compile one decode step (``gdn2_decode`` with ``state_indices``, the pool donated, as a
    server runs it) for a TPU topology.

    Args:
        backend: the backend name.
        topology: e.g. ``"v5e:1x1"``.
        N, S, H, HV, dk, dv: sequences, tokens per sequence, key and value heads, head sizes.
        dtype: the token dtype.
        pool_dtype: the pool dtype (float32 or bfloat16).
        pool_size: P (None: N).
        token_states: also return the per-token states.
        config: the kernel config (None: the default).
        decay_dtype: g's dtype (None: ``dtype``; float32 beside bfloat16: a float32 log decay).
        gate: ``""``, or a fused gate as for :func:`gate_keywords` (on the heads of b and g)
            with the layers' other activations: the q/k L2 norm and the b/w sigmoids.
        gate_heads: the heads of b and g (None: H; HV: fla's and Qwen3-Next's layout).

    Returns:
        The compiled executable.
    """
    from gdn2core.ops.decode.api import gdn2_decode

    mesh = topology_mesh(topology)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    dt = jnp.dtype(dtype)
    key = jax.ShapeDtypeStruct((N, S, H, dk), dt, sharding=rep)
    val = jax.ShapeDtypeStruct((N, S, HV, dv), dt, sharding=rep)
    pool = jax.ShapeDtypeStruct((pool_size or N, HV, dk, dv), jnp.dtype(pool_dtype), sharding=rep)
    idx = jax.ShapeDtypeStruct((N,), jnp.int32, sharding=rep)
    gate_shape = (N, S, gate_heads or H, dk)
    beta = jax.ShapeDtypeStruct(gate_shape, dt, sharding=rep)
    decay = jax.ShapeDtypeStruct(gate_shape, jnp.dtype(decay_dtype or dtype), sharding=rep)

    fused = gate_keywords(gate, gate_heads or H, dk)
    if fused:
        fused.update(use_qk_l2norm_in_kernel=True, use_bw_sigmoid_in_kernel=True)

    def step(q, k, v, w, b, g, state, state_indices):
        return gdn2_decode(
            q, k, v, w, b, g, state, state_indices=state_indices,
            return_token_states=token_states, config=config, backend=backend, **fused,
        )  # fmt: skip

    return compile_for_tpu(step, key, key, val, val, beta, decay, pool, idx, donate_argnums=(6,))
