"""Per-channel key scales for Lloyd-Max keys, chosen by the error they leave in each attention's output.

Scores are unchanged when channel i of every query is multiplied by s_i and channel i of every key
divided by it; the bytes per token do not change. The quantizer rotates the stored key x = (k - m) / s
and spreads its error evenly over the channels, with a variance proportional to |x|^2, so the error
of the score of query t on key j has variance proportional to

    sum_i q_ti^2 s_i^2 * sum_l (k_jl - m_l)^2 / s_l^2.

Attention turns a score error d_tj into an output error sum_j p_tj d_tj (v_j - o_t) (first order in
d, p the softmax weights and o the output), whose expected square, with errors independent between
keys, is sum_j p_tj^2 |v_j - o_t|^2 var(d_tj). Summed over the calibration's queries, the error to
minimise over u = s^2 is

    f(u) = sum_il (u_i / u_l) M_il,   M_il = sum_tj p_tj^2 |v_j - o_t|^2 q_ti^2 (k_jl - m_l)^2,

convex in log u. Weighing every (query, key) pair alike instead (M_il = E[q_i^2] E[(k_l - m_l)^2])
gives s = (E[(k - m)^2] / E[q^2])^(1/4); weighing them by what attention reads cut the attention
output's error 39% on SmolLM2's held-out keys (docs/performance.md, Quality).
"""

from __future__ import annotations

import numpy as np

LIMIT = 16.0  # the scales kept within [1/LIMIT, LIMIT] after normalising to a geometric mean of 1 per head


class AttentionMoments:
    """M's parts for one layer, summed over causal prefill windows: with k' = k - c (c the first
    window's mean key, which keeps the sums well conditioned), m2 = sum w q^2 k'^2, m1 = sum w q^2 k'
    and m0 = sum w q^2, per KV head; w_tj = p_tj^2 |v_j - o_t|^2."""

    def __init__(self):
        self.centre = self.m2 = self.m1 = self.m0 = None

    def add(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float | None = None) -> None:
        """q [B, Hq, S, D], k and v [B, Hkv, S, D]: one window, position t attending to 0..t."""
        q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
        hq, s, d = q.shape[1:]
        hkv = k.shape[1]
        group = hq // hkv
        scale = 1.0 / np.sqrt(d) if scale is None else scale
        if self.centre is None:
            self.centre = k.mean(axis=(0, 2))
            self.m2, self.m1, self.m0 = np.zeros((hkv, d, d)), np.zeros((hkv, d, d)), np.zeros((hkv, d))
        kc = k - self.centre[None, :, None, :]
        causal = np.tril(np.ones((s, s), bool))
        vsq = (v * v).sum(-1)
        for h in range(hq):
            j = h // group
            a = np.where(causal, q[:, h] @ k[:, j].transpose(0, 2, 1) * scale, -np.inf)
            p = np.exp(a - a.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            o = p @ v[:, j]
            spread = vsq[:, j, None, :] - 2.0 * o @ v[:, j].transpose(0, 2, 1) + (o * o).sum(-1)[..., None]
            w = p * p * np.maximum(spread, 0.0)
            q2 = (q[:, h] * q[:, h]).reshape(-1, d).T  # the sums over b and t as products
            self.m2[j] += q2 @ (w @ (kc[:, j] * kc[:, j])).reshape(-1, d)
            self.m1[j] += q2 @ (w @ kc[:, j]).reshape(-1, d)
            self.m0[j] += q2 @ w.sum(-1).reshape(-1)

    def scales(self, mean_key: np.ndarray) -> np.ndarray:
        """s [Hkv, D] (float32) for keys stored as (k - mean_key) / s."""
        dm = (np.asarray(mean_key, np.float64) - self.centre)[:, None, :]
        m = self.m2 - 2.0 * dm * self.m1 + dm * dm * self.m0[:, :, None]
        return np.stack([weighted_key_scale(x) for x in np.maximum(m, 0.0)]).astype(np.float32)


def weighted_key_scale(m: np.ndarray, iters: int = 500, tol: float = 1e-9) -> np.ndarray:
    """s = sqrt(u) minimising sum_il (u_i / u_l) m_il for one head, m [D, D] non-negative: Newton
    steps on x = log u with the Hessian's diagonal, which decrease the convex objective; then
    normalised to a geometric mean of 1 and kept within [1/LIMIT, LIMIT]."""
    m = m / max(m.sum(), 1e-300)
    m = m + 1e-6 / m.size  # channels no query reads or no key fills: finite, clipped below
    x = np.zeros(m.shape[0])
    for _ in range(iters):
        e = np.exp(x[:, None] - x[None, :]) * m
        grad = e.sum(1) - e.sum(0)
        hess = e.sum(1) + e.sum(0) - 2.0 * np.diag(e)
        x -= grad / np.maximum(hess, 1e-300)
        x -= x.mean()
        if np.abs(grad).max() < tol:
            break
    s = np.exp(x / 2.0)
    return np.clip(s / np.exp(np.log(s).mean()), 1.0 / LIMIT, LIMIT)
