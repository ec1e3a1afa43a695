"""Evaluation as people report it: greedy accuracy, pass@k and maj@k of a model on a dataset's
test split (programs/evaluate.py is the command line).

The model is any model directory, a learner checkpoint (`<run_dir>/checkpoints/step_N`, whose
weights are LoRA-merged) or a run folder (its newest complete checkpoint): `resolve_model`. The
prompts, rendering, engine and reward are the run's own (`--task=dataset` flags: the actor
builder's make_engine and make_task), and generation goes through the evaluator's
`generate_samples`, so a number here is the number a run's evaluator would report.

  greedy accuracy   one greedy response per prompt, correct when its reward is >= 1.
  pass@k            n samples per prompt at --temperature / --top_p; with c correct, the
                    unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021, the Codex
                    paper), averaged over prompts; it is the probability that k of the n samples
                    drawn without replacement hold a correct one.
  maj@k             the answer most of k samples give (the reward's parser reads it:
                    rewards/answers.py; samples without one do not vote; a tie goes to the answer
                    seen first) is correct; averaged over the n // k disjoint blocks of k
                    consecutive samples of each prompt, then over prompts.
Greedy accuracy is also reported per data source (a dataset's kinds of question).
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Dict, List, Optional, Sequence

from sao_actor_learner.config import SAOConfig


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of n samples, c of them correct, drawn
    without replacement, hold a correct one (computed as a product, exact in floats)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): need 0 <= c <= n and 1 <= k <= n")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_correct(answers: Sequence[Optional[str]], scores: Sequence[float]) -> bool:
    """Whether the majority answer of a block of samples is correct (module docstring)."""
    counts = collections.Counter(a for a in answers if a is not None)
    if not counts:
        return False
    top = max(counts.values())
    winner = next(a for a in answers if a is not None and counts[a] == top)
    return scores[answers.index(winner)] >= 1.0


def maj_at_k(answers: Sequence[Optional[str]], scores: Sequence[float], k: int) -> float:
    """maj@k of one prompt's n samples: the mean over its n // k disjoint blocks."""
    blocks = len(answers) // k
    if blocks < 1:
        raise ValueError(f"maj_at_k: k={k} > n={len(answers)} samples")
    return sum(majority_correct(answers[b * k:(b + 1) * k], scores[b * k:(b + 1) * k])
               for b in range(blocks)) / blocks


def check_k(n: int, ks: Sequence[int]) -> None:
    """ValueError naming the flags when a k cannot be estimated from n samples."""
    if n < 0:
        raise ValueError(f"--n={n}: samples per prompt must be >= 0 (0: greedy only)")
    if ks and n == 0:
        raise ValueError(f"--k={','.join(map(str, ks))} needs samples: give --n >= {max(ks)} "
                         "(samples per prompt) or drop --k")
    for k in ks:
        if k < 1 or k > n:
            raise ValueError(f"--k={k} with --n={n}: each k must be in 1..n (pass@k and maj@k "
                             f"choose k of the n samples per prompt); raise --n to {max(k, 1)} "
                             "or lower --k")


def resolve_model(path: str) -> str:
    """The model directory `path` names: a run folder's (or its checkpoints/ folder's) newest
    intact learner checkpoint (its manifest's sizes and sha256 hold); else `path` itself when it
    holds config.json (and no checkpoints/: a run folder's config.json is no model's);
    FileNotFoundError otherwise."""
    import os

    from sao_actor_learner.learner.checkpoint_files import (check_checkpoint,
                                                            complete_checkpoints)
    for root in (os.path.join(path, "checkpoints"), path):   # a run folder has a config.json too
        for _, checkpoint in complete_checkpoints(root):
            if check_checkpoint(checkpoint)[0] is None:
                return checkpoint
    if os.path.isfile(os.path.join(path, "config.json")) and \
            not os.path.isdir(os.path.join(path, "checkpoints")):
        return path
    raise FileNotFoundError(f"--model={path!r} is neither a model directory (no config.json) "
                            "nor a run folder with an intact checkpoint (checkpoints/step_N)")


def evaluate_model(config: SAOConfig, n: int = 0, ks: Sequence[int] = (),
                   run_dir: Optional[str] = None, batch_size: int = 64,
                   examples: int = 3) -> Dict:
    """The report of `config.model` on the first `config.eval_size` rows of
    `config.eval_files` (module docstring): greedy accuracy (overall, per data source), and
    with n > 0 samples per prompt pass@k and maj@k for each k."""
    from sao_actor_learner.actor_builder import make_engine, make_task, sampling_params
    from sao_actor_learner.actors.evaluator import generate_samples
    from sao_actor_learner.rewards.answers import answer_of

    check_k(n, ks)
    start = time.time()
    engine = make_engine(config, role="evaluator", run_dir=run_dir)
    task = None
    try:
        tokenizer = engine.tokenizer
        task = make_task(config, tokenizer=tokenizer)
        prompts = task.eval_prompts()
        greedy = sampling_params(config, greedy=True, stop_ids=tokenizer.stop_ids)
        greedy_gens = [g[0] for g in generate_samples(engine, prompts, greedy, 1, batch_size)]
        greedy_scores = [task.score(p, g.tokens)[0] for p, g in zip(prompts, greedy_gens)]
        by_source: Dict[str, List[float]] = collections.defaultdict(list)
        for p, s in zip(prompts, greedy_scores):
            by_source[p.answer.data_source].append(float(s >= 1.0))
        report = {
            "model": config.model, "eval_files": list(config.eval_files),
            "eval_size": len(prompts), "reward": config.reward,
            "max_new_tokens": config.max_new_tokens,
            "greedy_accuracy": sum(s >= 1.0 for s in greedy_scores) / len(prompts),
            "greedy_accuracy_by_data_source": {k: sum(v) / len(v)
                                               for k, v in sorted(by_source.items())},
            "greedy_truncated_frac": sum(g.finish_reason == "length"
                                         for g in greedy_gens) / len(prompts),
            "greedy_examples": [{"prompt": p.text, "ground_truth": p.answer.ground_truth,
                                 "response": tokenizer.decode_response(g.tokens), "score": s}
                                for p, g, s in list(zip(prompts, greedy_gens,
                                                        greedy_scores))[:examples]],
        }
        if n:
            params = sampling_params(config, stop_ids=tokenizer.stop_ids)
            params = dataclasses.replace(params, seed=config.seed)
            samples = generate_samples(engine, prompts, params, n, batch_size)
            per_prompt = []
            for p, gens in zip(prompts, samples):
                texts = [tokenizer.decode_response(g.tokens) for g in gens]
                scores = [task.score(p, g.tokens)[0] for g in gens]
                per_prompt.append(([answer_of(config.reward, t) for t in texts], scores))
            report.update(n=n, temperature=config.temperature, top_p=config.top_p,
                          seed=config.seed, sample_accuracy=sum(
                              sum(s >= 1.0 for s in sc) for _, sc in per_prompt)
                          / (n * len(prompts)))
            for k in ks:
                report[f"pass@{k}"] = sum(pass_at_k(n, sum(s >= 1.0 for s in sc), k)
                                          for _, sc in per_prompt) / len(prompts)
                report[f"maj@{k}"] = sum(maj_at_k(a, sc, k) for a, sc in per_prompt) / len(prompts)
    finally:
        if task is not None:
            task.close()
        engine.close()
    report["eval_seconds"] = round(time.time() - start, 2)
    return report
