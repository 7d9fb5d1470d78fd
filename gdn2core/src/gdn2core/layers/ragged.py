"""``GDN2Layer.ragged``: the layer over a serving engine's flat batch of requests.

The tokens of every request of an engine step are one flat row ``x (T, d_model)``; request ``i``
owns ``cu_seqlens[i]:cu_seqlens[i + 1]``. What a request carries from step to step lives in
pools addressed by the same slots as the operator's state pool (:func:`gdn2core.gdn2_ragged`):
the recurrent state ``(P, HV, dk, dv)`` and, per short convolution, its last ``W - 1`` inputs
``(P, W - 1, channels)`` (:class:`GDN2RaggedCache`).

The short convolutions run over the flat row without crossing a request boundary: tap ``d`` of
the token at position ``j`` of its request reads the request's token ``j - d`` when ``j >= d``,
else entry ``W - 1 - d + j`` of the request's starting window (its slot's, zeros for a new
request). Every window stored is the last ``W - 1`` inputs of (starting window, the request's
tokens) up to the state stored with it: the final one in the request's slot, and one per
checkpoint and draft slot at the position where the operator stores that state, so a request
resumed from any of them continues as if uninterrupted. The slot rules (negative: none; invalid
traced values: not stored) are the operator's (:func:`gdn2core.ops.ragged.spec.ragged_slots`).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp

from gdn2core.indexing import count_at_most
from gdn2core.ops.ragged.api import gdn2_ragged
from gdn2core.ops.ragged.spec import RaggedSpec, checkpoint_cuts, ragged_slots

CONVS = (("conv_q", "q_conv"), ("conv_k", "k_conv"), ("conv_v", "v_conv"))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["conv_q", "conv_k", "conv_v", "state"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class GDN2RaggedCache:
    """The slot pools of a :class:`~gdn2core.layers.GDN2Layer` served ragged (a pytree).

    Attributes:
        conv_q, conv_k, conv_v: each short convolution's last ``conv_size - 1`` inputs per slot
            ``(P, conv_size - 1, channels)`` (None without convolutions).
        state: the recurrent state pool ``(P, HV, dk, dv)``, float32 or bfloat16.
    """

    conv_q: jax.Array | None
    conv_k: jax.Array | None
    conv_v: jax.Array | None
    state: jax.Array


def init_ragged_cache(layer, slots: int, *, state_dtype=jnp.float32) -> GDN2RaggedCache:
    """``slots`` zero slots of every pool (see :meth:`GDN2Layer.init_ragged_cache`)."""
    if isinstance(slots, bool) or not isinstance(slots, numbers.Integral) or slots < 1:
        raise ValueError(f"slots: expected a positive integer, got {slots!r}")
    c = layer.init_cache(int(slots), state_dtype=state_dtype)
    return GDN2RaggedCache(c.conv_q, c.conv_k, c.conv_v, c.state)


def _check(layer, x, cache) -> None:
    """ValueError / TypeError unless ``x`` is ``(T, d_model)`` and ``cache`` this layer's pools."""
    shape = tuple(int(d) for d in jnp.shape(x))
    if len(shape) != 2 or shape[1] != layer.d_model:
        raise ValueError(
            f"x: expected shape (T, d_model) = (T, {layer.d_model}) (the flat tokens of every "
            f"request), got {shape}"
        )
    if not isinstance(cache, GDN2RaggedCache):
        raise TypeError(
            "cache: expected a GDN2RaggedCache (layer.init_ragged_cache(slots)), got "
            f"{type(cache).__name__}"
        )
    HV, dk, dv = layer.num_v_heads, layer.dk, layer.dv
    got = tuple(int(d) for d in jnp.shape(cache.state))
    if len(got) != 4 or got[1:] != (HV, dk, dv) or got[0] < 1:
        raise ValueError(
            f"cache.state: expected shape (P, HV, dk, dv) = (P, {HV}, {dk}, {dv}) with P >= 1, "
            f"got {got} (layer.init_ragged_cache(P) makes the pools of P slots)"
        )
    for name, attr in CONVS:
        conv = getattr(layer, attr)
        channels = HV * dv if name == "conv_v" else layer.num_heads * dk
        want = None if conv is None else (got[0], conv.kernel_size - 1, channels)
        value = getattr(cache, name)
        have = None if value is None else tuple(int(d) for d in jnp.shape(value))
        if have != want:
            what = "None (no short convolutions)" if want is None else f"shape {want}"
            raise ValueError(
                f"cache.{name}: expected {what} for P = {got[0]} slots (cache.state's), got "
                f"{'None' if have is None else f'shape {have}'}"
            )
    allowed = layer.state_dtypes()
    if jnp.dtype(cache.state.dtype).name not in allowed:
        raise TypeError(
            f"cache.state: expected dtype {' or '.join(allowed)}, got "
            f"{jnp.dtype(cache.state.dtype).name}"
        )


