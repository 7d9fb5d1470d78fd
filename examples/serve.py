"""Serve a small GDN-2 model with continuous batching: one ragged layer call per block and step.

    python examples/serve.py [--backend auto] [--requests 24] [--budget 64] [--drafts K]

The model is ``train_mqar.py``'s (embedding, ``--layers`` blocks of RMSNorm -> GDN2Layer ->
residual, RMSNorm -> MLP -> residual, read-out) with random weights: training it for MQAR takes
about a minute on the CPU here, and what this example checks, that batching changes no generated
token, does not depend on the weights.

The engine (greedy decoding), one step at a time:

- **Scheduling.** A queue of requests, each a prompt and a number of tokens to generate. A step
  packs at most ``--budget`` tokens of at most ``--max-running`` requests into one flat row:
  first every running request's decode (its last token, plus its drafts), then the prompts
  (chunked: a long prompt continues over several steps), then new requests admitted from the
  queue while tokens, rows and slots remain. The row is padded to ``--budget`` tokens and a fixed
  number of request rows, so one compiled step serves every step.
- **The model call.** Every block runs ``GDN2Layer.ragged`` over the row against its slot pools
  (``GDN2RaggedCache``: the recurrent state and the short convolutions' last inputs per slot);
  the decodes are the row's first requests (``num_decodes``) and run on the decode op.
- **Slots.** A request holds one slot from admission to its end (``has_initial_state`` false at
  its first step: the slot's old contents are ignored) and frees it when done.
- **Prefix cache.** Prompt prefixes are checkpointed every ``--every`` tokens
  (``checkpoint_every``, ``context_lens``, ``checkpoint_slots``) into the slots of an LRU cache
  keyed by the prefix's tokens (``--prefix-slots`` slots). A new request whose prompt starts with
  a cached prefix copies that slot into its own (state and convolution windows) and runs only
  the rest of its prompt.
- **Drafts** (``--drafts K``): each decode proposes up to K tokens by lookup (the tokens that
  followed the last earlier occurrence of its last token in its own history), runs them in
  the same step with ``draft_slots`` (the state after each of its tokens in a slot of its own),
  keeps the longest prefix the model agrees with plus the model's next token, and continues
  next step from the slot of the last accepted draft (rolling the rest back); the other slots
  are freed.

It prints the throughput (tokens per second on this machine, compile excluded), the latency of
a step, the prefix cache's hit rate and the drafts' acceptance, then checks every request's
generated tokens against the same request generated alone through the layer's plain serving call
(``layer(x, cache=...)``: the prompt in pieces, then one decode step per token): they must be
equal token for token. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from train_mqar import MQARModel

import gdn2core
from gdn2core.config import KernelConfig


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", help="gdn2 backend (see `gdn2 info`)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--prefixes", type=int, default=3, help="shared prompt prefixes")
    p.add_argument("--max-prompt", type=int, default=80)
    p.add_argument("--max-new", type=int, default=24, help="most tokens generated per request")
    p.add_argument("--budget", type=int, default=64, help="tokens per step")
    p.add_argument("--max-running", type=int, default=8, help="requests per step")
    p.add_argument("--every", type=int, default=16, help="prefix checkpoint interval")
    p.add_argument("--prefix-slots", type=int, default=16, help="slots of the prefix cache")
    p.add_argument("--drafts", type=int, default=0, metavar="K", help="draft tokens per decode")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--chunk", type=int, default=8, help="KernelConfig chunk length bt")
    args = p.parse_args(argv)
    if args.budget < args.max_running * (1 + args.drafts) + 1:
        p.error("--budget must exceed --max-running x (1 + --drafts): room for a prompt chunk")
    if args.max_prompt < 2 * args.every or args.max_new < 1:
        p.error("--max-prompt must be at least 2 x --every, --max-new at least 1")
    return args


# ----------------------------------------------------------------------------------- model


def ragged_forward(model: MQARModel, tokens, caches, **metadata):
    """``(logits (T, vocab), new caches)`` of the flat row ``tokens (T,)``: train_mqar's blocks
    with ``GDN2Layer.ragged`` as the mixer (norms and MLP act per token)."""
    x = model.embed(tokens)
    new = []
    for block, cache in zip(model.blocks, caches, strict=True):
        mixed, cache = block.mixer.ragged(block.norm1(x), cache, **metadata)
        x = x + mixed
        x = x + block.down(jax.nn.gelu(block.up(block.norm2(x))))
        new.append(cache)
    return model.head(model.norm(x)), new


def make_step(graphdef, *, every: int, num_decodes: int, decode_len: int):
    """The engine's compiled step: copy prefix-cache slots, run the row, greedy next tokens."""

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, caches, tokens, cu, slots, flags, ctx, ckpt, drafts, copy_src, copy_dst):
        model = nnx.merge(graphdef, params)
        caches = [
            jax.tree.map(lambda a: a.at[copy_dst].set(a[copy_src], mode="drop"), c) for c in caches
        ]  # a resumed request's own slot from its prefix's (copy_dst P: none)
        logits, caches = ragged_forward(
            model, tokens, caches, cu_seqlens=cu, state_indices=slots, has_initial_state=flags,
            checkpoint_every=every, context_lens=ctx, checkpoint_slots=ckpt, draft_slots=drafts,
            num_decodes=num_decodes, decode_len=decode_len,
        )  # fmt: skip
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), caches

    return step


