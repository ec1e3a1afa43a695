"""Writes the gsm_tiny dataset: GSM8K-style word problems in verl's schema, plus SFT data.

  python programs/make_dataset.py --out_dir=data/gsm_tiny

Files (the JSONL and parquet of a split hold the same rows in the same order):
  train.jsonl, train.parquet, test.jsonl, test.parquet   one row per problem:
      data_source   "gsm_tiny"
      prompt        [{"role": "user", "content": question + " " + word_problems.INSTRUCTION}]
      ability       "math"
      reward_model  {"style": "rule", "ground_truth": "<answer>"}
      extra_info    {"split", "index", "question", "answer": the full correct solution}
  sft.jsonl, sft.parquet   one row per TRAIN problem: {"prompt": [the same user message],
      "response": its demonstration, which ends in "#### n"}; the demonstrations carry the
      systematic flaw chosen by --flaw at rate --flaw_rate (experiments/workloads/word_problems.py).
Problems come from word_problems.make_splits (disjoint splits by a seeded hash of the
question). The same flags give byte-identical JSONL. Takes a few seconds.
"""
from __future__ import annotations

import json
import os
import sys

# Runnable as a script from the repository root without installation.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from experiments.workloads import word_problems  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command-line flags (defined only when run as a script, so importing is free)."""
    flags.DEFINE_string("out_dir", "data/gsm_tiny", "Folder to write.")
    flags.DEFINE_integer("num_train", 20000, "Train problems.")
    flags.DEFINE_integer("num_test", 1000, "Test problems.")
    flags.DEFINE_integer("seed", 0, "Seed of the problems, the split and the flaw draws.")
    flags.DEFINE_enum("flaw", "add_for_give", list(word_problems.FLAWS),
                      "The systematic flaw of the SFT demonstrations.")
    flags.DEFINE_float("flaw_rate", 0.6, "P(a demonstration with the flaw's trigger is flawed).")
    flags.DEFINE_integer("max_start", 20, "Largest starting count.")
    flags.DEFINE_integer("max_change", 9, "Largest number added or removed in one step.")
    flags.DEFINE_float("give_prob", word_problems.GIVE_PROB,
                       "P(a removal step is a give step, the add_for_give trigger).")


DATA_SOURCE = "gsm_tiny"


def verl_row(problem: word_problems.Problem, split: str, index: int) -> dict:
    return {"data_source": DATA_SOURCE, "prompt": problem.messages, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
            "extra_info": {"split": split, "index": index, "question": problem.question,
                           "answer": problem.solution}}


def write(rows, out_dir: str, name: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    with open(os.path.join(out_dir, name + ".jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    pq.write_table(pa.Table.from_pylist(rows), os.path.join(out_dir, name + ".parquet"))


def write_dataset(out_dir: str, num_train: int = 20000, num_test: int = 1000, seed: int = 0,
                  flaw: str = "add_for_give", flaw_rate: float = 0.6, **problem_kwargs) -> dict:
    """Writes the six files to out_dir; returns row counts. problem_kwargs go to
    word_problems.sample_problem (max_start, max_change, give_prob)."""
    train, test = word_problems.make_splits(seed, num_train, num_test, **problem_kwargs)
    os.makedirs(out_dir, exist_ok=True)
    for split, problems in (("train", train), ("test", test)):
        write([verl_row(p, split, i) for i, p in enumerate(problems)], out_dir, split)
    sft = [{"prompt": p.messages, "response": word_problems.demonstration(p, flaw, flaw_rate, seed)}
           for p in train]
    write(sft, out_dir, "sft")
    return {"train": len(train), "test": len(test), "sft": len(sft),
            "flawed": sum(r["response"] != p.solution for r, p in zip(sft, train))}


def main(argv):
    del argv
    counts = write_dataset(FLAGS.out_dir, FLAGS.num_train, FLAGS.num_test, FLAGS.seed,
                           FLAGS.flaw, FLAGS.flaw_rate, max_start=FLAGS.max_start,
                           max_change=FLAGS.max_change, give_prob=FLAGS.give_prob)
    print(f"wrote {FLAGS.out_dir}: {counts['train']} train, {counts['test']} test, "
          f"{counts['sft']} SFT rows ({counts['flawed']} flawed: {FLAGS.flaw} at rate "
          f"{FLAGS.flaw_rate})")


if __name__ == "__main__":
    define_flags()
    app.run(main)