def conv_tokens(weight: jax.Array, x: jax.Array, start: jax.Array, seq, local) -> jax.Array:
    """The causal depthwise convolution and SiLU of :class:`ShortConv` over the flat row.

    Args:
        weight: ``(W, C)``; tap ``j`` reads the token ``W - 1 - j`` before.
        x: ``(T, C)`` the flat inputs.
        start: ``(N + 1, W - 1, C)`` each request's starting window (row N: the padding's).
        seq, local: ``(T,)`` each token's request and position in it.
    """
    W, T = weight.shape[0], x.shape[0]
    wt = weight.astype(x.dtype)
    taps = []
    for j in range(W):
        d = W - 1 - j  # tokens back
        if d == 0:
            taps.append(x)
            continue
        own = x[jnp.clip(jnp.arange(T) - d, 0, None)]  # [T, C] its own token, where local >= d
        cached = start[seq, jnp.clip(local - d + W - 1, 0, W - 2)]  # [T, C] else its window
        taps.append(jnp.where((local >= d)[:, None], own, cached))
    return jax.nn.silu(sum(tap * wt[j] for j, tap in enumerate(taps)))


def windows_after(x, cu, start, req, m) -> jax.Array:
    """``(K, W - 1, C)``: the last ``W - 1`` inputs of request ``req[k]`` after its first
    ``m[k]`` tokens of this call (its starting window, then its tokens)."""
    width = start.shape[1]
    c = m[:, None] + jnp.arange(width)[None]  # [K, W - 1] index into (window, tokens)
    rows = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])  # [T + 1, C]: T may be 0
    own = rows[jnp.clip(cu[req][:, None] + c - width, 0, x.shape[0])]  # [K, W - 1, C]
    cached = start[req[:, None], jnp.clip(c, 0, width - 1)]
    return jnp.where((c >= width)[..., None], own, cached)


