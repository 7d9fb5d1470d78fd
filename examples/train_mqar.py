"""Train a small GDN-2 model on multi-query associative recall (MQAR) on the CPU.

    python examples/train_mqar.py [--backend auto] [--steps 800] [--seed 0] [--devices N]
                                  [--packed [K]]

MQAR (Arora et al., "Zoology", 2023) is the standard synthetic test of a recurrent model's memory:
a sequence first lists ``N`` key-value pairs ``k1 v1 k2 v2 ... kN vN``, then asks for the keys
again in a random order ``k_a k_b ...``; at every query the model must output the value that was
paired with that key earlier. Keys are drawn without replacement from one half of the vocabulary,
values from the other half, so chance accuracy is ``1 / (vocab / 2)``. Only query positions count
in the loss and the accuracy.

Model: token embedding, ``--layers`` blocks of [RMSNorm -> GDN2Layer -> residual, RMSNorm -> MLP
-> residual], RMSNorm, linear read-out; Flax NNX, optax AdamW with warm-up and cosine decay.
Needs the ``flax`` extra. Prints the backend, the shapes, the accuracy and the time.

``--devices N`` (N > 1) trains data-parallel on a 1-D mesh ``("data",)`` of N devices: the batch
is sharded over it with a ``NamedSharding`` (``--batch`` must divide by N), the parameters and the
optimiser state are replicated, and each ``GDN2Layer`` gets ``mesh=``/``batch_axes="data"``, so the
operator runs once per device on its batch shard (``gdn2core.sharding``). Without N real devices,
N CPU devices are simulated (``XLA_FLAGS=--xla_force_host_platform_device_count=N``, set below
before JAX is imported): that checks the sharded program, it does not make training faster.

``--packed [K]`` (K = 4 when omitted) trains on packed sequences: each row concatenates K MQAR
examples, marked by ``segment_ids`` (B / K rows of K * 3 * pairs tokens, so a step sees the same
examples and tokens as unpacked), and every ``GDN2Layer`` resets its state and short convolutions
at each example's first token. It is evaluated on the unpacked evaluation set of the default run,
so the two accuracies compare directly.
"""

# ruff: noqa: E402  (the device-count flag must be set before JAX is imported)
from __future__ import annotations

import argparse
import os
import sys
import time


def _simulate_host_devices(argv: list[str] | None) -> None:
    """For ``--devices N`` > 1, ask XLA for N CPU devices (only the CPU platform reads the flag;
    a GPU/TPU platform with N devices is used as is). A no-op once JAX is imported, or when
    ``XLA_FLAGS`` already sets a count."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--devices", type=int, default=1)
    n = pre.parse_known_args(sys.argv[1:] if argv is None else argv)[0].devices
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "jax" not in sys.modules and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


if __name__ == "__main__":
    _simulate_host_devices(None)

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import gdn2core
from gdn2core.config import KernelConfig
from gdn2core.layers import GDN2Layer

# ----------------------------------------------------------------------------------- data


def mqar_batch(rng: np.random.Generator, batch: int, pairs: int, vocab: int):
    """``(tokens, targets, mask)``, each ``(batch, 3 * pairs)``; targets valid where mask."""
    half = vocab // 2
    if pairs > half - 1:
        raise ValueError(f"--pairs {pairs} needs a vocabulary of at least {2 * (pairs + 1)}")
    # keys: distinct tokens in [1, half); values: any token in [half, vocab)
    keys = np.argsort(rng.random((batch, half - 1)), axis=1)[:, :pairs] + 1
    values = rng.integers(half, vocab, size=(batch, pairs))
    order = np.argsort(rng.random((batch, pairs)), axis=1)  # query order
    queries = np.take_along_axis(keys, order, axis=1)
    answers = np.take_along_axis(values, order, axis=1)
    context = np.stack([keys, values], axis=2).reshape(batch, 2 * pairs)
    tokens = np.concatenate([context, queries], axis=1)
    targets = np.concatenate([np.zeros_like(context), answers], axis=1)
    mask = np.concatenate([np.zeros_like(context), np.ones_like(answers)], axis=1)
    return tokens.astype(np.int32), targets.astype(np.int32), mask.astype(np.float32)


def pack_batch(batch, per_row: int):
    """``(tokens, targets, mask, segment_ids)``: ``per_row`` consecutive examples of an
    :func:`mqar_batch` concatenated per row, ``(B / per_row, per_row * 3 * pairs)`` each;
    ``segment_ids`` numbers the examples of a row."""
    tokens, targets, mask = (a.reshape(a.shape[0] // per_row, -1) for a in batch)
    length = batch[0].shape[1]
    ids = np.repeat(np.arange(per_row, dtype=np.int32), length)  # [per_row * length]
    return tokens, targets, mask, np.broadcast_to(ids, tokens.shape).copy()


# ----------------------------------------------------------------------------------- model


class Block(nnx.Module):
    def __init__(self, d_model, heads, head_dim, *, backend, config, rngs, variant="gdn2",
                 **mesh_axes):  # fmt: skip
        self.norm1 = nnx.RMSNorm(d_model, rngs=rngs)
        self.mixer = GDN2Layer(
            d_model,
            heads,
            head_dim,
            expand_v=2,
            backend=backend,
            config=config,
            variant=variant,
            rngs=rngs,
            **mesh_axes,
        )
        self.norm2 = nnx.RMSNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.down = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(self, x, segment_ids=None, cache=None):
        """``x`` -> the block's output; with a ``GDN2Cache``, ``(output, new_cache)``."""
        if cache is None:
            x = x + self.mixer(self.norm1(x), segment_ids=segment_ids)
        else:
            mixed, cache = self.mixer(self.norm1(x), cache=cache)
            x = x + mixed
        x = x + self.down(jax.nn.gelu(self.up(self.norm2(x))))
        return x if cache is None else (x, cache)


