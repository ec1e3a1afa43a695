"""The arith_qa dataset (experiments/workloads/arithmetic_questions.py and
programs/make_arith_dataset.py): disjoint seeded splits, a balanced test order, correct ground
truths, verl's schema read by the dataset task."""
import os
import subprocess
import sys

import pytest

from experiments.workloads import arithmetic_questions as aq
from sao_actor_learner.tasks.dataset_files import read_dataset

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _key(row):
    e = row["extra_info"]
    return e["kind"], e["a"], e["b"]


def test_splits_are_disjoint_balanced_and_answered_correctly():
    train, test = aq.make_splits(seed=0, num_train=2000, num_test=40)
    assert len(train) == 2000 and len(test) == 40
    assert not {_key(r) for r in train} & {_key(r) for r in test}
    assert [r["extra_info"]["kind"] for r in test[:8]] == list(aq.KINDS) * 2
    assert [sum(r["extra_info"]["kind"] == k for r in train) for k in aq.KINDS] == [500] * 4
    for row in train + test:
        e = row["extra_info"]
        expected = {"+": e["a"] + e["b"], "-": e["a"] - e["b"], "*": e["a"] * e["b"]}[e["op"]]
        assert row["reward_model"]["ground_truth"] == str(expected) and expected >= 0
        assert row["prompt"][0]["content"] == f"What is {e['a']} {e['op']} {e['b']}? " \
                                              f"{aq.INSTRUCTION}"
        assert row["data_source"] == f"arith_qa/{e['kind']}"


def test_small_kinds_give_the_test_split_what_they_hold_out():
    _, test = aq.make_splits(seed=0, num_train=10, num_test=400)
    counts = {k: sum(r["extra_info"]["kind"] == k for r in test) for k in aq.KINDS}
    assert counts["add2"] == counts["sub2"] == 100
    assert 0 < counts["mul1"] < 64 * 0.5 and 0 < counts["add1"] < 81 * 0.5


def test_seeds_change_the_split_and_bad_arguments_are_refused():
    assert aq.make_splits(seed=0)[1] == aq.make_splits(seed=0)[1]
    assert aq.make_splits(seed=0)[1] != aq.make_splits(seed=1)[1]
    with pytest.raises(ValueError, match="kinds"):
        aq.make_splits(kinds=("add1", "div3"))
    with pytest.raises(ValueError, match="test_fraction"):
        aq.make_splits(test_fraction=1.0)


def test_the_program_writes_the_same_files_for_the_same_flags_in_verls_schema(tmp_path):
    outs = []
    for name in ("a", "b"):
        out = str(tmp_path / name)
        subprocess.run([sys.executable, os.path.join(REPO, "programs", "make_arith_dataset.py"),
                        f"--out_dir={out}", "--num_train=40", "--num_test=12"], check=True,
                       capture_output=True)
        outs.append(out)
    for split in ("train", "test"):
        with open(os.path.join(outs[0], f"{split}.jsonl"), "rb") as f1, \
                open(os.path.join(outs[1], f"{split}.jsonl"), "rb") as f2:
            assert f1.read() == f2.read()
    jsonl = read_dataset([os.path.join(outs[0], "test.jsonl")])
    parquet = read_dataset([os.path.join(outs[0], "test.parquet")])
    assert len(jsonl) == 12 and [r.ground_truth for r in jsonl] == [r.ground_truth for r in parquet]
