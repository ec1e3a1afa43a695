"""The critic probe's measurements (programs/critic_probe.py is the entry point; its docstring
says what (a)-(d) are). No reverb, tensorflow or grpc here.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from sao_actor_learner.critic import fit as fit_lib
from sao_actor_learner.critic import stats
from sao_actor_learner.critic.rollout_set import load_rollouts, sample_rollouts, save_rollouts
from sao_actor_learner.types import Rollout, collate

RIDGE_ALPHAS = (1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0)
# make run-dataset's critic before the fix: 40 critic-only steps of 32 rollouts, K=2.
TODAY_STEPS, TODAY_BATCH = 40, 32


@dataclasses.dataclass(frozen=True)
class FixedRecipe:
    """(d)'s settings; zeros take the learner config's value-pretraining defaults."""
    lr: float
    settings: fit_lib.FitSettings
    frozen: str = "default"

    @classmethod
    def make(cls, lr: float = 0.0, epochs: int = 0, minibatch: int = 0,
             frozen: str = "default") -> "FixedRecipe":
        from sao_actor_learner.config import SAOConfig
        d = SAOConfig()
        settings = fit_lib.FitSettings(
            max_epochs=epochs or d.value_pretrain_epochs,
            minibatch_size=minibatch or d.value_pretrain_minibatch,
            patience=d.value_pretrain_patience, eval_every=0)
        if frozen not in ("default", "none"):
            raise ValueError(f"frozen={frozen!r}: 'default' or 'none'")
        return cls(lr=lr or d.value_pretrain_lr, settings=settings, frozen=frozen)


def rollout_set(config, engine, task, path: str, train_prompts: int, heldout_prompts: int,
                samples: int, seed: int, log: Callable[[str], None]
                ) -> Tuple[List[Rollout], List[Rollout]]:
    """(train, held-out) rollouts: read from `path` when it holds a set made with the same
    model and sizes, else sampled (temperature 1) and saved there."""
    want = {"model": os.path.abspath(config.model), "train_prompts": train_prompts,
            "heldout_prompts": heldout_prompts, "samples": samples, "seed": seed,
            "max_new_tokens": config.max_new_tokens}
    if os.path.exists(path):
        rollouts, meta = load_rollouts(path)
        if all(meta.get(k) == v for k, v in want.items()):
            n = train_prompts * samples
            log(f"rollout set: {path} ({len(rollouts)} rollouts)")
            return rollouts[:n], rollouts[n:]
        log(f"rollout set {path} was made with other settings ({meta}): sampling anew")
    prompts = distinct_prompts(task, train_prompts + heldout_prompts, seed)
    from sao_actor_learner.builder import sampling_params
    params = dataclasses.replace(sampling_params(config, stop_ids=engine.tokenizer.stop_ids),
                                 temperature=1.0, top_p=1.0, seed=seed)
    rollouts = sample_rollouts(engine, task, prompts, params, samples=samples, batch=64,
                               max_turns=config.max_turns,
                               max_total_tokens=config.max_sequence_length, log=log)
    save_rollouts(path, rollouts, **want)
    n = train_prompts * samples
    return rollouts[:n], rollouts[n:]


def distinct_prompts(task, count: int, seed: int) -> list:
    """`count` training prompts with distinct token ids: the dataset task's stream in order, or
    a seeded draw from a generated task."""
    rng = np.random.default_rng(seed)
    seen, out, k = set(), [], 0
    while len(out) < count:
        p = task.prompt_at(k) if hasattr(task, "prompt_at") else task.sample_prompt(rng)
        k += 1
        key = tuple(p.token_ids)
        if key not in seen:
            seen.add(key)
            out.append(p)
        if k > 50 * count:
            raise ValueError(f"the task has fewer than {count} distinct prompts")
    return out


def token_segments(rollouts: Sequence[Rollout], tokenizer) -> np.ndarray:
    """The segment index (stats.SEGMENTS) of every action token, rollout by rollout."""
    out = []
    for r in rollouts:
        ids = r.tokens[r.action_mask.astype(bool)]
        out.append(stats.segment_of_tokens([tokenizer.decode([int(t)], skip_special=True)
                                            for t in ids]))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def values_and_returns(estimator, rollouts: Sequence[Rollout], pad_id: int,
                       chunk: int = 64) -> Tuple[np.ndarray, np.ndarray]:
    """(values, returns) of every action token, rollout by rollout (the estimator's targets)."""
    vs, rs = [], []
    estimator.critic.eval()
    for i in range(0, len(rollouts), chunk):
        batch = collate(rollouts[i:i + chunk], pad_id)
        est = estimator.estimate(batch)
        m = batch.action_mask.bool()
        for row in range(batch.size):
            vs.append(est.values[row][m[row]].numpy())
            rs.append(est.returns[row][m[row]].numpy())
    return np.concatenate(vs), np.concatenate(rs)


@torch.no_grad()
def frozen_features(body: torch.nn.Module, rollouts: Sequence[Rollout], pad_id: int,
                    chunk: int = 64) -> np.ndarray:
    """The body's last hidden state at the position that predicts each action token (t - 1),
    rollout by rollout: [action tokens, hidden]."""
    out = []
    body.eval()
    for i in range(0, len(rollouts), chunk):
        batch = collate(rollouts[i:i + chunk], pad_id)
        hidden = body(input_ids=batch.tokens,
                      attention_mask=batch.attention_mask).last_hidden_state.float()
        for row in range(batch.size):
            pos = torch.nonzero(batch.action_mask[row]).flatten() - 1
            out.append(hidden[row, pos].numpy())
    return np.concatenate(out)


def ridge_ev(body, train, held, held_segments, pad_id: int, log) -> Dict[str, float]:
    """(b): ridge on frozen features, alpha chosen on the last fifth of the train prompts."""
    x_tr = frozen_features(body, train, pad_id)
    y_tr = np.concatenate([np.full(r.num_action_tokens, r.total_reward) for r in train])
    x_te = frozen_features(body, held, pad_id)
    y_te = np.concatenate([np.full(r.num_action_tokens, r.total_reward) for r in held])
    cut_rollout = int(0.8 * len(train))
    cut = sum(r.num_action_tokens for r in train[:cut_rollout])
    scores = {a: stats.explained_variance(stats.ridge_probe(x_tr[:cut], y_tr[:cut],
                                                            x_tr[cut:], a), y_tr[cut:])
              for a in RIDGE_ALPHAS}
    alpha = max(scores, key=scores.get)
    log(f"ridge: validation EV by alpha {scores}; alpha {alpha}")
    pred = stats.ridge_probe(x_tr, y_tr, x_te, alpha)
    out = stats.explained_variance_by_segment(pred, y_te, held_segments)
    out["alpha"] = alpha
    return out


def ceiling(held: Sequence[Rollout], samples: int) -> Dict[str, float]:
    """(a): the between-prompt share of the held-out rewards ([prompts, samples])."""
    rewards = np.array([r.total_reward for r in held]).reshape(-1, samples)
    return stats.between_prompt_share(rewards)


def make_estimator(config, policy, lr: float, frozen: str = "default", **learner):
    """A CriticGAE as the learner builds it (builder.make_critic) with critic_lr `lr`."""
    from sao_actor_learner.builder import make_critic
    from sao_actor_learner.config.learner import LearnerConfig
    from sao_actor_learner.learner.estimators import CriticGAE
    config = config.replace(critic_lr=lr, critic_model="", **learner,
                            **({"critic_frozen_patterns": ()} if frozen == "none" else {}))
    critic = make_critic(config, policy)
    return CriticGAE(critic, config.section(LearnerConfig))


def today_critic(config, policy, train, pad_id: int, lr: float):
    """(c): 40 critic-only steps of 32 fresh train rollouts (fewer: the set again), K=2, one
    lr, zero head."""
    estimator = make_estimator(config, policy, lr, critic_updates=2, critic_minibatches=1)
    for s in range(TODAY_STEPS):   # a set smaller than 1,280 rollouts is gone through again
        rows = [train[(s * TODAY_BATCH + i) % len(train)] for i in range(TODAY_BATCH)]
        batch = collate(rows, pad_id)
        estimator.update(batch, estimator.estimate(batch))
    return estimator


def fixed_critic(config, policy, train, pad_id: int, recipe: FixedRecipe, seed: int, log):
    """(d): critic/fit.py on the train rollouts (a fifth of them held out for its stopping
    rule; the probe's held-out set is never seen)."""
    estimator = make_estimator(config, policy, recipe.lr, recipe.frozen)
    fit_train, fit_held = fit_lib.split_heldout(train, 0.2, seed)
    result = fit_lib.fit(estimator, fit_train, fit_held,
                         dataclasses.replace(recipe.settings, seed=seed), pad_id,
                         log=lambda row: log(f"fixed: {row}"))
    return estimator, result


def run_probe(overrides: dict, rollouts_file: str, *, train_prompts: int, heldout_prompts: int,
              samples: int, variants: Sequence[str], today_lr: float, fixed: FixedRecipe,
              seed: int = 0, log: Callable[[str], None] = print) -> dict:
    """The probe (programs/critic_probe.py): returns the result dict its JSON line holds."""
    from sao_actor_learner.builder import make_engine, make_task
    from sao_actor_learner.config import SAOConfig

    unknown = set(variants) - {"ceiling", "ridge", "today", "fixed"}
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}: ceiling, ridge, today, fixed")
    config = SAOConfig(**overrides, seed=seed)
    engine = make_engine(config, "actor_0")
    tokenizer = engine.tokenizer
    task = make_task(config, tokenizer=tokenizer)
    try:
        train, held = rollout_set(config, engine, task, rollouts_file, train_prompts,
                                  heldout_prompts, samples, seed, log)
    finally:
        task.close()
    policy = engine.model
    pad_id = tokenizer.pad_id
    segments = token_segments(held, tokenizer)
    rewards = np.array([r.total_reward for r in train + held])
    result = {"rollouts": {"train": len(train), "heldout": len(held),
                           "mean_reward": float(rewards.mean()),
                           "segment_tokens": {name: int((segments == i).sum())
                                              for i, name in enumerate(stats.SEGMENTS)}},
              "heldout_ev": {}, "by_segment": {}}
    if "ceiling" in variants:
        c = ceiling(held, samples)
        result["ceiling"] = c
        result["heldout_ev"]["ceiling"] = c["share"]
    if "ridge" in variants:
        est = make_estimator(config, policy, 1e-4)
        r = ridge_ev(est.critic.body, train, held, segments, pad_id, log)
        result["by_segment"]["ridge"] = r
        result["heldout_ev"]["ridge"] = r["all"]
    for name in ("today", "fixed"):
        if name not in variants:
            continue
        torch.manual_seed(seed)
        if name == "today":
            estimator = today_critic(config, policy, train, pad_id, today_lr)
        else:
            estimator, fit_result = fixed_critic(config, policy, train, pad_id, fixed, seed, log)
            result["fixed_fit"] = {**fit_result.summary(), "lr": fixed.lr,
                                   "frozen": fixed.frozen,
                                   **dataclasses.asdict(fixed.settings)}
            result["fixed_curve"] = fit_result.curve
        v, ret = values_and_returns(estimator, held, pad_id)
        seg = stats.explained_variance_by_segment(v, ret, segments)
        result["by_segment"][name] = seg
        result["heldout_ev"][name] = seg["all"]
        log(f"{name}: held-out EV {seg}")
    return result


