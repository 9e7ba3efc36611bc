"""bench/expert_order.py: a routing relabeled so that its experts' groups come in another order."""

import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def expert_order(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench import expert_order

    return expert_order


def test_the_van_der_corput_places_of_a_power_of_two_are_the_bit_reversed_ranks(expert_order):
    np.testing.assert_array_equal(expert_order.van_der_corput_ranks(8), [0, 4, 2, 6, 1, 5, 3, 7])
    places = expert_order.van_der_corput_ranks(6)  # not a power of two: still a permutation
    assert sorted(places.tolist()) == list(range(6))


def test_each_order_lays_out_the_experts_by_their_rows(expert_order):
    rows = np.array([5, 9, 1, 7, 3, 9, 2, 8])
    by = {o: expert_order.expert_order(rows, o) for o in expert_order.ORDERS}
    np.testing.assert_array_equal(by["expert"], np.arange(8))
    np.testing.assert_array_equal(rows[by["heaviest"]], [9, 9, 8, 7, 5, 3, 2, 1])
    np.testing.assert_array_equal(by["heaviest"][:2], [1, 5])  # ties keep expert order
    np.testing.assert_array_equal(rows[by["lightest"]], [1, 2, 3, 5, 7, 8, 9, 9])
    np.testing.assert_array_equal(rows[by["alternate"]], [9, 1, 9, 2, 8, 3, 7, 5])
    np.testing.assert_array_equal(rows[by["spread"]], [9, 5, 8, 2, 9, 3, 7, 1])  # rank r at place bitrev(r)
    for order in by.values():
        assert sorted(order.tolist()) == list(range(8))
    with pytest.raises(ValueError, match="order must be one of"):
        expert_order.expert_order(rows, "random")


def test_a_relabeled_routing_keeps_each_token_s_experts_and_gives_the_groups_the_order_s_rows(expert_order):
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(16, size=4, replace=False) for _ in range(64)]).astype(np.int32)
    rows = np.bincount(ids.ravel(), minlength=16)
    for order in expert_order.ORDERS:
        new = expert_order.relabeled(ids, 16, order)
        assert new.dtype == ids.dtype and new.shape == ids.shape
        np.testing.assert_array_equal(np.bincount(new.ravel(), minlength=16), rows[expert_order.expert_order(rows, order)])
        for before, after in zip(ids, new):  # a token keeps distinct experts, one-to-one with its old ones
            assert len(set(after.tolist())) == 4
        mapping = {}
        for a, b in zip(ids.ravel().tolist(), new.ravel().tolist()):
            assert mapping.setdefault(a, b) == b


def test_without_a_gpu_the_bench_says_it_needs_one(expert_order, capsys):
    import jax

    if jax.devices()[0].platform == "gpu":
        pytest.skip("runs on a GPU")
    assert expert_order.main(["--models", "tiny", "--tokens", "16"]) == 0
    assert "needs a GPU" in capsys.readouterr().out
