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
from jax.sharding import Mesh

from gdn2core.api import gdn2_forward
from gdn2core.config import KernelConfig

#: One chip of each TPU generation the tools compile for.
TOPOLOGIES: Final = {"v5e": "v5e:1x1", "v6e": "v6e:1x1"}


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
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    return Mesh(np.array(list(topo.devices)), (axis,))


def compile_for_tpu(fn, *args: Any):
    """``jax.jit(fn)`` traced on ``args`` (``ShapeDtypeStruct`` on a TPU mesh), lowered for TPU,
    compiled.

    Args:
        fn: the function.
        *args: its abstract arguments.

    Returns:
        The compiled executable (``.as_text()``, ``.memory_analysis()``).
    """
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).compile()


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
):
    """Compile one backend's forward, or its train step, for a TPU topology.

    Args:
        backend: the backend name (called through the public ops).
        topology: e.g. ``"v5e:1x1"``.
        mode: ``"forward"`` (``gdn2_forward``) or ``"train"`` (value and gradients of
            ``sum(o * do) + sum(h_final * dh)`` in all seven arguments).
        B, T, H, dk, dv: the shape.
        dtype: the input dtype.
        config: the kernel config.

    Returns:
        The compiled executable.
    """
    from gdn2_tools.train_step import input_specs, train_step

    mesh = topology_mesh(topology)
    specs = input_specs(mesh, B, T, H, dk, dv, dtype=jnp.dtype(dtype))
    if mode == "forward":

        def fwd(q, k, v, w, b, g, h0):
            return gdn2_forward(q, k, v, w, b, g, h0=h0, config=config, backend=backend)

        return compile_for_tpu(fwd, *specs[:7])
    if mode != "train":
        raise ValueError(f"mode: expected 'forward' or 'train', got {mode!r}")
    return compile_for_tpu(train_step(backend=backend, config=config), *specs)