class MQARModel(nnx.Module):
    def __init__(
        self, vocab, d_model, layers, heads, head_dim, *, backend, config, rngs, variant="gdn2",
        **mesh_axes,
    ):  # fmt: skip
        """``variant``: the ``GDN2Layer`` variant; ``mesh_axes``: ``mesh=``, ``batch_axes=``, ...
        for every ``GDN2Layer``."""
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.blocks = getattr(nnx, "List", list)(
            [
                Block(
                    d_model,
                    heads,
                    head_dim,
                    backend=backend,
                    config=config,
                    rngs=rngs,
                    variant=variant,
                    **mesh_axes,
                )
                for _ in range(layers)
            ]
        )
        self.norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, rngs=rngs)

    def __call__(self, tokens, segment_ids=None, caches=None):
        """Logits ``(B, T, vocab)``; with ``caches`` (one ``GDN2Cache`` per block, see
        :meth:`init_cache`), ``(logits, new_caches)``: a prompt, then one token at a time."""
        x = self.embed(tokens)
        new = []
        for i, block in enumerate(self.blocks):
            if caches is None:
                x = block(x, segment_ids)
            else:
                x, cache = block(x, cache=caches[i])
                new.append(cache)
        logits = self.head(self.norm(x))
        return logits if caches is None else (logits, new)

    def init_cache(self, batch, **kw):
        """One empty ``GDN2Cache`` per block (``kw``: ``GDN2Layer.init_cache`` options)."""
        return [block.mixer.init_cache(batch, **kw) for block in self.blocks]


def loss_and_acc(model, tokens, targets, mask, segment_ids=None):
    logits = model(tokens, segment_ids).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    n = jnp.maximum(mask.sum(), 1.0)
    acc = ((logits.argmax(-1) == targets) * mask).sum() / n
    return (ce * mask).sum() / n, acc


@nnx.jit
def train_step(model, optimizer, tokens, targets, mask, segment_ids=None):
    """One AdamW step on a batch (rows of packed examples with ``segment_ids``); returns the
    batch's loss and accuracy."""
    (loss, acc), grads = nnx.value_and_grad(loss_and_acc, has_aux=True)(
        model, tokens, targets, mask, segment_ids
    )
    optimizer.update(model, grads)
    return loss, acc


# ----------------------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", help="gdn2 backend (see `gdn2 info`)")
    p.add_argument(
        "--variant",
        choices=("gdn2", "kda", "gdn"),
        default="gdn2",
        help="the token mixer: GDN-2, KDA or GDN (GDN2Layer(variant=...); default %(default)s)",
    )
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--pairs", type=int, default=8, help="key-value pairs per sequence")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--chunk", type=int, default=8, help="KernelConfig chunk length bt")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument(
        "--min-accuracy",
        type=float,
        default=None,
        help="exit with status 1 if the final eval accuracy is below this",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        help="data-parallel over N devices (simulated CPU devices when fewer are present)",
    )
    p.add_argument(
        "--packed",
        type=int,
        nargs="?",
        const=4,
        default=0,
        metavar="K",
        help="train on rows of K packed examples marked by segment_ids (K = 4 if omitted)",
    )
    args = p.parse_args(argv)
    if args.devices < 1 or args.batch % args.devices:
        p.error(f"--batch {args.batch} must divide by --devices {args.devices} (>= 1)")
    if args.packed < 0 or (args.packed and args.batch % (args.packed * args.devices)):
        p.error(
            f"--packed {args.packed}: --batch {args.batch} must divide by K x --devices "
            f"{args.devices} (K >= 1)"
        )
    return args


def make_mesh(n: int):
    """A 1-D mesh ``("data",)`` over ``n`` devices: the default platform's, else the CPU's."""
    devices = jax.devices()
    if len(devices) < n:
        cpu = jax.devices("cpu")
        if len(cpu) < n:
            raise SystemExit(
                f"--devices {n}: only {len(devices)} {devices[0].platform} and {len(cpu)} CPU "
                "devices (JAX was imported before XLA_FLAGS could ask for more?)"
            )
        devices = cpu
    # Auto axes: XLA propagates the batch sharding through the embedding, MLP and loss; the
    # layers are told the batch axis explicitly.
    return jax.make_mesh((n,), ("data",), (AxisType.Auto,), devices=devices[:n])


