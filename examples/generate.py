"""Serve a small GDN-2 model: prefill a prompt, then decode one token per step from the cache.

    python examples/generate.py [--backend auto] [--train-steps 800] [--state-dtype float32]

Trains the multi-query associative recall (MQAR) model of ``train_mqar.py`` (``--train-steps``,
800 by default: a few minutes on the CPU here), then serves a batch of fresh MQAR sequences the way a server
does: one call over the prompt (the key-value pairs and the first query) runs the chunked forward
and fills each layer's cache (``GDN2Layer.init_cache``: the short convolutions' last inputs and
the recurrent state), then every further query token is one decode step
(``gdn2core.gdn2_decode`` through ``GDN2Layer(x, cache=...)``), whose prediction is the value
paired with that key.

It checks that the logits of prefill + decode steps equal those of one forward over the whole
sequence (relative error at most ``--tol``; exit status 1 otherwise), prints the accuracy of the
generated answers, and the decode speed in tokens per second (compile excluded).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from train_mqar import MQARModel, mqar_batch, train_step

import gdn2core
from gdn2core.config import KernelConfig


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", help="gdn2 backend (see `gdn2 info`)")
    p.add_argument("--train-steps", type=int, default=800)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32, help="training batch")
    p.add_argument("--gen-batch", type=int, default=16, help="sequences served at once")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--chunk", type=int, default=8, help="KernelConfig chunk length bt")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--state-dtype", choices=("float32", "bfloat16"), default="float32",
        help="dtype of the cached recurrent state",
    )  # fmt: skip
    p.add_argument(
        "--tol", type=float, default=None,
        help="largest relative error of the served logits (default 1e-4; 2e-2 with a bfloat16 "
        "state)",
    )  # fmt: skip
    return p.parse_args(argv)


def train(model, args, rng) -> float:
    """``--train-steps`` AdamW steps on MQAR (train_mqar's step); returns the last accuracy."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, max(1, args.train_steps // 10), max(1, args.train_steps), args.lr / 10
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.98))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    acc = 0.0
    for i in range(1, args.train_steps + 1):
        batch = mqar_batch(rng, args.batch, args.pairs, args.vocab)
        loss, acc = train_step(model, optimizer, *map(jnp.asarray, batch))
        if i % 100 == 0 or i == args.train_steps:
            print(f"train step {i:4d}: loss {float(loss):.3f} acc {float(acc):.3f}", flush=True)
    return float(acc)


def main(argv=None) -> int:
    args = parse_args(argv)
    tol = args.tol if args.tol is not None else (1e-4 if args.state_dtype == "float32" else 2e-2)
    config = KernelConfig(bt=args.chunk)
    rng = np.random.default_rng(args.seed)
    model = MQARModel(
        args.vocab, args.d_model, args.layers, args.heads, args.head_dim,
        backend=args.backend, config=config, rngs=nnx.Rngs(args.seed),
    )  # fmt: skip
    B, T = args.gen_batch, 3 * args.pairs
    H, dk, dv = args.heads, args.head_dim, 2 * args.head_dim
    zq, zv = jnp.zeros((B, 1, H, dk)), jnp.zeros((B, 1, H, dv))
    pool = jnp.zeros((B, H, dk, dv), jnp.dtype(args.state_dtype))
    decoder = gdn2core.which_decode_backend(zq, zq, zv, zv, zq, zq, pool, backend=args.backend)
    print(f"backend: decode {decoder} (requested {args.backend!r}); jax {jax.__version__} on "
          f"{jax.devices()[0].platform}")  # fmt: skip
    print(f"model: {args.layers} x GDN2Layer(d_model={args.d_model}, H={H}, dk={dk}, dv={dv}); "
          f"MQAR {args.pairs} pairs, vocab {args.vocab}; cached state {args.state_dtype}")  # fmt: skip
    if args.train_steps:
        train(model, args, rng)

    tokens, targets, mask = map(jnp.asarray, mqar_batch(rng, B, args.pairs, args.vocab))
    prompt_len = 2 * args.pairs + 1  # the pairs and the first query

    @nnx.jit
    def forward(model, tokens):
        return model(tokens)

    @nnx.jit
    def serve(model, tokens, caches):
        return model(tokens, caches=caches)

    full = forward(model, tokens)  # one forward over the whole sequence, [B, T, vocab]
    caches = model.init_cache(B, state_dtype=jnp.dtype(args.state_dtype))
    first, caches = serve(model, tokens[:, :prompt_len], caches)  # prefill
    step_logits = [first]
    start = None
    for t in range(prompt_len, T):  # decode: one query key per step
        logits, caches = serve(model, tokens[:, t : t + 1], caches)
        logits.block_until_ready()
        if start is None:  # the first decode step compiles
            start = time.perf_counter()
        step_logits.append(logits)
    elapsed = time.perf_counter() - start if start is not None else 0.0
    timed = T - prompt_len - 1
    served = jnp.concatenate(step_logits, axis=1)
    err = float(jnp.max(jnp.abs(served - full)) / jnp.max(jnp.abs(full)))
    answers = served.argmax(-1)
    acc = float(((answers == targets) * mask).sum() / mask.sum())
    print(f"prefill {prompt_len} tokens + {T - prompt_len} decode steps x {B} sequences")
    print(
        f"served logits vs one forward over the sequence: relative error {err:.2e} (tol {tol:.0e})"
    )
    print(
        f"generated answers: accuracy {acc:.3f} (chance {1 / (args.vocab - args.vocab // 2):.3f})"
    )
    if timed > 0:
        per_step = elapsed / timed
        print(f"decode: {per_step * 1e3:.3f} ms per step, {B / per_step:,.0f} tokens/s "
              f"({B} sequences, {timed} steps timed after the compiling one)")  # fmt: skip
    sys.stdout.flush()
    if not err <= tol:
        print(f"MISMATCH: served logits differ from the forward by {err:.2e} > {tol:.0e}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
