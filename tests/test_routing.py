"""select_experts: every routing mode against a per-token numpy reference written from its definition."""

import jax
import numpy as np
import pytest

from jax_moe import select_experts
from helpers import np_select_experts, np_sigmoid


def reference(logits, k, scoring="softmax", renormalize=True, groups=None, topk_group=None, bias=None, scale=1.0):
    weights, ids, _ = np_select_experts(logits, k, scoring, renormalize, groups, topk_group, bias, scale)
    return weights, ids


def check(logits, k, **kw):
    w, ids = jax.jit(lambda l: select_experts(l, k, **kw))(logits)
    rw, rids = reference(
        np.asarray(logits, np.float32), k, kw.get("scoring", "softmax"), kw.get("renormalize", True),
        kw.get("num_expert_group"), kw.get("topk_group"),
        None if kw.get("e_score_correction_bias") is None else np.asarray(kw["e_score_correction_bias"], np.float64),
        kw.get("routed_scaling_factor", 1.0),
    )
    assert w.dtype == np.float32 and ids.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(ids), rids)
    np.testing.assert_allclose(np.asarray(w), rw, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (37, 64, 6), (128, 128, 8)])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_plain_topk_matches_reference(rng, t, e, k, scoring, renormalize):
    check(rng.standard_normal((t, e)).astype(np.float32), k, scoring=scoring, renormalize=renormalize)


def test_deepseek_v3_grouped_topk_with_bias_and_scaling(rng):
    logits = rng.standard_normal((50, 256)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(256)).astype(np.float32)
    check(logits, 8, scoring="sigmoid", num_expert_group=8, topk_group=4,
          e_score_correction_bias=bias, routed_scaling_factor=2.5)


def test_grouped_topk_without_bias_scores_groups_by_max(rng):
    check(rng.standard_normal((40, 64)).astype(np.float32), 6, num_expert_group=8, topk_group=3)


def test_bias_changes_choice_but_not_weights(rng):
    logits = rng.standard_normal((20, 16)).astype(np.float32)
    bias = np.zeros(16, np.float32)
    bias[5] = 100.0  # expert 5 always chosen
    w, ids = select_experts(logits, 2, scoring="sigmoid", renormalize=False, e_score_correction_bias=bias)
    assert (np.asarray(ids) == 5).any(axis=1).all()
    sig = np_sigmoid(logits.astype(np.float64))
    np.testing.assert_allclose(np.asarray(w), np.take_along_axis(sig, np.asarray(ids), 1), rtol=1e-6)


def test_llama4_top1_sigmoid_is_sigmoid_of_best_logit(rng):
    logits = rng.standard_normal((33, 16)).astype(np.float32)
    w, ids = select_experts(logits, 1, scoring="sigmoid", renormalize=False)
    np.testing.assert_array_equal(np.asarray(ids)[:, 0], logits.argmax(1))
    np.testing.assert_allclose(np.asarray(w)[:, 0], np_sigmoid(logits.max(1)), rtol=1e-6)


def test_ties_go_to_the_lowest_expert_id():
    logits = np.zeros((3, 8), np.float32)
    logits[:, [2, 5, 6]] = 1.0
    _, ids = select_experts(logits, 2)
    np.testing.assert_array_equal(np.asarray(ids), [[2, 5]] * 3)


def test_bf16_logits_and_top_k_equal_to_e(rng):
    logits = jax.numpy.asarray(rng.standard_normal((9, 4)), jax.numpy.bfloat16)
    w, ids = select_experts(logits, 4)
    np.testing.assert_allclose(np.asarray(w).sum(1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(np.sort(np.asarray(ids), 1), [[0, 1, 2, 3]] * 9)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(top_k=9), "top_k=9 must be <= the number of experts E=8"),
        (dict(top_k=0), "top_k must be a positive int"),
        (dict(top_k=2, scoring="relu"), "scoring must be one of"),
        (dict(top_k=2, num_expert_group=3, topk_group=1), "num_expert_group=3 must divide"),
        (dict(top_k=2, num_expert_group=4), "must be given together"),
        (dict(top_k=2, num_expert_group=4, topk_group=5), "topk_group=5 must be in"),
        (dict(top_k=6, num_expert_group=4, topk_group=2), "top_k=6 must be <= topk_group"),
        (dict(top_k=2, e_score_correction_bias=np.zeros(7, np.float32)), "e_score_correction_bias must have shape \\[8\\]"),
        (dict(top_k=True), "top_k must be an int, got True"),
        (dict(top_k=np.bool_(True)), "top_k must be an int"),
        (dict(top_k=2.0), "top_k must be an int"),
        (dict(top_k="2"), "top_k must be an int"),
        (dict(top_k=np.int64(0)), "top_k must be a positive int"),
        (dict(top_k=2, num_expert_group=True, topk_group=1), "num_expert_group must be an int"),
        (dict(top_k=2, num_expert_group=4, topk_group=1.0), "topk_group must be an int"),
        (dict(top_k=2, routed_scaling_factor=float("nan")), "routed_scaling_factor must be a finite number > 0"),
        (dict(top_k=2, routed_scaling_factor=float("inf")), "routed_scaling_factor must be a finite number > 0"),
        (dict(top_k=2, routed_scaling_factor=-1.0), "routed_scaling_factor must be a finite number > 0"),
        (dict(top_k=2, routed_scaling_factor=0.0), "routed_scaling_factor must be a finite number > 0"),
        (dict(top_k=2, routed_scaling_factor=True), "routed_scaling_factor must be a finite number > 0"),
        (dict(top_k=2, routed_scaling_factor="2"), "routed_scaling_factor must be a finite number > 0"),
    ],
)
def test_bad_routing_arguments_raise_naming_the_argument(kwargs, match):
    logits = np.ones((4, 8), np.float32)
    with pytest.raises(ValueError, match=match):
        select_experts(logits, **kwargs)


