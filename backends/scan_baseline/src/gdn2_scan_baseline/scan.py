"""GDN-2 as a ``jax.lax.associative_scan`` over per-token affine maps (the "OLD" baseline).

Each token is the affine map ``S -> A_t S + B_t`` with::

    A_t = (I - k_t (b_t * k_t)^T) diag(exp(g_t))      [dk, dk]
    B_t = k_t (w_t * v_t)^T                           [dk, dv]

Maps compose as ``(A2, B2) o (A1, B1) = (A2 A1, A2 B1 + B2)``, which is associative, so all prefix
maps come from one parallel scan; the prefix states are ``S_t = A_{1..t} h0 + B_{1..t}`` and the
outputs ``o_t = scale * S_t^T q_t``. Gradients are JAX autodiff of this program.

Packed sequences: a sequence start resets the state, so the map of a start token forgets what
came before: ``A_t = 0`` (the state multiplied by 0; ``jnp.where``, so a non-finite earlier map
cannot leak a NaN). With ``segment_ids`` the maps of the starts after token 0 are
``(0, B_t)``; with ``cu_seqlens`` the start of sequence n is ``(0, A_t h0[n] + B_t)`` (it starts
from its own h0) and ``h_final[n]`` is the prefix state at its last token (``h0[n]`` when it is
empty). Since every product with an exact zero map is an exact zero, no sequence's result depends
on another's tokens, bit for bit.

Under ``GDN2_FWD_DIAG=1`` it reports on ``scan_baseline o`` and ``scan_baseline h_final``
(:mod:`gdn2core.diagnostics`). It is never called with ``T = 0`` (the core answers that call).

It shares no derivation with the chunked WY backends, which makes it an independent check; its
memory grows as ``T * dk * (dk + dv)`` per (batch, head), which makes it slow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from gdn2core.plugin import probe, segment_starts, state_dtype, varlen_layout

# Peak temporary bytes of the jitted value_and_grad in units of one [B, H, T, dk, dk + dv] float32
# buffer: the per-token maps, the scan's sweep partials, the prefix states and their cotangents.
# memory_analysis() on CPU gave 9.2 to 10.8 units for (T, dk, dv) from (128, 64, 8) to
# (256, 16, 128) and (1024, 64, 64);
# tests/scan_baseline/test_memory_model.py checks that this bound holds.
PEAK_BUFFERS_TRAIN = 12


def _compose(earlier, later):
    """(A2, B2) o (A1, B1) for stacked maps; ``earlier`` applies first."""
    A1, B1 = earlier
    A2, B2 = later
    return A2 @ A1, A2 @ B1 + B2  # [..., dk, dk], [..., dk, dv]


def gdn2_associative_scan(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T H dv"],
    w: Float[Array, "B T H dv"],
    b: Float[Array, "B T H dk"],
    g: Float[Array, "B T H dk"],
    h0: Float[Array, "L H dk dv"],
    scale: float,
    segment_ids: Int[Array, "B T"] | None = None,
    cu_seqlens: Int[Array, " N1"] | None = None,
) -> tuple[Float[Array, "B T H dv"], Float[Array, "L H dk dv"]]:
    """The operator as one associative scan (see the module docstring).

    Args:
        q, k, v, w, b, g: the inputs; h0: ``(B, H, dk, dv)``, or ``(N, H, dk, dv)`` with
            ``cu_seqlens``.
        scale: the query scale.
        segment_ids: ``(B, T)`` ids (a sequence starts where the id changes), or None.
        cu_seqlens: ``(N + 1,)`` offsets (B = 1), or None.

    Returns:
        ``(o, h_final)``.
    """
    acc = state_dtype(q.dtype)
    # [B, H, T, d] in the accumulation dtype
    qf, kf, vf, wf, bf, gf = (jnp.swapaxes(x, 1, 2).astype(acc) for x in (q, k, v, w, b, g))
    dk = kf.shape[-1]
    eye = jnp.eye(dk, dtype=acc)  # [dk, dk]
    erase = eye - kf[..., :, None] * (bf * kf)[..., None, :]  # [B, H, T, dk, dk]
    A = erase * jnp.exp(gf)[..., None, :]  # (I - k e^T) diag(exp g)   [B, H, T, dk, dk]
    Bm = kf[..., :, None] * (wf * vf)[..., None, :]  # k z^T          [B, H, T, dk, dv]
    h0 = h0.astype(acc)
    start = None
    if cu_seqlens is not None:  # B = 1: sequence n starts from h0[n]
        seq, start, _ = varlen_layout(cu_seqlens, q.shape[1])  # [T] each
        h0_tok = jnp.swapaxes(h0[seq], 0, 1)[None]  # [1, H, T, dk, dv] h0 of each token's sequence
        Bm = jnp.where(start[:, None, None], A @ h0_tok + Bm, Bm)
        start = start[None]  # [1, T]
    elif segment_ids is not None:
        start = segment_starts(segment_ids).at[:, 0].set(False)  # [B, T]; h0 enters at token 0
    if start is not None:
        A = jnp.where(start[:, None, :, None, None], 0.0, A)  # a start forgets the state
    A_pre, B_pre = jax.lax.associative_scan(_compose, (A, Bm), axis=2)  # prefix maps
    row_h0 = jnp.zeros_like(h0[:1]) if cu_seqlens is not None else h0  # every row starts at 0
    S = A_pre @ row_h0[:, :, None] + B_pre  # [B, H, T, dk, dv]
    o = scale * jnp.einsum("bhtkv,bhtk->bhtv", S, qf)  # [B, H, T, dv]
    o = probe("scan_baseline o", jnp.swapaxes(o, 1, 2).astype(v.dtype))
    if cu_seqlens is None:
        return o, probe("scan_baseline h_final", S[:, :, -1].astype(h0.dtype))
    # h_final[n]: the state at the last token of sequence n; h0[n] when it is empty.
    cu = cu_seqlens.astype(jnp.int32)
    last = jnp.clip(cu[1:] - 1, 0, q.shape[1] - 1)  # [N]
    h_last = jnp.swapaxes(S[0][:, last], 0, 1)  # [N, H, dk, dv]
    empty = (cu[1:] == cu[:-1])[:, None, None, None]
    return o, probe("scan_baseline h_final", jnp.where(empty, h0, h_last).astype(h0.dtype))
