"""Deviceless TPU compilation of the pallas_tpu backend (libtpu's compiler, no TPU needed).

Used by the tests and by ``gdn2 tpu-report``."""

from __future__ import annotations

import functools
import os
from typing import Final

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gdn2_pallas_tpu.backend import PallasTpuBackend
from gdn2core import KernelConfig
from gdn2core.spec import OpSpec

TRAIN_SHAPE: Final = (8, 4096, 6)  # B, T, H
TEMP_LIMIT_BYTES: Final = 256 * 2**20


@functools.cache
def _sharding(topology: str) -> NamedSharding:
    # A deviceless compile opens no TPU: do not let another process's libtpu lockfile stop it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    return NamedSharding(Mesh(topo.devices, ("x",)), PartitionSpec())


def compile_for_tpu(topology, mode, B, T, H, dk, dv, dtype, config: KernelConfig):
    """Compile ``forward`` or the train step (``value_and_grad`` of sum(o*dO) + sum(h_final*dh)
    w.r.t. q, k, v, w, b, g, h0) of the pallas_tpu backend for ``topology`` (e.g. "v5e:1x1")."""
    sh = _sharding(topology)
    dt = jnp.dtype(dtype)

    def sds(shape, d=dt):
        return jax.ShapeDtypeStruct(shape, d, sharding=sh)

    key, val = sds((B, T, H, dk)), sds((B, T, H, dv))
    state = sds((B, H, dk, dv), jnp.float32)
    args = [key, key, val, val, key, key, state]
    spec = OpSpec(B, T, H, dk, dv, dt.name, dk**-0.5, True)
    backend = PallasTpuBackend()
    assert backend.supports(spec, config), backend.supports(spec, config).reason

    if mode == "forward":

        def f(q, k, v, w, b, g, h0):
            return backend.forward(q, k, v, w, b, g, h0, spec=spec, config=config)

    else:
        args += [val, state]

        def f(q, k, v, w, b, g, h0, do, dh):
            def loss(*a):
                o, h_final = backend.forward_trainable(*a, spec=spec, config=config)
                return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + jnp.sum(
                    h_final * dh
                )

            return jax.value_and_grad(loss, argnums=tuple(range(7)))(q, k, v, w, b, g, h0)

    return jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).compile()