def format_table(result: dict) -> str:
    """The probe's table: one row per variant, one column per segment."""
    cols = ("all",) + stats.SEGMENTS
    lines = [f"held-out explained variance of the return, {result['rollouts']['heldout']} "
             f"held-out rollouts (mean reward {result['rollouts']['mean_reward']:.3f}); "
             "tokens per segment: " + ", ".join(f"{k} {v}" for k, v in
                                               result["rollouts"]["segment_tokens"].items()),
             f"{'variant':<10}" + "".join(f"{c:>18}" for c in cols)]
    if "ceiling" in result:
        c = result["ceiling"]
        lines.append(f"{'ceiling':<10}{c['share']:>18.3f}   (prompt-level: between-prompt "
                     f"share, bias-corrected; naive {c['naive_share']:.3f})")
    for name in ("ridge", "today", "fixed"):
        seg = result["by_segment"].get(name)
        if seg is not None:
            lines.append(f"{name:<10}" + "".join(
                f"{seg[c]:>18.3f}" if c in seg else f"{'-':>18}" for c in cols))
    if "fixed_fit" in result:
        f = result["fixed_fit"]
        lines.append(f"fixed fit: {f['optimizer_steps']} optimizer steps, stopped by "
                     f"{f['stopped']}, best fit-held-out EV {f['heldout_ev']:.3f}, "
                     f"{f['seconds']:.0f} s")
    return "\n".join(lines)
