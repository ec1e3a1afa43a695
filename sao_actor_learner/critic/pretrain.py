"""A value-pretrained critic, built once before RL like the policy's warm start.

`pretrain_critic(config, out_dir, ...)` samples `prompts` x `samples` rollouts of the warm start
(config.model) on the task's training prompts at temperature 1, holds out a fifth of them
(whole prompts), fits a critic made as the learner makes it (builder.make_critic: the policy's
body, attention, embeddings and norms frozen, a zero head) with critic/fit.py, and writes a
critic directory that `--critic_model` loads:

  config.json, model.safetensors, value_head.safetensors   the critic (ValueModel.save)
  tokenizer files                                          the policy's, so preflight can check
                                                           that critic and policy match
  heldout_rollouts.npz                                     the held-out rollouts: the learner's
                                                           yardstick (critic_eval_every)
  critic_pretrain.json                                     the settings, the fit's curve, the
                                                           held-out EV and what it cost

programs/pretrain_critic.py is the entry point (`make critic-dataset`).
No reverb, tensorflow or grpc here.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Callable, Dict

import torch

from sao_actor_learner.critic import fit as fit_lib
from sao_actor_learner.critic.rollout_set import sample_rollouts, save_rollouts
from sao_actor_learner.learner.value_pretraining import HELDOUT_ROLLOUTS_FILE

REPORT_FILE = "critic_pretrain.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "char_tokenizer.json",
                   "generation_config.json")


def pretrain_critic(config, out_dir: str, prompts: int, samples: int,
                    settings: fit_lib.FitSettings, lr: float, heldout: float = 0.2,
                    log: Callable[[str], None] = print) -> Dict:
    """Builds the critic directory `out_dir` (module docstring); returns the report."""
    from sao_actor_learner.builder import make_critic, make_engine, make_task, sampling_params
    from sao_actor_learner.config.learner import LearnerConfig
    from sao_actor_learner.critic.probe import distinct_prompts
    from sao_actor_learner.learner.estimators import CriticGAE

    from sao_actor_learner.run_dirs import (check_clearable, make_owned_dir, mark_owned,
                                            remove_if_ours)
    check_clearable(out_dir, "--out_dir")    # before the work: only a folder we made is replaced
    t0 = time.time()
    engine = make_engine(config, "actor_0")
    task = make_task(config, tokenizer=engine.tokenizer)
    try:
        chosen = distinct_prompts(task, prompts, config.seed)
        params = dataclasses.replace(
            sampling_params(config, stop_ids=engine.tokenizer.stop_ids), temperature=1.0,
            top_p=1.0, seed=config.seed)
        rollouts = sample_rollouts(engine, task, chosen, params, samples=samples, batch=64,
                                   max_turns=config.max_turns,
                                   max_total_tokens=config.max_sequence_length, log=log)
    finally:
        task.close()
    sample_s = time.time() - t0
    train, held = fit_lib.split_heldout(rollouts, heldout, config.seed)
    torch.manual_seed(config.seed)
    fit_config = config.replace(critic_lr=lr, critic_model="")
    estimator = CriticGAE(make_critic(fit_config, engine.model),
                          fit_config.section(LearnerConfig))
    result = fit_lib.fit(estimator, train, held, settings, engine.tokenizer.pad_id,
                         log=lambda row: log(f"critic fit: {row}"))
    tmp = f"{out_dir.rstrip('/')}.tmp-{os.getpid()}"
    remove_if_ours(tmp, "the critic being written")
    estimator.critic.save(make_owned_dir(tmp))
    for name in TOKENIZER_FILES:
        src = os.path.join(config.model, name)
        if os.path.exists(src) and not os.path.exists(os.path.join(tmp, name)):
            shutil.copy(src, os.path.join(tmp, name))
    save_rollouts(os.path.join(tmp, HELDOUT_ROLLOUTS_FILE), held, model=config.model)
    rewards = [r.total_reward for r in rollouts]
    report = {
        "policy_model": config.model, "task": config.task, "prompts": prompts,
        "samples": samples, "rollouts": len(rollouts), "train_rollouts": len(train),
        "heldout_rollouts": len(held), "mean_reward": sum(rewards) / len(rewards),
        "lr": lr, "settings": dataclasses.asdict(settings),
        "critic_frozen_patterns": list(config.critic_frozen_patterns),
        "heldout_ev": result.best["heldout_ev"], "fit": result.summary(),
        "curve": result.curve, "sample_s": round(sample_s, 1),
        "fit_s": round(result.seconds, 1), "total_s": round(time.time() - t0, 1),
        "threads": torch.get_num_threads(),
    }
    with open(os.path.join(tmp, REPORT_FILE), "w") as f:
        json.dump(report, f, indent=1)
    mark_owned(tmp)    # a later pretraining may replace it; nothing else is replaced
    check_clearable(out_dir, "--out_dir")   # again: minutes passed since the first check
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return report