def generate_alone(model, graphdef, params, prompt, max_new: int, piece: int) -> list[int]:
    """Greedy tokens of one request through the plain serving call (``GDN2Cache``): the prompt
    in pieces of ``piece`` tokens and single tokens (two shapes, two compiles), then one decode
    step per token."""
    caches = model.init_cache(1)
    out, logits = [], None
    cuts = list(range(0, len(prompt) - len(prompt) % piece, piece))
    parts = [prompt[c : c + piece] for c in cuts]
    parts += [prompt[i : i + 1] for i in range(len(parts) * piece, len(prompt))]
    for part in parts:
        logits, caches = _plain(params, caches, jnp.asarray(part)[None], graphdef=graphdef)
    while True:
        out.append(int(jnp.argmax(logits[0, -1])))
        if len(out) == max_new:
            return out
        logits, caches = _plain(params, caches, jnp.asarray([[out[-1]]]), graphdef=graphdef)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _plain(params, caches, tokens, *, graphdef):
    return nnx.merge(graphdef, params)(tokens, caches=caches)


# ----------------------------------------------------------------------------------- engine


@dataclasses.dataclass
class Request:
    """A request: its prompt, how many tokens it wants, and where it stands."""

    rid: int
    prompt: list[int]
    max_new: int
    slot: int = -1
    done: int = 0  # tokens of the prompt run (or restored from the prefix cache)
    out: list[int] = dataclasses.field(default_factory=list)
    reused: int = 0  # prompt tokens restored from the prefix cache

    @property
    def prefilling(self) -> bool:
        return self.done < len(self.prompt)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` drafts by lookup: what followed the last earlier occurrence of the last
        token in the request's history, searched in what the model generated first (greedy
        models repeat themselves), then in the prompt."""
        history = self.prompt + self.out
        generated = range(len(history) - 2, len(self.prompt) - 2, -1)
        for i in (*generated, *range(len(self.prompt) - 2, -1, -1)):
            if history[i] == history[-1]:
                return history[i + 1 : i + 1 + k]
        return []


def make_requests(args, rng) -> list[Request]:
    """Prompts of random tokens; most start with one of ``--prefixes`` shared prefixes."""
    longest = max(args.every + 1, 2 * args.max_prompt // 3)
    shared = [rng.integers(0, args.vocab, rng.integers(args.every, longest + 1)).tolist()
              for _ in range(args.prefixes)]  # fmt: skip
    requests = []
    for rid in range(args.requests):
        if shared and rng.random() < 0.75:
            head = shared[rng.integers(len(shared))]
            tail = rng.integers(0, args.vocab, rng.integers(1, args.max_prompt - len(head) + 1))
            prompt = head + tail.tolist()
        else:
            prompt = rng.integers(0, args.vocab, rng.integers(4, args.max_prompt + 1)).tolist()
        requests.append(Request(rid, prompt, int(rng.integers(1, args.max_new + 1))))
    return requests


class PrefixCache:
    """An LRU of prompt prefixes (their tokens) to the slots holding the state after them."""

    def __init__(self, slots: range):
        self.free = list(slots)
        self.entries: collections.OrderedDict[tuple, int] = collections.OrderedDict()
        self.in_use: set[int] = set()  # slots read or written this step: not evicted
        self.pending: dict[tuple, int] = {}  # entries this step stores

    def lookup(self, prompt: list[int], every: int) -> tuple[int, int]:
        """``(tokens, slot)`` of the longest cached prefix shorter than the prompt (the last
        prompt token must run, for its logits), or ``(0, -1)``."""
        for n in range((len(prompt) - 1) // every * every, 0, -every):
            slot = self.entries.get(tuple(prompt[:n]))
            if slot is not None:
                self.entries.move_to_end(tuple(prompt[:n]))
                self.in_use.add(slot)
                return n, slot
        return 0, -1

    def reserve(self, key: tuple) -> int:
        """A slot for the state after prefix ``key`` (evicting the least recently used entry),
        or -1: already cached, or every slot in use this step."""
        if key in self.pending:  # another request of this step stores it
            return -1
        if key in self.entries:
            self.entries.move_to_end(key)
            return -1
        if not self.free:
            victim = next((k for k, s in self.entries.items() if s not in self.in_use), None)
            if victim is None:
                return -1
            self.free.append(self.entries.pop(victim))
        slot = self.free.pop()
        self.in_use.add(slot)
        self.pending[key] = slot
        return slot

    def begin_step(self):
        self.in_use, self.pending = set(), {}

    def end_step(self):
        self.entries.update(self.pending)  # stored by this step's call


@dataclasses.dataclass
class Row:
    """One request's part of a step."""

    req: Request
    tokens: list[int]
    ctx: int  # tokens of the request before this step
    fresh: bool = False  # first step: start from zeros (or from the copied prefix slot)
    copy_from: int = -1
    ckpt: list[int] = dataclasses.field(default_factory=list)  # checkpoint slots
    drafts: list[int] = dataclasses.field(default_factory=list)  # proposed draft tokens
    draft_slots: list[int] = dataclasses.field(default_factory=list)


class Engine:
    """The scheduler: the running requests, the free slots, the prefix cache, the statistics.

    Slots ``[0, R (1 + K))`` belong to requests and their drafts (each running request holds one,
    and K more during a step that verifies drafts); the rest are the prefix cache's.
    """

    def __init__(self, args, step, params, caches):
        self.args, self.step, self.params, self.caches = args, step, params, caches
        R, K = args.max_running, args.drafts
        self.n_rows, self.cols = 2 * R, args.budget // args.every + 1  # decode rows, then prompts
        self.request_slots = list(range(R * (1 + K)))  # free slots: a request's and its drafts'
        self.pool = R * (1 + K) + args.prefix_slots
        self.prefix = PrefixCache(range(R * (1 + K), self.pool))
        self.running: list[Request] = []
        self.latencies: list[float] = []
        self.proposed = self.accepted = self.decode_rows = self.all_accepted = 0

    def schedule(self, queue: collections.deque) -> tuple[list[Row], list[Row]]:
        args, budget = self.args, self.args.budget
        self.prefix.begin_step()
        decodes = []
        for req in self.running:
            if req.prefilling:
                continue
            k = min(args.drafts, req.max_new - len(req.out) - 1)
            drafts = req.propose(k) if k > 0 else []
            row = Row(req, [req.out[-1], *drafts], len(req.prompt) + len(req.out) - 1)
            row.drafts = drafts
            row.draft_slots = [self.request_slots.pop() for _ in drafts]
            decodes.append(row)
            budget -= len(row.tokens)
        prompts = []
        for req in [r for r in self.running if r.prefilling]:
            if budget > 0:
                prompts.append(self._chunk(req, budget))
                budget -= len(prompts[-1].tokens)
        while queue and budget > 0 and len(self.running) < args.max_running:
            req = queue.popleft()
            req.slot = self.request_slots.pop()
            req.done, copy_from = self.prefix.lookup(req.prompt, args.every)
            req.reused = req.done
            self.running.append(req)
            prompts.append(self._chunk(req, budget, fresh=True, copy_from=copy_from))
            budget -= len(prompts[-1].tokens)
        return decodes, prompts

    def _chunk(self, req: Request, budget: int, fresh=False, copy_from=-1) -> Row:
        every, n = self.args.every, min(budget, len(req.prompt) - req.done)
        row = Row(req, req.prompt[req.done : req.done + n], req.done, fresh, copy_from)
        first = (req.done // every + 1) * every
        row.ckpt = [self.prefix.reserve(tuple(req.prompt[:a]))
                    for a in range(first, req.done + n + 1, every)]  # fmt: skip
        return row

    def arrays(self, decodes: list[Row], prompts: list[Row]):
        """The step's padded metadata (decode rows first, then prompt rows)."""
        R, K, n = self.args.max_running, self.args.drafts, self.n_rows
        rows = decodes + [None] * (R - len(decodes)) + prompts + [None] * (R - len(prompts))
        tokens = [t for r in rows if r for t in r.tokens]
        lens = [len(r.tokens) if r else 0 for r in rows]
        meta = dict(
            tokens=np.array(tokens + [0] * (self.args.budget - len(tokens)), np.int32),
            cu=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
            slots=np.array([r.req.slot if r else -1 for r in rows], np.int32),
            flags=np.array([bool(r) and (not r.fresh or r.copy_from >= 0) for r in rows]),
            ctx=np.array([r.ctx if r else 0 for r in rows], np.int32),
            ckpt=np.full((n, self.cols), -1, np.int32),
            drafts=np.full((n, K), -1, np.int32) if K else None,
            copy_src=np.zeros((n,), np.int32),
            copy_dst=np.full((n,), self.pool, np.int32),
        )
        for i, r in enumerate(rows):
            if r is None:
                continue
            meta["ckpt"][i, : len(r.ckpt)] = r.ckpt
            if K:
                meta["drafts"][i, : len(r.draft_slots)] = r.draft_slots
            if r.copy_from >= 0:
                meta["copy_src"][i], meta["copy_dst"][i] = r.copy_from, r.req.slot
        return meta

    def run_step(self, queue) -> tuple[int, list[Request]]:
        decodes, prompts = self.schedule(queue)
        meta = self.arrays(decodes, prompts)
        start = time.perf_counter()
        preds, self.caches = self.step(self.params, self.caches, *meta.values())
        preds = np.asarray(preds)
        self.latencies.append(time.perf_counter() - start)
        self.prefix.end_step()
        finished, pos = [], 0
        for i, row in enumerate(decodes + prompts):
            req, got = row.req, preds[pos : pos + len(row.tokens)]
            pos += len(row.tokens)
            if i < len(decodes):
                a = 0  # drafts accepted: the model's next token after each agrees
                while a < len(row.drafts) and row.drafts[a] == got[a]:
                    a += 1
                req.out += [int(t) for t in got[: a + 1]]
                self.proposed += len(row.drafts)
                self.accepted += a
                self.decode_rows += 1
                self.all_accepted += bool(row.drafts) and a == len(row.drafts)
                if a < len(row.drafts):  # roll back: continue from the accepted draft's slot
                    self.request_slots.append(req.slot)
                    req.slot = row.draft_slots[a]
                    row.draft_slots[a] = -1
                self.request_slots += [s for s in row.draft_slots if s >= 0]
            else:
                req.done += len(row.tokens)
                if not req.prefilling:
                    req.out.append(int(got[-1]))
            if len(req.out) >= req.max_new:
                req.out = req.out[: req.max_new]
                self.running.remove(req)
                self.request_slots.append(req.slot)
                finished.append(req)
        return pos, finished


# ----------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    config = KernelConfig(bt=args.chunk)
    model = MQARModel(
        args.vocab, args.d_model, args.layers, args.heads, args.head_dim,
        backend=args.backend, config=config, rngs=nnx.Rngs(args.seed),
    )  # fmt: skip
    graphdef, params = nnx.split(model)
    R, K = args.max_running, args.drafts
    step = make_step(graphdef, every=args.every, num_decodes=R, decode_len=1 + K)
    mixer = model.blocks[0].mixer
    pool = R * (1 + K) + args.prefix_slots
    caches = [block.mixer.init_ragged_cache(pool) for block in model.blocks]
    engine = Engine(args, step, params, caches)
    requests = make_requests(args, rng)
    zk = jnp.zeros((1, args.budget, args.heads, mixer.dk))
    zv = jnp.zeros((1, args.budget, args.heads, mixer.dv))
    name = gdn2core.which_backend(zk, zk, zv, zv, zk, zk, config=config, backend=args.backend)
    print(f"backend: {name} (requested {args.backend!r}); jax {jax.__version__} on "
          f"{jax.devices()[0].platform}")  # fmt: skip
    print(f"model: {args.layers} x GDN2Layer(d_model={args.d_model}, H={args.heads}, "
          f"dk={mixer.dk}, dv={mixer.dv}) + MLP, vocab {args.vocab}, random weights")  # fmt: skip
    print(f"engine: {args.budget} tokens and {R} requests per step, {pool} slots "
          f"({R * (1 + K)} for requests and drafts, {args.prefix_slots} prefix cache), "
          f"checkpoints every {args.every} tokens, {K} drafts per decode")  # fmt: skip
    lens = [len(r.prompt) for r in requests]
    print(f"requests: {len(requests)}, prompts of {min(lens)} to {max(lens)} tokens "
          f"({args.prefixes} shared prefixes), 1 to {args.max_new} new tokens each")  # fmt: skip

    start = time.perf_counter()  # compile on an empty step: every request padded, nothing named
    _, engine.caches = engine.step(params, engine.caches, *engine.arrays([], []).values())
    jax.block_until_ready(engine.caches)
    print(f"compile: {time.perf_counter() - start:.1f} s")

    queue, done, tokens_run, steps = collections.deque(requests), [], 0, 0
    start = time.perf_counter()
    while queue or engine.running:
        ran, finished = engine.run_step(queue)
        tokens_run += ran
        done += finished
        steps += 1
    elapsed = time.perf_counter() - start
    generated = sum(len(r.out) for r in done)
    lat = np.array(engine.latencies) * 1e3
    print(f"served {len(done)} requests in {steps} steps, {elapsed:.2f} s: "
          f"{tokens_run / elapsed:,.0f} tokens/s run ({tokens_run} tokens), "
          f"{generated / elapsed:,.0f} generated tokens/s ({generated} tokens)")  # fmt: skip
    print(f"step latency: mean {lat.mean():.1f} ms, p50 {np.percentile(lat, 50):.1f} ms, "
          f"p90 {np.percentile(lat, 90):.1f} ms, max {lat.max():.1f} ms")  # fmt: skip
    hits = sum(r.reused > 0 for r in done)
    reused, prompt_tokens = sum(r.reused for r in done), sum(lens)
    print(f"prefix cache: {hits} of {len(done)} requests hit ({hits / len(done):.0%}), "
          f"{reused} of {prompt_tokens} prompt tokens reused ({reused / prompt_tokens:.0%})")  # fmt: skip
    if K:
        rate = engine.accepted / max(engine.proposed, 1)
        per = (engine.accepted + engine.decode_rows) / max(engine.decode_rows, 1)
        print(f"drafts: {engine.accepted} of {engine.proposed} accepted ({rate:.0%}); decodes "
              f"with every draft accepted: {engine.all_accepted}; {per:.2f} tokens per decode")  # fmt: skip

    bad = []
    for req in sorted(done, key=lambda r: r.rid):
        alone = generate_alone(model, graphdef, params, req.prompt, req.max_new, args.every)
        if alone != req.out:
            bad.append(req.rid)
            print(f"MISMATCH request {req.rid}: batched {req.out}, alone {alone}")
    print(f"check: {len(done) - len(bad)} of {len(requests)} requests generate the same tokens "
          "as alone (greedy)")  # fmt: skip
    sys.stdout.flush()
    return 1 if bad or len(done) != len(requests) else 0


if __name__ == "__main__":
    raise SystemExit(main())
