"""Writes the arith_qa dataset: short arithmetic questions of graded difficulty in verl's
schema, for a real instruct model (`make run-real-model` trains SmolLM2-135M-Instruct on it).

  python programs/make_arith_dataset.py --out_dir=data/arith_qa

Files train.jsonl, train.parquet, test.jsonl, test.parquet (the JSONL and parquet of a split
hold the same rows in the same order); what the rows hold and how the splits are made is in
experiments/workloads/arithmetic_questions.py. Score them with --reward=final_number. The same
flags give byte-identical JSONL. Takes about a second.
"""
from __future__ import annotations

import os
import sys

# Runnable as a script from the repository root without installation.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from experiments.workloads import arithmetic_questions  # noqa: E402
from programs.make_dataset import write  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command-line flags (defined only when run as a script, so importing is free)."""
    flags.DEFINE_string("out_dir", "data/arith_qa", "Folder to write.")
    flags.DEFINE_integer("num_train", 4000, "Train rows (the kinds in turn).")
    flags.DEFINE_integer("num_test", 200, "Test rows at most (up to num_test / kinds per kind).")
    flags.DEFINE_float("test_fraction", 0.25, "Share of each kind's questions held out.")
    flags.DEFINE_list("kinds", list(arithmetic_questions.KINDS), "Question kinds, easiest first.")
    flags.DEFINE_integer("seed", 0, "Seed of the split and the training draws.")


def write_dataset(out_dir: str, **kwargs) -> dict:
    """Writes the four files to out_dir; returns the row counts per split."""
    train, test = arithmetic_questions.make_splits(**kwargs)
    os.makedirs(out_dir, exist_ok=True)
    write(train, out_dir, "train")
    write(test, out_dir, "test")
    return {"train": len(train), "test": len(test)}


def main(argv):
    del argv
    try:
        counts = write_dataset(FLAGS.out_dir, seed=FLAGS.seed, num_train=FLAGS.num_train,
                               num_test=FLAGS.num_test, test_fraction=FLAGS.test_fraction,
                               kinds=tuple(FLAGS.kinds))
    except ValueError as e:
        sys.exit(str(e))
    print(f"wrote {FLAGS.out_dir}: {counts['train']} train, {counts['test']} test rows")


if __name__ == "__main__":
    define_flags()
    app.run(main)
