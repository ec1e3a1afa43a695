"""The critic probe: how much of the reward a critic can explain, and how much ours does.

  python programs/critic_probe.py --workload=dataset      # ~10-15 min on 2 cores, first time
  python programs/critic_probe.py --workload=arithmetic

It samples a fixed rollout set from a warm start once (--train_prompts x --samples train
rollouts and --heldout_prompts x --samples held-out ones, temperature 1, disjoint prompts;
saved to --rollouts_file and reused), then reports the held-out explained variance (EV) of the
Monte-Carlo return over completion tokens, by position segment (first completion token, steps
before the last, the last step, the answer; critic/stats.segment_of_tokens), for:

  (a) ceiling   the best predictor that sees only the prompt: the between-prompt share of the
                reward variance, bias-corrected (critic/stats.between_prompt_share). It bounds
                what any critic can explain at the first completion token; later tokens can
                do better, since they see what was written.
  (b) ridge     a closed-form ridge read-out of the frozen critic features (the warm start's
                last hidden state at each completion token), alpha chosen on a split of the
                train rollouts.
  (c) today     the critic as `make run-dataset` configured it before the fix: a zero head, one
                learning rate (--today_lr), value_pretrain_steps=40 critic-only steps of 32
                fresh rollouts, K=2 (80 optimizer steps over 1,280 rollouts).
  (d) fixed     the fixed recipe: value pretraining as critic/fit.py runs it (epochs of
                minibatches over the train rollouts, held-out EV at a cadence, stop on a
                plateau, best parameters kept), with --fixed_* settings.

The table goes to stdout and the last line is one JSON object with `heldout_ev` for each of
(a)-(d) (keys ceiling, ridge, today, fixed) and the per-segment numbers.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

FLAGS = flags.FLAGS

WORKLOADS = {
    # The dataset workload as `make run-dataset` runs it.
    "dataset": dict(task="dataset", model="checkpoints/warm_start_dataset",
                    train_files=("data/gsm_tiny/train.parquet",),
                    eval_files=("data/gsm_tiny/test.parquet",), reward="gsm8k",
                    max_new_tokens=96, eval_size=10),
    "arithmetic": dict(task="arithmetic", init_checkpoint="checkpoints/warm_start",
                       eval_size=10),
}


def define_flags() -> None:
    flags.DEFINE_enum("workload", "dataset", sorted(WORKLOADS), "Which warm start and task.")
    flags.DEFINE_string("model", "", "Override the workload's warm-start directory.")
    flags.DEFINE_integer("train_prompts", 500, "Train prompts of the rollout set.")
    flags.DEFINE_integer("heldout_prompts", 250, "Held-out prompts of the rollout set.")
    flags.DEFINE_integer("samples", 4, "Rollouts per prompt (temperature 1).")
    flags.DEFINE_string("rollouts_file", "", "Where the rollout set is kept (default: "
                        "runs/critic_probe/<workload>_rollouts.npz); reused when it exists.")
    flags.DEFINE_list("variants", ["ceiling", "ridge", "today", "fixed"], "What to report.")
    flags.DEFINE_float("today_lr", 2e-4, "(c): the critic lr of make run-dataset before the fix.")
    flags.DEFINE_float("fixed_lr", 0.0, "(d): the critic lr (0: the recipe's, "
                       "critic.recipe.PRETRAIN_LR).")
    flags.DEFINE_integer("fixed_epochs", 0, "(d): the most epochs (0: the recipe's).")
    flags.DEFINE_integer("fixed_minibatch", 0, "(d): rollouts per optimizer step (0: the "
                         "recipe's).")
    flags.DEFINE_string("fixed_frozen", "default", "(d): 'default' (attention, embeddings and "
                        "norms frozen: SAO) or 'none' (every parameter trains: a comparison).")
    flags.DEFINE_integer("seed", 0, "Sampling and fitting seed.")
    flags.DEFINE_integer("threads", 2, "torch.set_num_threads.")
    flags.DEFINE_string("out_json", "", "Also write the JSON result here.")


def main(argv) -> None:
    del argv
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from sao_actor_learner.critic import probe

    torch.set_num_threads(FLAGS.threads)
    torch.manual_seed(FLAGS.seed)
    overrides = dict(WORKLOADS[FLAGS.workload])
    if FLAGS.model:
        overrides.pop("init_checkpoint", None)
        overrides["model"] = FLAGS.model
    rollouts_file = FLAGS.rollouts_file or os.path.join(
        "runs", "critic_probe", f"{FLAGS.workload}_rollouts.npz")
    fixed = probe.FixedRecipe.make(lr=FLAGS.fixed_lr, epochs=FLAGS.fixed_epochs,
                                   minibatch=FLAGS.fixed_minibatch,
                                   frozen=FLAGS.fixed_frozen)
    t0 = time.time()
    result = probe.run_probe(overrides, rollouts_file, train_prompts=FLAGS.train_prompts,
                             heldout_prompts=FLAGS.heldout_prompts, samples=FLAGS.samples,
                             variants=FLAGS.variants, today_lr=FLAGS.today_lr, fixed=fixed,
                             seed=FLAGS.seed, log=logging.info)
    result["workload"] = FLAGS.workload
    result["seconds"] = round(time.time() - t0, 1)
    print(probe.format_table(result))
    line = json.dumps(result, sort_keys=True)
    if FLAGS.out_json:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out_json)), exist_ok=True)
        with open(FLAGS.out_json, "w") as f:
            f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    define_flags()
    app.run(main)
