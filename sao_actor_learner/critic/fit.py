"""Fitting a critic on a fixed set of rollouts: value pretraining that converges.

docs/METHOD.md, "Value pretraining". The paper pretrains the value model on the initial policy's
rollouts before RL and calls its scale essential without stating it. Here pretraining is a
rollout budget, fitted in epochs of minibatches, with a held-out part of the budget measured at
a cadence:

  - the budget's rollouts are split once into train and held-out (`heldout_fraction`), by
    prompt: no prompt text (nor group) is on both sides (`split_heldout`);
  - each epoch shuffles the train rollouts and takes one critic optimizer step per minibatch
    (`CriticGAE.optimizer_step`: the learner's own step, frozen attention and all);
  - every `eval_every` optimizer steps (0: at each epoch's end) the held-out explained
    variance is measured (`heldout_metrics`);
  - the fit stops at `max_epochs`, at `target_ev`, or when the held-out EV has not improved by
    more than `min_delta` over `patience` evaluations (a plateau); the critic's trainable
    parameters are then restored to those of the evaluation with the highest held-out EV (the
    optimizer's moments are not: they go on from the last step).

A budget that cannot be fitted (too few rollouts for a held-out part, rewards without
variance) raises `ValueFitError` saying what to change, never a silent EV of 0.
No reverb, tensorflow or grpc here.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from sao_actor_learner.types import Rollout, collate


class ValueFitError(ValueError):
    """A value-pretraining budget that cannot be fitted (see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class FitSettings:
    """How a fixed rollout set is fitted (module docstring)."""
    max_epochs: int = 8
    minibatch_size: int = 16
    eval_every: int = 0          # optimizer steps between held-out evaluations; 0: per epoch
    patience: int = 3            # evaluations without improvement before stopping
    min_delta: float = 0.005     # improvement of the held-out EV that counts
    target_ev: float = 1.0       # stop once the held-out EV reaches this
    seed: int = 0

    def check(self) -> None:
        for name in ("max_epochs", "minibatch_size", "patience"):
            if getattr(self, name) < 1:
                raise ValueFitError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.eval_every < 0:
            raise ValueFitError(f"eval_every={self.eval_every}: must be >= 0 (0: per epoch)")


@dataclasses.dataclass
class FitResult:
    """The fit's curve (one dict per evaluation), the best evaluation and why it stopped."""
    curve: List[Dict[str, float]]
    best: Dict[str, float]
    stopped: str                 # "plateau", "max_epochs", "target_ev" or "stopped"
    optimizer_steps: int
    seconds: float

    def summary(self) -> Dict[str, float]:
        return {"heldout_ev": self.best["heldout_ev"], "best_step": self.best["step"],
                "optimizer_steps": self.optimizer_steps, "stopped": self.stopped,
                "seconds": self.seconds, "evaluations": len(self.curve)}


def prompt_key(rollout: Rollout) -> str:
    """A hash of the rollout's prompt, its tokens before the first action token (all of them
    when it has none): equal for every rollout of one prompt text, whatever its ids (a prompt
    drawn again in a later pass over a dataset gets a new prompt_id)."""
    mask = np.asarray(rollout.action_mask) > 0
    first = int(np.argmax(mask)) if mask.any() else len(mask)
    return hashlib.sha1(np.asarray(rollout.tokens[:first], dtype=np.int64).tobytes()).hexdigest()


def _prompt_components(entries: Sequence[Tuple[int, str]]) -> Dict[str, str]:
    """prompt key -> its component's label: the prompt keys joined by a shared group_id (and
    a shared key joins group ids), labelled by their smallest key."""
    parent: Dict[tuple, tuple] = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for group, key in entries:
        a, b = find(("g", group)), find(("p", key))
        if a != b:
            parent[a] = b
    members: Dict[tuple, List[str]] = {}
    for _, key in entries:
        members.setdefault(find(("p", key)), []).append(key)
    return {key: min(keys) for keys in members.values() for key in keys}


def split_heldout(rollouts: Sequence[Rollout], fraction: float, seed: int = 0,
                  gather: Callable[[object], List[object]] = lambda obj: [obj]
                  ) -> Tuple[List[Rollout], List[Rollout]]:
    """(train, held-out) with no prompt on both sides: rollouts that share a prompt text
    (`prompt_key`) or a group_id stay together, whole prompts are held out in a seeded order
    (a hash of the seed and the prompt, the same on every rank) until at least round(fraction
    * n) rollouts (at least 2) are held out. In a learner group `gather` is the group's
    gather_objects: the split is decided on every rank's rollouts together, so no prompt is held
    out on one rank and trained on by another (the ranks' shares may then differ in size)."""
    if not 0.0 < fraction < 1.0:
        raise ValueFitError(f"heldout fraction {fraction}: must be in (0, 1)")
    local = [(int(r.group_id), prompt_key(r)) for r in rollouts]
    parts = gather(local)
    entries = [e for part in parts for e in part]
    n_held = max(2, int(round(fraction * len(entries))))
    if len(entries) - n_held < 1:
        raise ValueFitError(f"{len(entries)} rollouts cannot be split into a train part and "
                            f"{n_held} held out: value pretraining needs more rollouts (raise "
                            "--value_pretrain_rollouts)")
    label = _prompt_components(entries)
    sizes: Dict[str, int] = {}
    for _, key in entries:
        sizes[label[key]] = sizes.get(label[key], 0) + 1
    held, count = set(), 0
    for component in sorted(sizes, key=lambda c: hashlib.sha1(f"{seed}:{c}".encode()).digest()):
        if count >= n_held:
            break
        held.add(component)
        count += sizes[component]
    if count >= len(entries) or any(part and all(label[k] in held for _, k in part)
                                    for part in parts):
        raise ValueFitError(f"{len(entries)} rollouts of {len(sizes)} distinct prompt(s) "
                            f"cannot be split into train and held-out parts (at least {n_held} "
                            "held out, every rank some to train on) without a prompt on both "
                            "sides: raise --value_pretrain_rollouts or use a task with more "
                            "distinct prompts")
    out: Tuple[List[Rollout], List[Rollout]] = ([], [])
    for r, (_, key) in zip(rollouts, local):
        out[label[key] in held].append(r)
    return out


def check_fittable(rollouts: Sequence[Rollout], what: str = "value pretraining") -> None:
    """Raises ValueFitError when the rollouts' rewards cannot teach a critic anything."""
    if not rollouts:
        raise ValueFitError(f"{what} got no rollouts: raise --value_pretrain_rollouts or check "
                            "that the actors produce rollouts")
    rewards = np.array([r.total_reward for r in rollouts], dtype=np.float64)
    if rewards.var() <= 1e-12:
        raise ValueFitError(f"{what}: all {len(rollouts)} rollouts have reward "
                            f"{rewards[0]:g}, so there is no variance for a critic to explain "
                            "(check the reward function, or start from a policy that "
                            "sometimes succeeds); set --value_pretrain_rollouts=0 to skip it")


def heldout_metrics(estimator, rollouts: Sequence[Rollout], pad_id: int,
                    chunk: int = 64) -> Dict[str, float]:
    """The critic's explained variance and value loss on `rollouts` (this rank's; the group's
    totals are summed), against the targets the estimator trains on (lambda_critic)."""
    sums = np.zeros(5)   # n, sum r, sum r^2, sum (r - v), sum (r - v)^2
    for i in range(0, len(rollouts), chunk):
        batch = collate(rollouts[i:i + chunk], pad_id).to(estimator.device)
        with torch.no_grad():
            estimate = estimator.estimate(batch)
        m = batch.action_mask.bool()
        r = estimate.returns[m].double()
        e = r - estimate.values[m].double()
        sums += np.array([r.numel(), float(r.sum()), float((r * r).sum()), float(e.sum()),
                          float((e * e).sum())])
    n, sr, sr2, se, se2 = estimator.collective.sum(sums.tolist())
    if n < 2:
        return {"heldout_ev": 0.0, "heldout_value_loss": 0.0, "heldout_tokens": n}
    var_r = sr2 / n - (sr / n) ** 2
    var_e = se2 / n - (se / n) ** 2
    return {"heldout_ev": 1.0 - var_e / var_r if var_r > 1e-12 else 0.0,
            "heldout_value_loss": 0.5 * se2 / n, "heldout_tokens": n}


def _trainable_state(estimator) -> Dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in estimator.critic.named_parameters()
            if p.requires_grad}