def test_bad_logits_raise():
    with pytest.raises(ValueError, match="router_logits must have rank 2"):
        select_experts(np.ones((8,), np.float32), 1)
    with pytest.raises(ValueError, match="router_logits must have dtype"):
        select_experts(np.ones((2, 8), np.int32), 1)


# ------------------------------------------------------------------ numerics and input checks


@pytest.mark.parametrize("top_k", [np.int64(2), np.int32(2), np.uint8(2), 2])
def test_integer_like_top_k_is_accepted(rng, top_k):
    logits = rng.standard_normal((5, 8)).astype(np.float32)
    w, ids = select_experts(logits, top_k)
    w2, ids2 = select_experts(logits, 2)
    assert ids.shape == (5, 2)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids2))
    np.testing.assert_array_equal(np.asarray(w), np.asarray(w2))
    check(logits, 3, num_expert_group=np.int64(4), topk_group=np.int32(2))


def test_numpy_scaling_factor_is_accepted(rng):
    check(rng.standard_normal((5, 8)).astype(np.float32), 2, routed_scaling_factor=np.float32(2.5))


def test_sigmoid_renormalize_is_stable_for_very_negative_logits():
    """Regression: logits of -90 gave [nan, nan] (sigmoid underflows to 0, 0/0); logits near
    -87 gave [1, 0] where the answer is [0.731, 0.269]."""
    w, ids = select_experts(jax.numpy.full((1, 4), -90.0), 2, scoring="sigmoid")
    np.testing.assert_array_equal(np.asarray(w), [[0.5, 0.5]])
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1]])
    w, ids = select_experts(np.array([[-87.0, -88.0, -200.0, -300.0]], np.float32), 2, scoring="sigmoid")
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1]])
    want = 1.0 / (1.0 + np.exp(-1.0))  # s(-87) / (s(-87) + s(-88)) -> e / (e + 1) as both underflow
    np.testing.assert_allclose(np.asarray(w), [[want, 1 - want]], rtol=1e-6)
    # far below float32's range: the log-sigmoids still differ
    w, _ = select_experts(np.array([[-1000.0, -1001.0]], np.float32), 2, scoring="sigmoid")
    np.testing.assert_allclose(np.asarray(w), [[want, 1 - want]], rtol=1e-6)


def test_softmax_renormalize_is_stable_where_the_scores_underflow():
    # softmax over all four: the last three underflow to 0; renormalized over the two chosen, exact
    w, ids = select_experts(np.array([[0.0, -200.0, -201.0, -300.0]], np.float32), 2)
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1]])
    np.testing.assert_array_equal(np.asarray(w), [[1.0, 0.0]])
    w, ids = select_experts(np.array([[-200.0, -201.0, 0.0, 0.0]], np.float32), 2)
    np.testing.assert_array_equal(np.asarray(ids), [[2, 3]])


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_choice_follows_the_logits_where_scores_round_to_the_same_float32(scoring):
    """sigmoid(20) == sigmoid(30) == 1 in float32, and softmax of logits far below the max is 0:
    the order is still the logits' (the true scores' order), not the lowest id."""
    logits = np.array([[20.0, 25.0, 30.0, -200.0]], np.float32)
    _, ids = select_experts(logits, 2, scoring=scoring)
    np.testing.assert_array_equal(np.asarray(ids), [[2, 1]])
    logits = np.array([[0.0, -300.0, -200.0, -250.0]], np.float32)
    _, ids = select_experts(logits, 3, scoring=scoring)
    np.testing.assert_array_equal(np.asarray(ids), [[0, 2, 3]])


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_nonfinite_router_row_stays_in_its_token(rng, scoring, bad):
    logits = rng.standard_normal((6, 8)).astype(np.float32)
    clean_w, clean_ids = select_experts(logits, 2, scoring=scoring)
    logits[3, 5] = bad
    w, ids = select_experts(logits, 2, scoring=scoring)
    ids = np.asarray(ids)
    assert ((ids >= 0) & (ids < 8)).all()
    others = np.arange(6) != 3
    np.testing.assert_array_equal(np.asarray(w)[others], np.asarray(clean_w)[others])
    np.testing.assert_array_equal(ids[others], np.asarray(clean_ids)[others])
