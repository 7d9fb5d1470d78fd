"""One training step of ``gdn2core.layers.GDN2Layer`` with Flax NNX and Optax AdamW.

    python examples/train_gdn2_layer.py [--backend auto] [--steps 1]

Needs the ``flax`` extra (``pip install 'gdn2core[flax]'``). The task is a toy regression (predict
the next token's features) just to have a loss; see ``train_mqar.py`` for a real one.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import gdn2core
from gdn2core.layers import GDN2Layer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--T", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)

    layer = GDN2Layer(
        args.d_model,
        args.heads,
        args.head_dim,
        expand_v=2,
        lift_b=True,
        backend=args.backend,
        rngs=nnx.Rngs(0),
    )
    optimizer = nnx.Optimizer(layer, optax.adamw(args.lr, weight_decay=0.01), wrt=nnx.Param)

    x = jax.random.normal(jax.random.key(1), (args.B, args.T + 1, args.d_model))
    inputs, targets = x[:, :-1], x[:, 1:]

    # Which backend the layer's operator call resolves to (shapes as the layer will pass them).
    B, T, H, dk, dv = args.B, args.T, args.heads, args.head_dim, 2 * args.head_dim
    kq = jnp.zeros((B, T, H, dk))
    kv = jnp.zeros((B, T, H, dv))
    name = gdn2core.which_backend(kq, kq, kv, kv, kq, kq, backend=args.backend)
    n_params = sum(p.size for p in jax.tree.leaves(nnx.state(layer, nnx.Param)))
    print(
        f"backend: {name}; GDN2Layer d_model={args.d_model} H={H} dk={dk} dv={dv}, "
        f"{n_params} parameters; batch {B}x{T}"
    )

    def loss_fn(model):
        return jnp.mean((model(inputs) - targets) ** 2)

    @nnx.jit
    def train_step(model, opt):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    before = float(loss_fn(layer))
    start = time.perf_counter()
    for step in range(args.steps):
        loss = float(train_step(layer, optimizer))
        print(f"step {step}: loss {loss:.5f}")
    after = float(loss_fn(layer))
    print(
        f"loss before {before:.5f}, after {after:.5f} "
        f"({time.perf_counter() - start:.2f} s incl. compile)"
    )
    return 0 if jnp.isfinite(after) else 1


if __name__ == "__main__":
    raise SystemExit(main())
