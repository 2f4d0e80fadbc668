"""NumPy reference of the Gated DeltaNet recurrence, its conv state and accept_prefix.

Float64 throughout, written from the math in docs/architecture.md ("GDN tape"), independent of the C++ code.
State S is [H_v, d_k, d_v] here (the C++ and ggml keep S^T per head).
"""

from __future__ import annotations

import numpy as np


def gdn_run(q, k, v, g, beta, S0):
    """q, k: [T, H_k, d]; v: [T, H_v, d]; g, beta: [T, H_v]; S0: [H_v, d_k, d_v].

    Returns (o [T, H_v, d], states [T+1, H_v, d_k, d_v], u [T, H_v, d]) with states[t] the
    state after t tokens. Value head h reads key head h % H_k (tiled broadcast)."""
    T, H_v, d = v.shape
    H_k = q.shape[1]
    S = S0.astype(np.float64).copy()
    o = np.zeros((T, H_v, d))
    u = np.zeros((T, H_v, d))
    states = [S.copy()]
    for t in range(T):
        for h in range(H_v):
            kk = k[t, h % H_k].astype(np.float64)
            qq = q[t, h % H_k].astype(np.float64)
            S[h] *= np.exp(g[t, h])
            u[t, h] = beta[t, h] * (v[t, h] - S[h].T @ kk)
            S[h] += np.outer(kk, u[t, h])
            o[t, h] = S[h].T @ qq / np.sqrt(d)
        states.append(S.copy())
    return o, np.stack(states), u


def gdn_replay_closed_form(S0, tape_k, tape_u, tape_g, n):
    """S_n = exp(G_n) S_0 + sum_t exp(G_n - G_t) k_t u_t^T, G_t = g_1 + .. + g_t."""
    S0 = S0.astype(np.float64)
    if n == 0:
        return S0.copy()
    G = np.cumsum(tape_g[:n].astype(np.float64), axis=0)  # [n, H_v]
    out = np.exp(G[-1])[:, None, None] * S0
    w = np.exp(G[-1][None, :] - G)  # [n, H_v]
    out += np.einsum("th,thi,thj->hij", w, tape_k[:n].astype(np.float64), tape_u[:n].astype(np.float64))
    return out


def conv_state_after(conv0, inputs, n_keep):
    """conv0: [channels, d_conv-1] oldest first; inputs: [T, channels]. Last d_conv-1 of the stream."""
    seq = np.concatenate([conv0, inputs[:n_keep].T], axis=1)
    return seq[:, seq.shape[1] - conv0.shape[1]:]


def accept_prefix(draft, target):
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return list(draft[:n]) + [target[n]]