def main(argv=None) -> int:
    _simulate_host_devices(argv)  # effective only when JAX is not imported yet
    args = parse_args(argv)
    mesh = make_mesh(args.devices) if args.devices > 1 else None
    mesh_axes = {} if mesh is None else dict(mesh=mesh, batch_axes="data")
    T = 3 * args.pairs
    config = KernelConfig(bt=args.chunk)
    rng = np.random.default_rng(args.seed)
    eval_rng = np.random.default_rng(args.seed + 10_000)

    model = MQARModel(
        args.vocab,
        args.d_model,
        args.layers,
        args.heads,
        args.head_dim,
        backend=args.backend,
        config=config,
        rngs=nnx.Rngs(args.seed),
        variant=args.variant,
        **mesh_axes,
    )
    warmup = max(1, args.steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, args.lr / 10)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=args.weight_decay),
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    if mesh is None:
        put = jnp.asarray
    else:
        # parameters and optimiser state replicated on the mesh; batches split along "data"
        replicated = NamedSharding(mesh, PartitionSpec())
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, replicated))
        batch_sharding = NamedSharding(mesh, PartitionSpec("data"))

        def put(a):
            return jax.device_put(a, batch_sharding)

    H, dk, dv = args.heads, args.head_dim, 2 * args.head_dim
    zk = jnp.zeros((args.batch, T, H, dk))
    zv = jnp.zeros((args.batch, T, H, dv))
    name = gdn2core.which_backend(zk, zk, zv, zv, zk, zk, config=config, backend=args.backend)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    chance = 1.0 / (args.vocab - args.vocab // 2)
    print(
        f"mixer: {args.variant}; backend: {name} (requested {args.backend!r}); jax "
        f"{jax.__version__} on "
        f"{jax.devices()[0].platform}"
    )
    print(
        f"MQAR: {args.pairs} pairs, vocab {args.vocab}, sequence length {T}, batch "
        f"{args.batch}; chance accuracy {chance:.3f}"
    )
    print(
        f"model: {args.layers} x GDN2Layer(d_model={args.d_model}, H={H}, dk={dk}, dv={dv}) "
        f"+ MLP, {n_params:,} parameters; operator q/k {(args.batch, T, H, dk)}, "
        f"v {(args.batch, T, H, dv)}, chunk {config.bt}"
    )
    if args.packed:
        print(
            f"packed: {args.packed} examples per row, {args.batch // args.packed} rows of "
            f"{args.packed * T} tokens (segment_ids); evaluated unpacked"
        )
    if mesh is None:
        print(f"devices: 1 ({jax.devices()[0]})")
    else:
        kind = mesh.devices.flat[0].platform
        print(
            f"devices: {args.devices} {kind}; mesh {dict(mesh.shape)} over "
            f"{[d.id for d in mesh.devices.flat]}; batch sharded {args.batch // args.devices} "
            "per device"
            + (
                "  (simulated CPU devices: checks the sharding, not a speed-up)"
                if kind == "cpu"
                else ""
            )
        )

    @nnx.jit
    def eval_step(model, tokens, targets, mask):
        return loss_and_acc(model, tokens, targets, mask)

    eval_set = [
        mqar_batch(eval_rng, args.batch, args.pairs, args.vocab) for _ in range(args.eval_batches)
    ]

    def evaluate() -> tuple[float, float]:
        out = [eval_step(model, *map(put, b)) for b in eval_set]
        return tuple(float(np.mean([o[i] for o in out])) for i in (0, 1))

    start = time.perf_counter()
    history = []
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    columns = (
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
    )
    with Progress(*columns, console=console, disable=args.no_progress) as progress:
        task = progress.add_task("train", total=args.steps, status="compiling")
        compile_s = None
        for step in range(1, args.steps + 1):
            batch = mqar_batch(rng, args.batch, args.pairs, args.vocab)
            if args.packed:
                batch = pack_batch(batch, args.packed)
            loss, acc = train_step(model, optimizer, *map(put, batch))
            if compile_s is None:
                loss = float(loss)
                compile_s = time.perf_counter() - start
            if step % args.eval_every == 0 or step == args.steps:
                ev_loss, ev_acc = evaluate()
                history.append((step, ev_loss, ev_acc))
                progress.console.print(
                    f"step {step:5d}  train loss {float(loss):.3f} acc {float(acc):.3f}  "
                    f"eval loss {ev_loss:.3f} acc {ev_acc:.3f}"
                )
            progress.update(task, advance=1, status=f"loss {float(loss):.3f}")
    elapsed = time.perf_counter() - start
    final_acc = history[-1][2]
    print(
        f"final eval accuracy {final_acc:.3f} (chance {chance:.3f}) after {args.steps} steps "
        f"in {elapsed:.1f} s (first step incl. compile {compile_s:.1f} s); backend {name}"
    )
    sys.stdout.flush()
    if args.min_accuracy is not None and final_acc < args.min_accuracy:
        print(f"accuracy {final_acc:.3f} below --min-accuracy {args.min_accuracy}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
