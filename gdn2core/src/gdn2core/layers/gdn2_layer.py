"""``GDN2Layer``: a Gated DeltaNet-2 token mixer as a Flax NNX module.

Per token ``x_t`` (``d_model``) and head ``h`` (``H`` heads, key size ``dk``, value size
``dv = expand_v * dk``)::

    q, k, v = SiLU(causal_depthwise_conv(W_q x)), ...(W_k x), ...(W_v x)   # short conv, SiLU
    q, k    = q / ||q||, k / ||k||                                          # L2 per head
    b       = sigmoid(W_b x)           (x 2 with lift_b: (0, 2), negative eigenvalues allowed)
    w       = sigmoid(W_w x)           write gate, value axis
    g       = -exp(A_log[h]) * softplus(W_f x + dt_bias)   log decay per key channel, g <= 0
    o, S_T  = gdn2_forward_trainable(q, k, v, w, b, g, scale, h0, config, backend)
    y       = W_o  GatedRMSNorm(o, SiLU(W_gate x))

The L2 norm, the sigmoids and the decay gate are not applied here: the layer passes the raw
projections with the operator's fused options (``use_qk_l2norm_in_kernel``,
``use_bw_sigmoid_in_kernel`` / ``allow_neg_eigval``, ``use_gate_in_kernel`` with ``A_log`` and
``dt_bias``), so a backend that fuses them reads the raw tensors once.

Grouped value heads (``num_v_heads`` = HV, a multiple of H): q, k have H heads; v, w, the output
gate and the state have HV heads; value head ``j`` reads key head ``j // (HV // H)``. b, g,
``A_log`` and ``dt_bias`` are per value head (HV), as in fla's GatedDeltaNet and Qwen3-Next
(``a_proj``/``b_proj`` to ``num_v_heads``); ``key_head_gates=True`` puts them on the H key heads
instead, which lets the operator compute the key side once per group.

Packed sequences: ``segment_ids`` (``__call__``) resets both the state and the short
convolutions' windows at every sequence start. Padding: ``attention_mask`` removes the padded
tokens before the mixer runs, as fla's layers unpad (``index_first_axis`` on the mask's indices):
the tokens of a row are one sequence however the padding falls (left, right, or between tokens,
where the state and the convolutions carry across the gap), and the output is 0 at padding.

Serving: :meth:`GDN2Layer.init_cache` and ``layer(x, cache=cache) -> (y, new_cache)`` carry
the short convolutions' last inputs and the recurrent state from call to call: a prompt runs the
chunked forward (prefill), then one token per call runs the decode op (``gdn2_decode``, with the
same fused options); split anywhere, the outputs are those of one call over the whole sequence.
:meth:`GDN2Layer.ragged` serves an engine's flat batch of requests against slot pools
(:mod:`gdn2core.layers.ragged`, ``docs/serving.md``).

Variants (``variant=``): ``"kda"`` (Kimi Delta Attention) projects one beta per head with
``b_proj``, which is both the erase and the write gate (``w = b``, no ``w_proj``); ``"gdn"``
(Gated DeltaNet) also projects one decay per head with ``f_proj`` (``dt_bias`` per head). Their
scalars go to the operator as its scalar gates (``docs/operator.md``, section KDA and GDN).

The operator contract is ``docs/operator.md``; the parameterisation of the decay follows
fla's KDA/GDN-2 layers (``A_log`` per head initialised from U(1, 16), ``dt_bias`` per key channel
initialised as the inverse softplus of a log-uniform step in ``[dt_min, dt_max]``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from gdn2core.config import KernelConfig
from gdn2core.features.activations import per_channel_dt_bias
from gdn2core.features.segments import segment_starts
from gdn2core.layers import ragged
from gdn2core.layers.ragged import GDN2RaggedCache
from gdn2core.ops.decode.api import gdn2_decode
from gdn2core.ops.decode.spec import POOL_DTYPES
from gdn2core.ops.forward.api import gdn2_forward, gdn2_forward_trainable
from gdn2core.registry import get_backend
from gdn2core.selection import AUTO

#: The layer's variants (``GDN2Layer(variant=...)``): GDN-2, KDA and GDN on the same operator.
VARIANTS = ("gdn2", "kda", "gdn")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["conv_q", "conv_k", "conv_v", "state"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class GDN2Cache:
    """What a :class:`GDN2Layer` carries from one call to the next when serving (a pytree).

    Attributes:
        conv_q, conv_k, conv_v: the last ``conv_size - 1`` inputs of each short convolution
            ``(B, conv_size - 1, channels)`` (None without convolutions).
        state: the recurrent state ``(B, HV, dk, dv)``, float32 or bfloat16 (the decode op's pool,
            one slot per batch row).
    """

    conv_q: jax.Array | None
    conv_k: jax.Array | None
    conv_v: jax.Array | None
    state: jax.Array


def sequence_starts(
    shape: tuple[int, int],
    segment_ids: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
) -> jax.Array | None:
    """Where packed sequences start: ``(B, T)`` bool, or None when the row is one sequence.

    A sequence starts at token 0, wherever ``segment_ids`` changes, and wherever
    ``attention_mask`` switches between token (non-zero) and padding (0): every run of tokens and
    every run of padding is a sequence of its own, so padding never reaches a token. The layer
    calls it on rows already unpadded by :func:`unpad_order` (the tokens first, the padding
    after them), so a gap between tokens does not split a row.

    Args:
        shape: ``(B, T)`` of the layer input.
        segment_ids: ``(B, T)`` integers, or None.
        attention_mask: ``(B, T)``, non-zero for a token and 0 for padding, or None.

    Raises:
        ValueError: an argument not of shape ``(B, T)``.
        TypeError: ``segment_ids`` not integer.
    """
    starts = None
    for name, x in (("segment_ids", segment_ids), ("attention_mask", attention_mask)):
        if x is None:
            continue
        actual = tuple(int(d) for d in jnp.shape(x))
        if actual != tuple(shape):
            raise ValueError(f"{name}: expected shape (B, T) = {tuple(shape)}, got {actual}")
        if name == "segment_ids" and not jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
            raise TypeError(f"segment_ids: expected an integer dtype, got {jnp.asarray(x).dtype}")
        change = segment_starts(jnp.asarray(x) if name == "segment_ids" else jnp.asarray(x) != 0)
        starts = change if starts is None else starts | change
    return starts


def unpad_order(attention_mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The permutation that moves each row's tokens to its front, as fla unpads a batch.

    fla's layers drop the padded positions (``get_unpad_data`` / ``index_first_axis``) and run the
    remaining tokens of each row as one sequence. With static shapes the same is a stable
    permutation per row: the tokens first, in their order, then the padding.

    Args:
        attention_mask: ``(B, T)``, non-zero for a token and 0 for padding.

    Returns:
        ``(order, inverse, packed_mask)``, each ``(B, T)``: ``x[b, order[b, i]]`` is the ``i``-th
        token of row ``b`` (padding after the tokens); ``inverse`` undoes it
        (``take_along_axis(packed, inverse)`` puts every position back); ``packed_mask`` is True
        at the tokens of the reordered row (its first ``count`` positions).
    """
    keep = jnp.asarray(attention_mask) != 0  # [B, T]
    order = jnp.argsort(jnp.where(keep, 0, 1), axis=1, stable=True)  # [B, T] tokens, then padding
    inverse = jnp.argsort(order, axis=1, stable=True)  # [B, T]
    count = jnp.sum(keep, axis=1, dtype=jnp.int32)  # [B]
    packed_mask = jnp.arange(keep.shape[1], dtype=jnp.int32)[None, :] < count[:, None]
    return order, inverse, packed_mask


