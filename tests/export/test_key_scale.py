"""export/key_scale.py: the attention-weighted moments against their definition, and the scales
against the closed form and as a minimum of the objective."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.export.key_scale import LIMIT, AttentionMoments, weighted_key_scale


def _brute_force_m(q, k, v, mean, scale):
    """M_il = sum_tj p_tj^2 |v_j - o_t|^2 q_ti^2 (k_jl - mean_l)^2 per KV head, loop by loop."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    m = np.zeros((hkv, d, d))
    for bi in range(b):
        for h in range(hq):
            j = h // (hq // hkv)
            for t in range(s):
                a = np.array([q[bi, h, t] @ k[bi, j, x] * scale for x in range(t + 1)])
                p = np.exp(a - a.max())
                p /= p.sum()
                o = p @ v[bi, j, :t + 1]
                for x in range(t + 1):
                    w = p[x] ** 2 * ((v[bi, j, x] - o) ** 2).sum()
                    m[j] += w * np.outer(q[bi, h, t] ** 2, (k[bi, j, x] - mean[j]) ** 2)
    return m


def test_moments_summed_over_windows_give_m_about_any_mean():
    rng = np.random.default_rng(0)
    windows = [(rng.normal(size=(1, 4, 6, 8)), rng.normal(1.0, 2.0, size=(1, 2, 6, 8)), rng.normal(size=(1, 2, 6, 8)))
               for _ in range(2)]
    mean = rng.normal(size=(2, 8))
    am = AttentionMoments()
    for q, k, v in windows:
        am.add(q, k, v, 0.3)
    want = sum(_brute_force_m(q, k, v, mean, 0.3) for q, k, v in windows)
    dm = (mean - am.centre)[:, None, :]
    got = am.m2 - 2.0 * dm * am.m1 + dm * dm * am.m0[:, :, None]
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    assert am.scales(mean).shape == (2, 8) and am.scales(mean).dtype == np.float32


def _objective(s, m):
    u = s.astype(np.float64) ** 2
    return float((u[:, None] / u[None, :] * m).sum())


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.05, 20.0), min_size=16, max_size=16), st.lists(st.floats(0.05, 20.0), min_size=16, max_size=16))
def test_pairs_weighed_alike_give_the_fourth_root_of_the_moment_ratio(a, b):
    """M_il = E[q_i^2] E[k_l^2] (every pair weighed alike): s = (E[k^2] / E[q^2])^(1/4), normalised."""
    q2, k2 = np.array(a), np.array(b)
    s = weighted_key_scale(np.outer(q2, k2))
    want = (k2 / q2) ** 0.25
    np.testing.assert_allclose(s, want / np.exp(np.log(want).mean()), rtol=1e-3)  # the solver's ridge


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_the_scales_minimise_the_objective(seed):
    rng = np.random.default_rng(seed)
    m = rng.uniform(0.5, 2.0, (12, 12)) * np.outer(rng.uniform(0.1, 10.0, 12), rng.uniform(0.1, 10.0, 12))
    s = weighted_key_scale(m)
    assert np.all(s > 1.0 / LIMIT) and np.all(s < LIMIT)  # an interior optimum: these weights keep it within the limits
    assert abs(np.log(s).mean()) < 1e-6
    best = _objective(s, m)
    assert best <= _objective(np.ones(12), m) * (1 + 1e-12)
    for _ in range(20):
        assert best <= _objective(s * np.exp(rng.normal(0, 0.05, 12)), m) * (1 + 1e-9)


def test_a_channel_no_query_reads_takes_the_largest_scale():
    """Its keys, divided by s, then take the least of the stored norm; the others stay alike."""
    m = np.ones((4, 4))
    m[1, :] = 0.0
    s = weighted_key_scale(m)
    assert np.all(np.isfinite(s)) and s[1] > 8 * s[0]
    np.testing.assert_allclose(s[[0, 2, 3]], s[0])
