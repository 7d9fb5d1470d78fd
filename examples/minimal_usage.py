"""Minimal gdn2 usage: one forward and one backward through the GDN-2 operator.

    python examples/minimal_usage.py [--backend auto] [--B 2 --T 256 --H 4 --dk 64 --dv 128]

Prints the backend that ran, the output shapes and the gradient norms.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import gdn2core


def make_inputs(key, B, T, H, dk, dv, dtype=jnp.float32):
    kq, kk, kv, kw, kb, kg = jax.random.split(key, 6)

    def l2(x):
        return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

    q = l2(jax.random.normal(kq, (B, T, H, dk)))
    k = l2(jax.random.normal(kk, (B, T, H, dk)))
    v = jax.random.normal(kv, (B, T, H, dv))
    w = jax.nn.sigmoid(jax.random.normal(kw, (B, T, H, dv)))  # write gate, (0, 1)
    b = jax.nn.sigmoid(jax.random.normal(kb, (B, T, H, dk)))  # erase gate, (0, 1)
    g = -jax.nn.softplus(jax.random.normal(kg, (B, T, H, dk)) - 3.0)  # log decay, <= 0
    return tuple(x.astype(dtype) for x in (q, k, v, w, b, g))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto")
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--T", type=int, default=256)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--dk", type=int, default=64)
    p.add_argument("--dv", type=int, default=128)
    args = p.parse_args(argv)

    q, k, v, w, b, g = make_inputs(jax.random.key(0), args.B, args.T, args.H, args.dk, args.dv)
    name = gdn2core.which_backend(q, k, v, w, b, g, backend=args.backend)
    print(
        f"backend: {name} (requested {args.backend!r}; installed: "
        f"{', '.join(i.name for i in gdn2core.list_backends() if i.available)})"
    )

    # Forward (inference).
    start = time.perf_counter()
    o, h_final = gdn2core.gdn2_forward(q, k, v, w, b, g, backend=args.backend)
    jax.block_until_ready(o)
    print(
        f"forward: o {o.shape} {o.dtype}, h_final {h_final.shape} {h_final.dtype} "
        f"({time.perf_counter() - start:.2f} s incl. compile)"
    )

    # Backward: gradients of a scalar loss in every input.
    def loss(q, k, v, w, b, g):
        o, h = gdn2core.gdn2_forward_trainable(q, k, v, w, b, g, backend=args.backend)
        return jnp.mean(o.astype(jnp.float32) ** 2) + 1e-3 * jnp.mean(h**2)

    start = time.perf_counter()
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=range(6)))(q, k, v, w, b, g)
    jax.block_until_ready(grads)
    print(f"backward: loss {float(value):.5f} ({time.perf_counter() - start:.2f} s incl. compile)")
    for n, gr in zip("qkvwbg", grads, strict=True):
        print(f"  d{n}: shape {tuple(gr.shape)}, norm {float(jnp.linalg.norm(gr)):.4e}")
    ok = all(bool(jnp.all(jnp.isfinite(gr))) for gr in grads)
    print("all gradients finite" if ok else "NON-FINITE GRADIENTS")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
