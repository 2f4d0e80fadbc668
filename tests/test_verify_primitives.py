"""accept_prefix, GDN tape record/replay and rollback against the NumPy reference, with hypothesis."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dflash_native as dn
from dflash_native import _core
from reference.gdn_ref import accept_prefix as ref_accept, conv_state_after, gdn_replay_closed_form, gdn_run


@given(st.integers(1, 17).flatmap(lambda b: st.tuples(
    st.lists(st.integers(0, 3), min_size=b - 1, max_size=b - 1), st.lists(st.integers(0, 3), min_size=b, max_size=b))))
def test_accept_prefix_matches_reference(dt):
    draft, target = dt
    got = dn.accept_prefix(draft, target)
    assert got == ref_accept(draft, target)
    assert 1 <= len(got) <= len(draft) + 1
    assert got[:-1] == draft[: len(got) - 1]


def test_accept_prefix_edges():
    assert dn.accept_prefix([], [7]) == [7]
    assert dn.accept_prefix([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert dn.accept_prefix([1, 2, 3], [9, 2, 3, 4]) == [9]
    with pytest.raises(ValueError, match="one more token"):
        dn.accept_prefix([1, 2], [1, 2])


def random_gdn(rng, T, H_k, H_v, d):
    def l2(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = l2(rng.standard_normal((T, H_k, d))).astype(np.float32)
    k = l2(rng.standard_normal((T, H_k, d))).astype(np.float32)
    v = rng.standard_normal((T, H_v, d)).astype(np.float32)
    g = -rng.uniform(0.01, 2.0, (T, H_v)).astype(np.float32)  # log decay < 0
    beta = rng.uniform(0.0, 1.0, (T, H_v)).astype(np.float32)
    S0 = (0.3 * rng.standard_normal((H_v, d, d))).astype(np.float32)
    return q, k, v, g, beta, S0


gdn_shapes = st.tuples(st.integers(1, 17), st.sampled_from([(1, 1), (1, 2), (2, 2), (2, 4), (3, 3)]),
                       st.sampled_from([1, 3, 8, 15, 16, 17, 33]), st.integers(0, 2**31 - 1))


@given(gdn_shapes)
def test_gdn_tape_record_matches_reference(shape):
    T, (H_k, H_v), d, seed = shape
    q, k, v, g, beta, S0 = random_gdn(np.random.default_rng(seed), T, H_k, H_v, d)
    o, tk, tu, tg = _core.gdn_tape_record(q, k, v, g, beta, np.ascontiguousarray(S0.transpose(0, 2, 1)))
    o_ref, _, u_ref = gdn_run(q, k, v, g, beta, S0)
    np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(tu, u_ref, atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(tg, g)
    np.testing.assert_array_equal(tk, k[:, np.arange(H_v) % H_k])


@given(gdn_shapes, st.data())
def test_gdn_tape_replay_equals_state_after_n_tokens(shape, data):
    """Replaying n accepted tokens from S_0 gives the state after feeding just those n tokens."""
    T, (H_k, H_v), d, seed = shape
    n = data.draw(st.integers(0, T))
    q, k, v, g, beta, S0 = random_gdn(np.random.default_rng(seed), T, H_k, H_v, d)
    S0t = np.ascontiguousarray(S0.transpose(0, 2, 1))
    _, tk, tu, tg = _core.gdn_tape_record(q, k, v, g, beta, S0t)
    got = _core.gdn_tape_replay(S0t, tk, tu, tg, n, n_threads=2).transpose(0, 2, 1)
    _, states, _ = gdn_run(q, k, v, g, beta, S0)
    np.testing.assert_allclose(got, states[n], atol=2e-5, rtol=1e-4)
    # the closed form of docs/architecture.md ("GDN tape") on the same tape agrees too
    np.testing.assert_allclose(gdn_replay_closed_form(S0, tk, tu, tg, n), states[n], atol=2e-5, rtol=1e-4)
    # recording only the first n tokens gives the same tape prefix, bitwise (no look-ahead)
    if n:
        _, _, tu_n, _ = _core.gdn_tape_record(q[:n], k[:n], v[:n], g[:n], beta[:n], S0t)
        np.testing.assert_array_equal(tu_n, tu[:n])


@given(st.integers(2, 6), st.integers(1, 9), st.integers(1, 20), st.integers(0, 2**31 - 1), st.data())
def test_conv_state_reference_is_a_sliding_window(d_conv, n_ch, T, seed, data):
    n_keep = data.draw(st.integers(1, T))
    rng = np.random.default_rng(seed)
    conv0 = rng.standard_normal((n_ch, d_conv - 1))
    x = rng.standard_normal((T, n_ch))
    got = conv_state_after(conv0, x, n_keep)
    stream = np.concatenate([conv0, x[:n_keep].T], axis=1)
    for j in range(d_conv - 1):
        np.testing.assert_array_equal(got[:, j], stream[:, stream.shape[1] - (d_conv - 1) + j])


def test_gdn_tape_bad_input():
    with pytest.raises(ValueError, match="inconsistent shapes"):
        _core.gdn_tape_record(np.zeros((2, 1, 4)), np.zeros((2, 1, 4)), np.zeros((2, 3, 4)), np.zeros((2, 3)),
                              np.zeros((2, 3)), np.zeros((2, 4, 4)))  # state0 has 2 heads, v has 3
    with pytest.raises(ValueError, match="outside"):
        z = np.zeros((2, 1, 4), np.float32)
        _core.gdn_tape_replay(np.zeros((1, 4, 4)), z, z, np.zeros((2, 1)), 3)


def test_gdn_tape_object():
    rng = np.random.default_rng(3)
    q, k, v, g, beta, S0 = random_gdn(rng, 9, 2, 4, 16)
    tape = dn.GdnTape()
    o = tape.record(q, k, v, g, beta, S0)
    o_ref, states, _ = gdn_run(q, k, v, g, beta, S0)
    np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=1e-4)
    assert tape.n_tokens == 9 and tape.nbytes == 9 * 4 * (16 + 16 + 1) * 4
    for n in (0, 4, 9):
        np.testing.assert_allclose(tape.replay(n), states[n], atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="outside"):
        tape.replay(10)