def _load_trainable(estimator, state: Dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in estimator.critic.named_parameters():
            if n in state:
                p.copy_(state[n])


def fit(estimator, train: Sequence[Rollout], heldout: Sequence[Rollout],
        settings: FitSettings, pad_id: int = 0,
        log: Optional[Callable[[Dict[str, float]], None]] = None,
        should_stop: Callable[[], bool] = lambda: False) -> FitResult:
    """Fits `estimator`'s critic (a learner.estimators.CriticGAE) on `train`, measuring
    `heldout` (module docstring). In a learner group every rank passes its own share;
    optimizer steps and evaluations are collective: every rank takes as many steps per epoch as
    the rank with the fewest train rollouts allows (a split by prompt may leave the shares
    unequal; an epoch of the others then leaves some of theirs out, a different draw each time).
    `log(row)` gets each evaluation."""
    settings.check()
    check_fittable(list(train) + list(heldout))
    world = estimator.collective.world_size
    per_rank = max(1, settings.minibatch_size // world)
    # Every rank takes the same number of optimizer steps (each one is collective).
    steps_per_epoch = -int(estimator.collective.max([-max(1, len(train) // per_rank)])[0])
    rng = np.random.default_rng(settings.seed + estimator.collective.rank)
    start = time.time()
    curve: List[Dict[str, float]] = []
    best_state, best, reference = None, None, None
    since_best, step, stopped = 0, 0, "max_epochs"

    def evaluate(epoch: float) -> bool:
        nonlocal best_state, best, since_best, stopped, reference
        estimator.critic.eval()
        row = {"step": step, "epoch": epoch, "seconds": time.time() - start,
               **heldout_metrics(estimator, heldout, pad_id)}
        curve.append(row)
        if log is not None:
            log(row)
        if best is None or row["heldout_ev"] > best["heldout_ev"]:
            best, best_state = row, _trainable_state(estimator)
        if reference is None or row["heldout_ev"] > reference + settings.min_delta:
            reference, since_best = row["heldout_ev"], 0    # an improvement that counts
        else:
            since_best += 1
        if row["heldout_ev"] >= settings.target_ev:
            stopped = "target_ev"
            return True
        if since_best >= settings.patience:
            stopped = "plateau"
            return True
        return False

    done = evaluate(0.0)
    for epoch in range(settings.max_epochs):
        if done:
            break
        order = rng.permutation(len(train))
        for k in range(steps_per_epoch):
            if should_stop():
                stopped, done = "stopped", True
                break
            rows = [train[i] for i in order[k * per_rank:(k + 1) * per_rank]]
            batch = collate(rows, pad_id).to(estimator.device)
            estimator.critic.train()
            estimate = estimator.estimate(batch)
            scratch = torch.zeros(batch.tokens.shape, dtype=torch.float32,
                                  device=batch.tokens.device)
            # The estimate's forward when it kept one of the whole batch (CriticGAE.estimate;
            # with critic_minibatches > 1 it keeps the first slice's): the same values.
            kept = estimate.forward_cache
            if kept is not None and len(kept[1]) != batch.size:
                kept = None
            estimator.optimizer_step(batch, estimate, np.arange(batch.size), scratch, kept)
            step += 1
            if settings.eval_every and step % settings.eval_every == 0:
                if evaluate(epoch + (k + 1) / steps_per_epoch):
                    done = True
                    break
        if not done and not settings.eval_every:
            done = evaluate(float(epoch + 1))
    if best_state is not None:
        _load_trainable(estimator, best_state)
    estimator.critic.eval()
    return FitResult(curve=curve, best=dict(best or {}), stopped=stopped, optimizer_steps=step,
                     seconds=time.time() - start)
