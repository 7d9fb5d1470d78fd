"""Plain NumPy loops, written independently of the rest of gdn2core: the matrix form of the
operator and the two recurrences it reduces to, as independent checks of the reference and of
every backend (``docs/operator.md``, section Reductions)."""

from __future__ import annotations

import numpy as np


def gdn2_numpy_loop(q, k, v, w, b, g, scale, h0=None):
    """The matrix form of the operator, token by token, in float64:
    ``S_t = (I - k_t (b_t * k_t)^T) diag(exp g_t) S_{t-1} + k_t (w_t * v_t)^T``."""
    q, k, v, w, b, g = (np.asarray(x, np.float64) for x in (q, k, v, w, b, g))
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    o = np.zeros((B, T, H, dv))
    S_all = np.zeros((B, H, dk, dv)) if h0 is None else np.array(h0, np.float64)
    eye = np.eye(dk)
    for bi in range(B):
        for hi in range(H):
            S = S_all[bi, hi]
            for t in range(T):
                kt, qt = k[bi, t, hi], q[bi, t, hi]
                transition = (eye - np.outer(kt, b[bi, t, hi] * kt)) @ np.diag(np.exp(g[bi, t, hi]))
                S = transition @ S + np.outer(kt, w[bi, t, hi] * v[bi, t, hi])
                o[bi, t, hi] = scale * S.T @ qt
            S_all[bi, hi] = S
    return o, S_all


def kda_numpy_loop(q, k, v, g, beta, scale, h0):
    """Kimi Delta Attention: ``S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_{t-1} + beta_t k_t v_t^T``
    with one scalar beta per token and head (``beta``: (B, T, H))."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    B, T, H, _ = q.shape
    o = np.zeros(v.shape)
    S_all = np.array(h0, np.float64)
    for bi in range(B):
        for hi in range(H):
            S = S_all[bi, hi]
            for t in range(T):
                kt, bt = k[bi, t, hi], beta[bi, t, hi]
                S = np.exp(g[bi, t, hi])[:, None] * S
                S = S - bt * np.outer(kt, kt @ S) + bt * np.outer(kt, v[bi, t, hi])
                o[bi, t, hi] = scale * S.T @ q[bi, t, hi]
            S_all[bi, hi] = S
    return o, S_all


def gated_deltanet_numpy_loop(q, k, v, a, beta, scale, h0):
    """Gated DeltaNet in its own transposed convention, ``H_t in R^{dv x dk}``:
    ``H_t = exp(a_t) H_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T``, ``o_t = scale H_t q_t``.
    ``a``, ``beta``: (B, T, H). Returns the state transposed back to (B, H, dk, dv)."""
    q, k, v, a, beta = (np.asarray(x, np.float64) for x in (q, k, v, a, beta))
    B, T, Hn, dk = q.shape
    o = np.zeros(v.shape)
    out = np.zeros((B, Hn, dk, v.shape[-1]))
    eye = np.eye(dk)
    for bi in range(B):
        for hi in range(Hn):
            Hs = np.array(h0[bi, hi], np.float64).T
            for t in range(T):
                kt, bt = k[bi, t, hi], beta[bi, t, hi]
                Hs = np.exp(a[bi, t, hi]) * Hs @ (eye - bt * np.outer(kt, kt))
                Hs = Hs + bt * np.outer(v[bi, t, hi], kt)
                o[bi, t, hi] = scale * Hs @ q[bi, t, hi]
            out[bi, hi] = Hs.T
    return o, out
