"""pass@k's unbiased estimator against a slow enumeration, maj@k, and the --n / --k checks
(sao_actor_learner/evaluation.py)."""
import itertools

import pytest

from sao_actor_learner.evaluation import check_k, maj_at_k, majority_correct, pass_at_k


def enumerated_pass_at_k(n, c, k):
    """The share of the k-subsets of n samples (c of them correct) holding a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 10])
def test_pass_at_k_equals_the_enumeration_of_every_k_subset(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(enumerated_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_1_is_the_sample_accuracy_and_pass_at_n_any_correct():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 1, 10) == 1.0 and pass_at_k(10, 0, 10) == 0.0


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, 2, 5), (4, 2, 0), (4, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_majority_vote_ignores_samples_without_an_answer_and_breaks_ties_by_first_seen():
    assert majority_correct(["7", "8", "7"], [1.0, 0.0, 1.0])
    assert not majority_correct(["8", None, None, "7"], [0.0, 0.0, 0.0, 1.0])   # tie: "8" first
    assert majority_correct([None, "7", None], [0.0, 1.0, 0.0])
    assert not majority_correct([None, None], [0.0, 0.0])


def test_maj_at_k_averages_disjoint_blocks_and_maj_at_1_is_the_sample_accuracy():
    answers = ["7", "7", "8", "8", "8", "7"]
    scores = [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert maj_at_k(answers, scores, 1) == pytest.approx(0.5)
    assert maj_at_k(answers, scores, 2) == pytest.approx(1 / 3)   # 7 7 | 8 8 | 8 7 (tie: 8)
    assert maj_at_k(answers, scores, 3) == pytest.approx(0.5)     # 7 7 8 | 8 8 7
    assert maj_at_k(answers, scores, 4) == pytest.approx(1.0)     # one block 7 7 8 8: tie, 7
    with pytest.raises(ValueError, match="k=7 > n=6"):
        maj_at_k(answers, scores, 7)


@pytest.mark.parametrize("n, ks, message", [
    (4, [8], "--k=8 with --n=4"), (4, [0], "--k=0 with --n=4"),
    (0, [1], "--k=1 needs samples"), (-1, [], "--n=-1"),
])
def test_bad_n_and_k_fail_naming_the_flags(n, ks, message):
    with pytest.raises(ValueError, match=message):
        check_k(n, ks)


def test_good_n_and_k_pass():
    check_k(0, [])
    check_k(8, [1, 4, 8])