def _take(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x[b, index[b, t], ...]``: ``x`` ``(B, T, ...)`` reordered along time by ``index``."""
    index = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


def positions_in_segment(starts: jax.Array) -> jax.Array:
    """Each token's index in its sequence ``(B, T)`` int32, from :func:`sequence_starts`."""
    t = jnp.arange(starts.shape[1], dtype=jnp.int32)  # [T]
    first = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)  # [B, T] start of the token's sequence
    return t - first


class ShortConv(nnx.Module):
    """Causal depthwise 1-D convolution over time followed by SiLU: ``(B, T, C) -> (B, T, C)``.

    ``y[t, c] = silu(sum_j weight[j, c] * x[t - (K - 1) + j, c])`` with zeros before ``t = 0``, so
    the output at ``t`` depends only on inputs at ``<= t``.
    """

    def __init__(self, channels: int, kernel_size: int = 4, *, rngs: nnx.Rngs):
        bound = 1.0 / math.sqrt(kernel_size)  # PyTorch's Conv1d default for a depthwise conv
        self.kernel_size = kernel_size
        self.weight = nnx.Param(
            jax.random.uniform(rngs.params(), (kernel_size, channels), jnp.float32, -bound, bound)
        )

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array | None = None,
        conv_state: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """``x`` ``(B, T, C)``; ``positions`` ``(B, T)``: each token's index in its packed sequence
        (:func:`positions_in_segment`), or None for one sequence per row. Taps reaching before
        the start of the token's sequence read zeros, as they do before ``t = 0``.
        ``conv_state`` ``(B, K - 1, C)``: the inputs before ``x`` (serving, one sequence per row);
        then the result is ``(y, the last K - 1 inputs)``."""
        K = self.kernel_size
        T = x.shape[1]
        if conv_state is None:
            xp = jnp.pad(x, ((0, 0), (K - 1, 0), (0, 0)))  # [B, K - 1 + T, C]
        else:
            xp = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K - 1 + T, C]
        wt = self.weight[...].astype(x.dtype)
        taps = [xp[:, j : j + T, :] for j in range(K)]  # tap j reads token t - (K - 1 - j)
        if positions is not None:
            taps = [
                jnp.where((positions >= K - 1 - j)[..., None], tap, 0) for j, tap in enumerate(taps)
            ]
        y = jax.nn.silu(sum(tap * wt[j] for j, tap in enumerate(taps)))
        return y if conv_state is None else (y, xp[:, T:])


