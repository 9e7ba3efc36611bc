"""bench/routings.py: the bench's routings, random softmax top-k or every expert the same rows."""

import os

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_balanced_loop_gives_each_layer_every_expert_the_same_rows_rotated_by_one_expert(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench import in_loop, routings

    tw, ids = in_loop.stacked_routing(32, 16, 4, layers=3, routing="balanced")
    assert tw.shape == (3, 32, 4) and ids.shape == (3, 32, 4)
    for n in range(3):
        np.testing.assert_array_equal(np.bincount(np.asarray(ids[n]).ravel(), minlength=16), np.full(16, 8))
        np.testing.assert_array_equal(ids[n], (routings.balanced_routing(32, 16, 4)[1] + n) % 16)
    _, ids_random = in_loop.stacked_routing(32, 16, 4, layers=3)
    assert ids_random.shape == (3, 32, 4) and not np.array_equal(ids_random[0], ids_random[1])
    with pytest.raises(ValueError, match="routing must be one of"):
        in_loop.stacked_routing(32, 16, 4, layers=3, routing="uniform")
    with pytest.raises(ValueError, match="routing must be one of"):
        routings.routing_of("uniform", jax.random.key(0), 32, 16, 4)


def test_balanced_routing_gives_every_expert_the_same_rows_and_each_token_distinct_experts(monkeypatch, capsys):
    monkeypatch.syspath_prepend(ROOT)
    from bench import profile_forward
    from bench.moe_bench import MODELS
    from bench.routings import balanced_routing

    m = MODELS["tiny"]  # E=16, k=4
    w, ids = balanced_routing(32, m.e, m.k)
    assert ids.shape == (32, 4) and w.shape == (32, 4)
    np.testing.assert_array_equal(np.bincount(np.asarray(ids).ravel(), minlength=m.e), np.full(m.e, 8))
    for row in np.asarray(ids).tolist():  # distinct experts, E/k = 4 apart
        assert sorted((e - row[0]) % m.e for e in row) == [0, 4, 8, 12]
    np.testing.assert_allclose(np.asarray(w).sum(axis=1), 1.0)
    with pytest.raises(ValueError, match="top_k .4. to divide the experts .6."):
        balanced_routing(8, 6, 4)
    assert profile_forward.main(["--model", "tiny", "--tokens", "8", "--runs", "1", "--routing", "balanced"]) == 0
    assert "T=8 (balanced routing): 1 forwards run" in capsys.readouterr().out