def ragged_call(
    layer,
    x,
    cache: GDN2RaggedCache,
    *,
    cu_seqlens,
    state_indices,
    has_initial_state=None,
    checkpoint_every: int | None = None,
    context_lens=None,
    checkpoint_slots=None,
    draft_slots=None,
    num_decodes: int = 0,
    decode_len: int = 1,
) -> tuple[jax.Array, GDN2RaggedCache]:
    """``(y (T, d_model), new_cache)`` (see :meth:`GDN2Layer.ragged`)."""
    _check(layer, x, cache)
    x = jnp.asarray(x).astype(layer.dtype)
    t = x.shape[0]
    H, HV, dk, dv = layer.num_heads, layer.num_v_heads, layer.dk, layer.dv
    qkv = [layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)]  # [T, channels], before the convs
    w, b, g = layer.raw_gates(x, scalar=True)  # raw (the operator activates); KDA's, GDN's scalar
    shapes = ((t, H, dk), (t, H, dk), (t, HV, dv))
    meta = dict(
        cu_seqlens=cu_seqlens, state_indices=state_indices, has_initial_state=has_initial_state,
        checkpoint_every=checkpoint_every, context_lens=context_lens,
        checkpoint_slots=checkpoint_slots, draft_slots=draft_slots, num_decodes=num_decodes,
        decode_len=decode_len,
    )  # fmt: skip
    # The op's checks first: the convolutions below index with the metadata.
    raw = [a.reshape(s) for a, s in zip(qkv, shapes, strict=True)]
    spec = RaggedSpec.from_inputs(*raw, w, b, g, cache.state, scale=layer.scale, **meta)
    n, p = spec.n_requests, spec.pool_size
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)  # [N + 1]
    slots = ragged_slots(spec, state_indices, checkpoint_slots, draft_slots)
    flags = jnp.ones((n,), bool) if has_initial_state is None else jnp.asarray(has_initial_state)
    seq = count_at_most(cu[1:], jnp.arange(t, dtype=jnp.int32))  # [T], N: pad
    local = jnp.arange(t, dtype=jnp.int32) - cu[seq]  # [T]

    # The windows stored: (request, its tokens of this call before it, slot; P: not stored).
    lens = cu[1:] - cu[:-1]  # [N]
    ends, chosen = [], []  # [N, cols]: the local token each stored state follows (-1: none)
    if spec.checkpoint_cols:
        ends.append(checkpoint_cuts(spec, cu, context_lens))
        chosen.append(slots.checkpoints)
    if spec.draft_cols:
        j = jnp.arange(spec.draft_cols, dtype=jnp.int32)[None]  # draft j: after local token j
        ends.append(jnp.where(j < lens[:, None], j, -1))
        chosen.append(slots.drafts)
    rows = jnp.arange(n, dtype=jnp.int32)[:, None]
    req = jnp.concatenate(
        [rows[:, 0], *(jnp.broadcast_to(rows, e.shape).reshape(-1) for e in ends)]
    )
    m = jnp.concatenate([lens, *((e + 1).reshape(-1) for e in ends)])
    target = jnp.concatenate([
        jnp.where(slots.state >= 0, slots.state, p),
        *(jnp.where((e >= 0) & (s >= 0), s, p).reshape(-1) for e, s in zip(ends, chosen, strict=True)),
    ])  # fmt: skip

    mixed, pools = [], {}
    for a, (name, attr) in zip(qkv, CONVS, strict=True):
        conv, pool = getattr(layer, attr), getattr(cache, name)
        if conv is None:
            mixed.append(a)
            pools[name] = None
            continue
        read = (slots.state >= 0) & flags  # [N]
        start = pool[jnp.where(read, slots.state, 0)].astype(a.dtype)  # [N, W - 1, C]
        start = jnp.where(read[:, None, None], start, 0)
        start = jnp.concatenate([start, jnp.zeros((1, *start.shape[1:]), a.dtype)])  # + padding
        mixed.append(conv_tokens(conv.weight[...], a, start, seq, local))
        stored = windows_after(a, cu, start, req, m).astype(pool.dtype)
        pools[name] = pool.at[target].set(stored, mode="drop")

    q, k, v = (a.reshape(s) for a, s in zip(mixed, shapes, strict=True))
    o, state = gdn2_ragged(
        q, k, v, w, b, g, cache.state, scale=layer.scale, config=layer.config,
        backend=layer.backend, **meta, **layer.fused_options(),
    )  # fmt: skip
    gate = layer.gate_proj(x).reshape(t, HV, dv)
    y = layer.o_proj(layer.o_norm(o, gate).reshape(t, HV * dv))  # 0 where o is 0 (padding)
    return y, GDN2RaggedCache(pools["conv_q"], pools["conv_k"], pools["conv_v"], state)


__all__ = ["GDN2RaggedCache", "conv_tokens", "init_ragged_cache", "ragged_call", "windows_after"]