class GatedRMSNorm(nnx.Module):
    """RMSNorm over the last axis, then times ``SiLU(gate)`` (fla's ``FusedRMSNormGated``)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        y = xf * self.weight[...] * jax.nn.silu(gate.astype(jnp.float32))
        return y.astype(x.dtype)


class GDN2Layer(nnx.Module):
    """Gated DeltaNet-2 token mixer, ``(B, T, d_model) -> (B, T, d_model)``.

    Args:
        d_model: model width.
        num_heads: H.
        head_dim: dk, the key (and query) head size.
        expand_v: dv = int(expand_v * dk); GDN-2 models often use 2.
        num_v_heads: HV, the value heads (a multiple of ``num_heads``); None for ``num_heads``.
        key_head_gates: b, g (and ``A_log``, ``dt_bias``) per key head (H) instead of per value
            head (HV, fla's and Qwen3-Next's layout); the same without grouped value heads.
        variant: ``"gdn2"``; ``"kda"`` (Kimi Delta Attention: ``b_proj`` gives one beta per
            head, the erase and write gates both, no ``w_proj``); ``"gdn"`` (Gated DeltaNet:
            beta as KDA's and ``f_proj`` one decay per head, ``dt_bias`` ``(Hg,)``). The same
            operator call, the scalars as its scalar gates, also from a cache and in
            :meth:`ragged` (the decode op broadcasts them; docs/operator.md, section KDA and
            GDN). ``lift_b`` is GDN-2's alone (fla's ``allow_neg_eigval`` doubles KDA's one
            beta, erase and write, which the fused activations do not express).
        conv_size: kernel size of the short causal convolution on q, k, v (0 disables it).
        lift_b: erase gate in (0, 2) instead of (0, 1) (allows negative eigenvalues).
        backend: gdn2 backend name or "auto" (see ``gdn2 info``).
        config: ``KernelConfig`` for chunked backends (None: the default).
        scale: query scale; None for dk ** -0.5.
        dtype: dtype of the activations fed to the operator (parameters stay float32).
        mesh, batch_axes, head_axes, context_axis: passed to ``gdn2_forward_trainable`` (see
            :mod:`gdn2core.sharding`): with a multi-device mesh, or inputs on a multi-device
            ``NamedSharding``, each device runs the operator on its shard; ``context_axis``
            splits the sequence too (T must divide by its size). None (the default): the mesh is
            found from the inputs' sharding, and a single device runs the plain path.

    Raises:
        ValueError: ``expand_v * head_dim`` is not a positive integer, or ``num_v_heads`` not a
            positive multiple of ``num_heads``.
        TypeError: ``config`` is not a KernelConfig (or None), ``backend`` not a string.
        BackendNotFoundError: ``backend`` names a backend that is not installed (checked here,
            not at the first call).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        *,
        expand_v: float = 1.0,
        conv_size: int = 4,
        lift_b: bool = False,
        backend: str = "auto",
        config: KernelConfig | None = None,
        scale: float | None = None,
        norm_eps: float = 1e-5,
        dt_min: float = 1e-3,
        dt_max: float = 1e-1,
        dtype: jnp.dtype = jnp.float32,
        mesh=None,
        batch_axes: str | tuple[str, ...] | None = None,
        head_axes: str | tuple[str, ...] | None = None,
        context_axis: str | None = None,
        num_v_heads: int | None = None,
        key_head_gates: bool = False,
        variant: str = "gdn2",
        rngs: nnx.Rngs,
    ):
        if variant not in VARIANTS:
            raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
        if variant != "gdn2" and lift_b:
            raise ValueError(f"lift_b: expected False with variant={variant!r} (GDN-2's erase gate "
                             "alone), got True")  # fmt: skip
        self.variant = variant
        dv = int(expand_v * head_dim)
        if dv < 1 or dv != expand_v * head_dim:
            raise ValueError(f"expand_v * head_dim must be a positive integer, got {dv}")
        HV = num_heads if num_v_heads is None else num_v_heads
        if not isinstance(HV, int) or HV < 1 or HV % num_heads:
            raise ValueError(
                f"num_v_heads: expected a positive multiple of num_heads = {num_heads}, got {HV}"
            )
        Hg = num_heads if key_head_gates else HV  # heads of b, g, A_log, dt_bias
        self.num_v_heads, self.gate_heads = HV, Hg
        if config is not None and not isinstance(config, KernelConfig):
            raise TypeError(f"config: expected a KernelConfig or None, got {type(config).__name__}")
        if not isinstance(backend, str):
            raise TypeError(
                f"backend: expected a backend name or 'auto', got {type(backend).__name__}"
            )
        if backend != AUTO:
            get_backend(backend)  # a misspelt name fails here, with the installed names
        H, dk = num_heads, head_dim
        self.d_model, self.num_heads, self.dk, self.dv = d_model, H, dk, dv
        self.lift_b, self.backend, self.config = lift_b, backend, config
        self.scale = dk**-0.5 if scale is None else float(scale)
        self.dtype = dtype
        # static sharding options (plain attributes: not parameters, not traced)
        self.mesh, self.context_axis = mesh, context_axis
        self.batch_axes = tuple(batch_axes) if isinstance(batch_axes, list) else batch_axes
        self.head_axes = tuple(head_axes) if isinstance(head_axes, list) else head_axes

        def lin(i, o):
            return nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)

        self.q_proj, self.k_proj, self.v_proj = (
            lin(d_model, H * dk),
            lin(d_model, H * dk),
            lin(d_model, HV * dv),
        )
        scalar_beta, scalar_decay = variant != "gdn2", variant == "gdn"
        self.b_proj = lin(d_model, Hg if scalar_beta else Hg * dk)  # KDA, GDN: beta per head
        self.w_proj = None if scalar_beta else lin(d_model, HV * dv)
        self.f_proj = lin(d_model, Hg if scalar_decay else Hg * dk)
        self.gate_proj = lin(d_model, HV * dv)
        self.o_proj = lin(HV * dv, d_model)
        if conv_size > 0:
            self.q_conv = ShortConv(H * dk, conv_size, rngs=rngs)
            self.k_conv = ShortConv(H * dk, conv_size, rngs=rngs)
            self.v_conv = ShortConv(HV * dv, conv_size, rngs=rngs)
        else:
            self.q_conv = self.k_conv = self.v_conv = None
        self.A_log = nnx.Param(
            jnp.log(jax.random.uniform(rngs.params(), (Hg,), jnp.float32, 1, 16))
        )
        dt = jnp.exp(
            jax.random.uniform(
                rngs.params(), (Hg if scalar_decay else Hg * dk,), jnp.float32,
                math.log(dt_min), math.log(dt_max),
            )
        )  # fmt: skip
        self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))  # inverse softplus
        self.o_norm = GatedRMSNorm(dv, eps=norm_eps)

    def raw_gates(
        self, x: jax.Array, scalar: bool = False
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The operator's raw ``(w, b, g)`` of ``x`` ``(..., d_model)``: ``(..., HV, dv)``,
        ``(..., Hg, dk)``, ``(..., Hg, dk)`` (the operator applies the activations,
        :meth:`fused_options`); KDA's and GDN's per-head scalars broadcast to those shapes (w of
        a value head from its key head's beta when ``Hg = H``), or with ``scalar`` left as the
        operator's scalar gates: w ``(..., HV)``, b ``(..., Hg)`` and GDN's g ``(..., Hg)``."""
        lead = x.shape[:-1]
        HV, Hg, dk, dv = self.num_v_heads, self.gate_heads, self.dk, self.dv
        f = self.f_proj(x)
        if self.variant == "gdn2":
            w = self.w_proj(x).reshape(*lead, HV, dv)
            return w, self.b_proj(x).reshape(*lead, Hg, dk), f.reshape(*lead, Hg, dk)
        beta = self.b_proj(x).reshape(*lead, Hg)  # [..., Hg] one beta erases and writes
        beta_v = beta if Hg == HV else jnp.repeat(beta, HV // Hg, axis=-1)  # value head j: j // G
        if scalar:
            g = f.reshape(*lead, Hg) if self.variant == "gdn" else f.reshape(*lead, Hg, dk)
            return beta_v, beta, g
        b = jnp.broadcast_to(beta[..., None], (*lead, Hg, dk))
        w = jnp.broadcast_to(beta_v[..., None], (*lead, HV, dv))
        g = f.reshape(*lead, Hg, 1 if self.variant == "gdn" else dk)
        return w, b, jnp.broadcast_to(g, (*lead, Hg, dk))

    def gates(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The gates of the operator.

        Args:
            x: the layer input ``(B, T, d_model)``.

        Returns:
            ``(w, b, g)`` shaped ``(B, T, HV, dv)``, ``(B, T, Hg, dk)``, ``(B, T, Hg, dk)``
            (``Hg``: HV, or H with ``key_head_gates``). The layer's call does not use them: it
            passes the raw projections and has the operator apply these activations.
        """
        w, b, f = self.raw_gates(x)
        w, b = jax.nn.sigmoid(w), jax.nn.sigmoid(b)
        if self.lift_b:
            b = 2.0 * b
        f = f.astype(jnp.float32) + self.fused_options()["dt_bias"]
        g = -jnp.exp(self.A_log[...])[:, None] * jax.nn.softplus(f)
        return w, b, g.astype(x.dtype)

    def fused_options(self, per_head_bias: bool = False) -> dict:
        """The operator's fused-activation keywords of this layer: L2 norm of q, k, the sigmoids of
        b (``2 * sigmoid`` with ``lift_b``) and w, and the softplus decay gate with ``A_log`` and
        ``dt_bias`` as ``(Hg, dk)`` (GDN's one bias per head broadcast over dk), or with
        ``per_head_bias`` GDN's as ``(Hg,)`` (for the chunked op on its scalar decay, whose
        kernels then know the activated decay is the same on every channel)."""
        dt_bias = self.dt_bias[...]
        if self.variant != "gdn":
            dt_bias = dt_bias.reshape(self.gate_heads, self.dk)
        elif not per_head_bias:
            dt_bias = per_channel_dt_bias(dt_bias, self.dk)
        return dict(
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            A_log=self.A_log[...],
            dt_bias=dt_bias,
            use_bw_sigmoid_in_kernel=True,
            allow_neg_eigval=self.lift_b,
        )

    def state_dtypes(self) -> tuple[str, ...]:
        """The dtypes :meth:`init_cache` accepts for the state: float32 and bfloat16 (the decode
        op's pool dtypes), and float64 for a layer that runs in float64."""
        wide = jnp.dtype(self.dtype) == jnp.float64
        return (*POOL_DTYPES, "float64") if wide else POOL_DTYPES

    def init_cache(self, batch: int, *, state_dtype=jnp.float32) -> GDN2Cache:
        """The cache of ``batch`` sequences that have seen no token (zeros), for serving.

        Args:
            batch: B, a positive integer.
            state_dtype: the recurrent state's dtype: float32, or bfloat16 to halve the memory a
                serving batch needs (the decode op computes in float32 and rounds once per call;
                docs/operator.md measures the cost); float64 too for a layer with
                ``dtype=float64``.

        Returns:
            The :class:`GDN2Cache`.

        Raises:
            ValueError: ``batch`` not a positive integer.
            TypeError: ``state_dtype`` none of :meth:`state_dtypes` (an integer state would be
                truncated to zero, a float16 one is refused by the decode op).
        """
        if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1:
            raise ValueError(f"batch: expected a positive integer, got {batch!r}")
        batch = int(batch)
        allowed = self.state_dtypes()
        try:
            name = jnp.dtype(state_dtype).name
        except TypeError:
            name = repr(state_dtype)
        if name not in allowed:
            raise TypeError(f"state_dtype: expected {' or '.join(allowed)}, got {name}")
        H, HV, dk, dv = self.num_heads, self.num_v_heads, self.dk, self.dv

        def conv(layer: ShortConv | None, channels: int) -> jax.Array | None:
            if layer is None:
                return None
            return jnp.zeros((batch, layer.kernel_size - 1, channels), self.dtype)

        return GDN2Cache(
            conv_q=conv(self.q_conv, H * dk),
            conv_k=conv(self.k_conv, H * dk),
            conv_v=conv(self.v_conv, HV * dv),
            state=jnp.zeros((batch, HV, dk, dv), name),
        )

    def init_ragged_cache(self, slots: int, *, state_dtype=jnp.float32) -> GDN2RaggedCache:
        """The pools of ``slots`` slots (zeros) for :meth:`ragged`: the state ``(P, HV, dk, dv)``
        and each short convolution's last inputs ``(P, conv_size - 1, channels)``.

        Raises:
            ValueError: ``slots`` not a positive integer.
            TypeError: ``state_dtype`` none of :meth:`state_dtypes`.
        """
        return ragged.init_ragged_cache(self, slots, state_dtype=state_dtype)

    def ragged(
        self,
        x: jax.Array,
        cache: GDN2RaggedCache,
        *,
        cu_seqlens: jax.Array,
        state_indices: jax.Array,
        has_initial_state: jax.Array | None = None,
        checkpoint_every: int | None = None,
        context_lens: jax.Array | None = None,
        checkpoint_slots: jax.Array | None = None,
        draft_slots: jax.Array | None = None,
        num_decodes: int = 0,
        decode_len: int = 1,
    ) -> tuple[jax.Array, GDN2RaggedCache]:
        """Serve a flat batch of requests (inference only, one device): ``x (T, d_model)``,
        request ``i`` owning tokens ``cu_seqlens[i]:cu_seqlens[i + 1]``.

        Request ``i`` starts from its slot's convolution windows and state
        (``state_indices[i]``) when ``has_initial_state[i]`` (else zeros), runs the layer over
        its tokens (the short convolutions never reach another request's tokens), and leaves its
        last convolution inputs and its final state in the slot; checkpoint and draft slots get
        both at the positions where :func:`gdn2core.gdn2_ragged` stores the state
        (:mod:`gdn2core.layers.ragged`).

        Args:
            x: ``(T, d_model)``; tokens past ``cu_seqlens[N]`` are padding (``y`` is 0 there and
                for requests with a negative slot).
            cache: the :class:`GDN2RaggedCache` of :meth:`init_ragged_cache`.
            cu_seqlens, state_indices, has_initial_state, checkpoint_every, context_lens,
                checkpoint_slots, draft_slots, num_decodes, decode_len: the request metadata, as
                :func:`gdn2core.gdn2_ragged` takes it (traced under ``jax.jit`` but for the
                static ``checkpoint_every``, ``num_decodes`` and ``decode_len``).

        Returns:
            ``(y (T, d_model), new_cache)``.

        Raises:
            ValueError, TypeError: ``x`` not ``(T, d_model)``; ``cache`` not this layer's pools;
                the operator's errors for the metadata (naming the argument).
        """
        return ragged.ragged_call(
            self, x, cache, cu_seqlens=cu_seqlens, state_indices=state_indices,
            has_initial_state=has_initial_state, checkpoint_every=checkpoint_every,
            context_lens=context_lens, checkpoint_slots=checkpoint_slots, draft_slots=draft_slots,
            num_decodes=num_decodes, decode_len=decode_len,
        )  # fmt: skip

    def _check_x(self, x) -> tuple[int, int]:
        """``(B, T)`` of the layer input; ValueError unless it is ``(B, T, d_model)``."""
        shape = tuple(int(d) for d in jnp.shape(x))
        if len(shape) != 3 or shape[2] != self.d_model or min(shape) < 1:
            raise ValueError(
                f"x: expected shape (B, T, d_model) = (B, T, {self.d_model}) with B, T >= 1, "
                f"got {shape}"
            )
        return shape[0], shape[1]

    def _check_cache(self, cache, batch: int) -> None:
        """TypeError / ValueError unless ``cache`` is this layer's cache of ``batch`` rows."""
        if not isinstance(cache, GDN2Cache):
            raise TypeError(
                f"cache: expected a GDN2Cache (layer.init_cache(B)), got {type(cache).__name__}"
            )
        H, HV, dk, dv = self.num_heads, self.num_v_heads, self.dk, self.dv
        expected = {"state": (batch, HV, dk, dv)}
        for name, layer, channels in (
            ("conv_q", self.q_conv, H * dk),
            ("conv_k", self.k_conv, H * dk),
            ("conv_v", self.v_conv, HV * dv),
        ):
            expected[name] = None if layer is None else (batch, layer.kernel_size - 1, channels)
        for name, want in expected.items():
            value = getattr(cache, name)
            got = None if value is None else tuple(int(d) for d in jnp.shape(value))
            if got != want:
                what = "None (no short convolutions)" if want is None else f"shape {want}"
                raise ValueError(
                    f"cache.{name}: expected {what} for x of batch B = {batch}, got "
                    f"{'None' if got is None else f'shape {got}'} (layer.init_cache(B) makes "
                    "the cache of B rows)"
                )
        allowed = self.state_dtypes()
        if jnp.dtype(cache.state.dtype).name not in allowed:
            raise TypeError(
                f"cache.state: expected dtype {' or '.join(allowed)}, got "
                f"{jnp.dtype(cache.state.dtype).name}"
            )

    def _inputs(
        self, x: jax.Array, positions: jax.Array | None, cache: GDN2Cache | None,
        scalar: bool = False,
    ):  # fmt: skip
        """The operator's raw q, k, v, w, b, g (it applies the activations, :meth:`fused_options`)
        and, with a cache, the new convolution states."""
        B, T, _ = x.shape
        H, dk, dv = self.num_heads, self.dk, self.dv
        HV = self.num_v_heads
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        convs = (None, None, None)
        if self.q_conv is not None:
            if cache is None:
                q, k, v = (
                    self.q_conv(q, positions),
                    self.k_conv(k, positions),
                    self.v_conv(v, positions),
                )
            else:
                (q, cq), (k, ck), (v, cv) = (
                    self.q_conv(q, conv_state=cache.conv_q),
                    self.k_conv(k, conv_state=cache.conv_k),
                    self.v_conv(v, conv_state=cache.conv_v),
                )
                convs = (cq, ck, cv)
        q = q.reshape(B, T, H, dk)  # raw: the operator normalises q and k
        k = k.reshape(B, T, H, dk)
        v = v.reshape(B, T, HV, dv)
        w, b, g = self.raw_gates(x, scalar)  # raw: the operator applies the sigmoids and decay
        return (q, k, v, w, b, g), convs

    def _output(self, x: jax.Array, o: jax.Array) -> jax.Array:
        B, T, _ = x.shape
        HV, dv = self.num_v_heads, self.dv
        gate = self.gate_proj(x).reshape(B, T, HV, dv)
        return self.o_proj(self.o_norm(o, gate).reshape(B, T, HV * dv))

    def __call__(
        self,
        x: jax.Array,
        *,
        h0: jax.Array | None = None,
        return_state: bool = False,
        segment_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        cache: GDN2Cache | None = None,
        decode: bool | None = None,
    ) -> jax.Array | tuple[jax.Array, jax.Array] | tuple[jax.Array, GDN2Cache]:
        """Mix the tokens of ``x``.

        Args:
            x: ``(B, T, d_model)``.
            h0: the operator's initial state ``(B, HV, dk, dv)`` (float32), or None for zeros.
            return_state: also return the final state.
            segment_ids: ``(B, T)`` integers, packed sequences: a sequence starts at token 0 and
                wherever the id changes; the operator's state and the short convolutions' windows
                restart from zero there (``h0`` enters the first sequence of each row, the final
                state leaves the last one).
            attention_mask: ``(B, T)``, non-zero for a token and 0 for padding (any side, any
                dtype), fla's unpadding: the padded positions are removed before the mixer runs,
                so the tokens of a row form one sequence wherever the padding is (at the left,
                the right, or between tokens: the state and the short convolutions carry across
                the gap, as if the padding were not there); ``y`` is 0 at padded positions (and
                passes no gradient there). With ``segment_ids`` too, a sequence starts wherever
                the id changes from one token to the next token (padding skipped). ``h0`` enters
                each row's first token. Not with ``return_state``: the row's final state would
                be its padding's.
            cache: serving (inference only): the :class:`GDN2Cache` of the tokens before ``x``
                (:meth:`init_cache` for none), of the same batch B; the call returns
                ``(y, new_cache)`` and takes no ``h0``, ``return_state``, ``segment_ids`` or
                ``attention_mask`` (one sequence per row). A prompt (prefill) runs the chunked
                forward from the cached state; new tokens (decode steps) run
                :func:`gdn2core.gdn2_decode` on it.
            decode: with ``cache``, run the decode op (True) or the chunked forward (False);
                None: the decode op for one token per sequence, else the chunked forward. Both
                compute the same operator. ``decode=True`` needs ``cache``.

        Returns:
            ``y`` ``(B, T, d_model)``; ``(y, h_final)`` with ``return_state``; ``(y, new_cache)``
            with ``cache``.

        Raises:
            ValueError: ``x`` not ``(B, T, d_model)``; ``segment_ids`` or ``attention_mask`` not
                ``(B, T)``; ``attention_mask`` with ``return_state``; ``cache`` with any of
                ``h0``, ``return_state``, ``segment_ids``, ``attention_mask``, or of another
                batch size or layer; ``decode=True`` without ``cache``.
            TypeError: ``segment_ids`` not integer; ``cache`` not a :class:`GDN2Cache`, or its
                state of a dtype :meth:`init_cache` refuses; ``decode`` not a bool or None.
        """
        B, T = self._check_x(x)
        if decode is not None and not isinstance(decode, bool):
            raise TypeError(f"decode: expected True, False or None, got {type(decode).__name__}")
        if cache is not None:
            given = [
                name
                for name, value in (
                    ("h0", h0),
                    ("return_state", return_state or None),
                    ("segment_ids", segment_ids),
                    ("attention_mask", attention_mask),
                )
                if value is not None
            ]
            if given:
                raise ValueError(
                    f"cache: the cache holds the state of one sequence per row; pass none of "
                    f"h0, return_state, segment_ids, attention_mask with it, got {', '.join(given)}"
                )
            self._check_cache(cache, B)
            return self._serve(jnp.asarray(x).astype(self.dtype), cache, decode)
        if decode:
            raise ValueError(
                "decode: decode=True needs cache=... (the decode op advances a cached state: "
                "cache = layer.init_cache(B); y, cache = layer(x, cache=cache, decode=True)); "
                "without a cache the layer runs the chunked forward"
            )
        if attention_mask is not None and return_state:
            raise ValueError(
                "attention_mask: not with return_state (the final state of a row with padding "
                "after its last token would be the padding's); pass segment_ids for packed rows "
                "that return a state"
            )
        x = jnp.asarray(x).astype(self.dtype)
        if attention_mask is None:
            y, h_final = self._mix(x, h0, sequence_starts((B, T), segment_ids))
            return (y, h_final) if return_state else y
        sequence_starts((B, T), segment_ids, attention_mask)  # the shapes and dtypes, named
        order, inverse, packed = unpad_order(attention_mask)
        ids = None if segment_ids is None else _take(jnp.asarray(segment_ids), order)
        y, _ = self._mix(_take(x, order), h0, sequence_starts((B, T), ids, packed))
        keep = jnp.asarray(attention_mask) != 0
        return jnp.where(keep[..., None], _take(y, inverse), 0)

    def _mix(
        self, x: jax.Array, h0: jax.Array | None, starts: jax.Array | None
    ) -> tuple[jax.Array, jax.Array]:
        """``(y, h_final)`` of the chunked op over ``x``, sequences starting at ``starts``."""
        positions = None if starts is None else positions_in_segment(starts)
        xs, _ = self._inputs(x, positions, None, scalar=True)  # KDA's, GDN's scalar gates
        seg = None if starts is None else jnp.cumsum(starts, axis=1, dtype=jnp.int32)
        o, h_final = gdn2_forward_trainable(
            *xs,
            self.scale,
            h0,
            self.config,
            self.backend,
            mesh=self.mesh,
            batch_axes=self.batch_axes,
            head_axes=self.head_axes,
            context_axis=self.context_axis,
            segment_ids=seg,
            **self.fused_options(per_head_bias=True),
        )
        return self._output(x, o), h_final

    def _serve(
        self, x: jax.Array, cache: GDN2Cache, decode: bool | None
    ) -> tuple[jax.Array, GDN2Cache]:
        xs, (cq, ck, cv) = self._inputs(x, None, cache, scalar=True)  # KDA's, GDN's scalar gates
        state = cache.state
        if decode if decode is not None else x.shape[1] == 1:
            o, state = gdn2_decode(
                *xs, state, scale=self.scale, config=self.config, backend=self.backend,
                **self.fused_options(),
            )  # fmt: skip
        else:
            h0 = state.astype(jnp.promote_types(state.dtype, jnp.float32))  # bf16 -> f32; f64 kept
            fused = self.fused_options(per_head_bias=True)
            o, h_final = gdn2_forward(*xs, self.scale, h0, self.config, self.backend, **fused)
            state = h_final.astype(state.dtype)
        return self._output(x, o), GDN2Cache(cq, ck, cv, state)
