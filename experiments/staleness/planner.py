"""The staleness planner: a discrete-event simulation (simpy) of the actor-learner loop.

It runs the program's own rules, imported from the code that enforces them:
  admission     variables/admission.Admission: an actor starts rollouts only while
                started <= (v + eta + 1) * B + dropped (granted in part when fewer fit); an actor
                granted nothing waits for a new version or credit, then actors/actor.py's
                ADMISSION_RETRY_S (half of it on average);
  the queue     config.effective_queue_capacity (Reverb's Queue rate limiter): an insert blocks
                while that many rollouts are queued; the learner takes them oldest first;
  staleness     types.rollout_staleness and learner/sampling.too_stale: a rollout staler than eta
                when the learner draws it is dropped and its slot given back as credit;
  delays        actors/delays.sample_delays (config actor_delay*) with actors/delivery's
                default_max_waiting: each rollout waits out its delay before its insert, while the
                actor generates on, with at most that many waiting.
Lock-step is max_staleness 0 (config.lockstep sets it): admission then lets actors start one
batch per version.

Per actor: [wait for room] -> admit -> load the admitted version when the engine is older
(load_s) -> generate the granted prompts together (Costs.generation_s of their sampled lengths)
-> insert each rollout (blocking while the queue is full), or hand it to the delayed delivery.
The learner: draw B fresh rollouts (dropping stale ones) -> train (Costs.learner_s of the batch's
prompt + response tokens) -> version += 1 -> publish (publish_s) -> the version is visible ->
learner_other_s (checkpoints and the like) -> the next draw.

What it leaves out (docs/STALENESS.md lists every assumption): CPU or GPU contention between the
parts (each runs at its own measured or given speed), the evaluator, value
pretraining, in-flight weight updates (weight_sync_mode keep/abort: they change how fast a
generation ends, not its staleness, which counts its oldest token), learner groups, groups of
rollouts (group_size > 1 is refused), network time beyond publish_s and load_s.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from typing import Dict, List, Optional, Sequence

import numpy as np

from experiments.staleness.inputs import Costs, LengthDistribution, PlanError
from sao_actor_learner.actors.actor import ADMISSION_RETRY_S
from sao_actor_learner.actors.delays import sample_delays
from sao_actor_learner.actors.delivery import default_max_waiting
from sao_actor_learner.learner.sampling import too_stale
from sao_actor_learner.types import rollout_staleness
from sao_actor_learner.variables.admission import Admission


@dataclasses.dataclass(frozen=True)
class Setting:
    """What the program's config decides about the loop (`from_config`)."""
    batch_size: int
    max_staleness: int
    num_actors: int
    actor_batch: int
    queue_capacity: int
    max_steps: int
    admission_control: bool = True
    actor_delay: str = "none"
    actor_delay_mean_s: float = 0.0
    actor_delay_max_s: float = 10.0
    actor_delay_tail: float = 1.5
    admission_poll_s: float = ADMISSION_RETRY_S / 2.0

    @classmethod
    def from_config(cls, config, max_staleness: Optional[int] = None,
                    max_steps: Optional[int] = None) -> "Setting":
        if config.group_size != 1:
            raise PlanError(f"group_size={config.group_size}: the planner models single "
                            "rollouts (the group sampler drops whole groups); plan with "
                            "--group_size=1 and batch_size = prompts x group")
        if config.forced_staleness >= 0:
            raise PlanError(f"forced_staleness={config.forced_staleness}: a drift experiment, "
                            "not a limit to plan; use -1")
        return cls(batch_size=config.batch_size,
                   max_staleness=config.max_staleness if max_staleness is None
                   else int(max_staleness),
                   num_actors=config.num_actors, actor_batch=config.actor_batch,
                   queue_capacity=config.effective_queue_capacity,
                   max_steps=config.max_steps if max_steps is None else int(max_steps),
                   admission_control=config.admission_control, actor_delay=config.actor_delay,
                   actor_delay_mean_s=config.actor_delay_mean_s,
                   actor_delay_max_s=config.actor_delay_max_s,
                   actor_delay_tail=config.actor_delay_tail)


@dataclasses.dataclass
class PlanResult:
    """One simulated run. Times from the first generate call to the last step's publish."""
    max_staleness: int
    steps: int
    span_s: float
    rollouts_per_s: float
    tokens_per_s: float
    steady_rollouts_per_s: float     # over the second half of the steps
    learner_busy_frac: float         # training + publishing, of the span
    admission_wait_frac: float       # actors' time waiting for admission, of N x span
    insert_wait_frac: float          # actors' time blocked on a full queue, of N x span
    staleness_hist: List[int]        # trained rollouts by staleness 0..eta
    staleness_rollout_mean: float
    staleness_token_mean: float      # weighted by response tokens (metrics' staleness_mean)
    dropped_stale: int
    rollouts_generated: int


class _Loop:
    """The simulated program: the processes share this state (single-threaded simpy)."""

    def __init__(self, env, setting: Setting, costs: Costs, lengths: LengthDistribution,
                 seed: int):
        import simpy
        self.env, self.s, self.costs, self.lengths = env, setting, costs, lengths
        self.queue = simpy.Store(env, capacity=setting.queue_capacity)
        self.admission = Admission(setting.batch_size, setting.max_staleness,
                                   setting.admission_control)
        self.version = 0                        # the newest published version
        self.changed = env.event()              # a new version or credit
        self.dropped = 0
        self.seed = seed
        self.first_gen: Optional[float] = None
        self.admission_wait = 0.0
        self.insert_wait = 0.0
        self.generated = 0
        self.busy = 0.0
        self.step_ends: List[float] = []
        self.trained_tokens = 0.0
        self.hist: Dict[int, int] = {}
        self.stale_tokens = 0.0
        self.response_tokens = 0.0

    def notify(self) -> None:
        old, self.changed = self.changed, self.env.event()
        old.succeed()

    # --- the actors ------------------------------------------------------------------------
    def actor(self, i: int):
        env, s = self.env, self.s
        rng = np.random.default_rng([self.seed, i])
        delayed = s.actor_delay != "none" and s.actor_delay_mean_s > 0
        delivery = _Delivery(self, np.random.default_rng([self.seed, i, 1]),
                             default_max_waiting(s.actor_batch)) if delayed else None
        engine_version = -1
        while True:
            if delivery is not None:
                yield from delivery.wait_for_room(s.actor_batch)
            version = self.version
            granted = self.admission.admit(str(i), s.actor_batch, 0, version).granted
            if granted <= 0:
                t = env.now
                yield self.changed
                yield env.timeout(s.admission_poll_s)
                self.admission_wait += env.now - t
                continue
            if engine_version < version:
                yield env.timeout(self.costs.load_s)
                engine_version = version
            lengths = self.lengths.sample(rng, granted)
            if self.first_gen is None:
                self.first_gen = env.now
            yield env.timeout(self.costs.generation_s(lengths))
            self.generated += granted
            rollouts = [(engine_version, float(n)) for n in lengths]
            if delivery is not None:
                delivery.schedule(rollouts)
                continue
            for r in rollouts:
                t = env.now
                yield self.queue.put(r)
                self.insert_wait += env.now - t

    # --- the learner -----------------------------------------------------------------------
    def learner(self):
        env, s = self.env, self.s
        for _ in range(s.max_steps):
            batch = []
            while len(batch) < s.batch_size:
                min_version, length = yield self.queue.get()
                staleness = rollout_staleness(min_version, self.version)
                if too_stale(staleness, s.max_staleness):
                    self.dropped += 1
                    self.admission.add_credit(self.dropped)   # the learner reports the credit
                    self.notify()
                    continue
                batch.append((staleness, length))
            tokens = sum(length + self.costs.prompt_tokens for _, length in batch)
            t = env.now
            yield env.timeout(self.costs.learner_s(tokens))
            for staleness, length in batch:
                self.hist[staleness] = self.hist.get(staleness, 0) + 1
                self.stale_tokens += staleness * length
                self.response_tokens += length
            self.trained_tokens += tokens
            yield env.timeout(self.costs.publish_s)
            self.busy += env.now - t
            self.version += 1
            self.step_ends.append(env.now)
            self.notify()
            yield env.timeout(self.costs.learner_other_s)

    def result(self) -> PlanResult:
        s = self.s
        start = self.first_gen or 0.0
        span = max(self.step_ends[-1] - start, 1e-12)
        half = len(self.step_ends) // 2
        steady = ((len(self.step_ends) - half) * s.batch_size
                  / max(self.step_ends[-1] - self.step_ends[half - 1], 1e-12)) if half else 0.0
        trained = sum(self.hist.values())
        return PlanResult(
            max_staleness=s.max_staleness, steps=len(self.step_ends), span_s=span,
            rollouts_per_s=trained / span, tokens_per_s=self.trained_tokens / span,
            steady_rollouts_per_s=steady, learner_busy_frac=self.busy / span,
            admission_wait_frac=self.admission_wait / (s.num_actors * span),
            insert_wait_frac=self.insert_wait / (s.num_actors * span),
            staleness_hist=[self.hist.get(k, 0) for k in range(max(self.hist, default=0) + 1)],
            staleness_rollout_mean=sum(k * n for k, n in self.hist.items()) / max(trained, 1),
            staleness_token_mean=self.stale_tokens / max(self.response_tokens, 1e-12),
            dropped_stale=self.dropped, rollouts_generated=self.generated)


class _Delivery:
    """actors/delivery.DelayedDelivery: rollouts wait out their delays, then are inserted one
    at a time, soonest first; at most `max_waiting` wait."""

    def __init__(self, loop: _Loop, rng: np.random.Generator, max_waiting: int):
        self.loop, self.rng, self.max_waiting = loop, rng, max_waiting
        self.heap: list = []
        self.seq = itertools.count()
        self.waiting = 0
        self.wake = loop.env.event()
        self.room = loop.env.event()
        loop.env.process(self.run())

    def _fire(self, event):
        """Triggers `event` (waking its waiters) and returns a fresh one for the next wait."""
        event.succeed()
        return self.loop.env.event()

    def schedule(self, rollouts) -> None:
        s = self.loop.s
        delays = sample_delays(s.actor_delay, len(rollouts), self.rng, s.actor_delay_mean_s,
                               s.actor_delay_max_s, s.actor_delay_tail)
        for r, d in zip(rollouts, delays):
            heapq.heappush(self.heap, (self.loop.env.now + float(d), next(self.seq), r))
        self.waiting += len(rollouts)
        self.wake = self._fire(self.wake)

    def wait_for_room(self, batch: int):
        while self.waiting + batch > self.max_waiting:
            yield self.room

    def run(self):
        env = self.loop.env
        while True:
            if not self.heap:
                yield self.wake
                continue
            due = self.heap[0][0]
            if due > env.now:
                yield env.timeout(due - env.now) | self.wake
                continue
            _, _, rollout = heapq.heappop(self.heap)
            yield self.loop.queue.put(rollout)
            self.waiting -= 1
            self.room = self._fire(self.room)


def simulate(setting: Setting, costs: Costs, lengths: LengthDistribution,
             seed: int = 0) -> PlanResult:
    """One simulated run of `setting.max_steps` learner steps."""
    import simpy
    if setting.max_steps < 2:
        raise PlanError(f"max_steps={setting.max_steps}: simulate at least 2 steps")
    env = simpy.Environment()
    loop = _Loop(env, setting, costs, lengths, seed)
    for i in range(setting.num_actors):
        env.process(loop.actor(i))
    env.run(until=env.process(loop.learner()))
    return loop.result()


def average(results: Sequence[PlanResult]) -> Dict:
    """The mean of each number over simulated repeats (the histogram summed)."""
    out: Dict = {}
    for f in dataclasses.fields(PlanResult):
        values = [getattr(r, f.name) for r in results]
        if f.name == "staleness_hist":
            width = max(len(v) for v in values)
            out[f.name] = [sum(v[k] if k < len(v) else 0 for v in values) for k in range(width)]
        else:
            out[f.name] = float(np.mean(values))
    out["max_staleness"] = int(out["max_staleness"])
    out["seeds"] = len(results)
    return out


def curve(base: Setting, costs: Costs, lengths: LengthDistribution, limits: Sequence[int],
          seeds: int = 3) -> List[Dict]:
    """The averaged simulation at each limit (lock-step is limit 0)."""
    if not limits:
        raise PlanError("--limits is empty: give at least one staleness limit, e.g. 0,1,2,4,8")
    if any(not isinstance(k, int) or k < 0 for k in limits):
        raise PlanError(f"--limits={','.join(map(str, limits))}: every limit must be an "
                        "integer >= 0 (0 is lock-step)")
    return [average([simulate(dataclasses.replace(base, max_staleness=k), costs, lengths, seed)
                     for seed in range(seeds)]) for k in limits]


def closed_form_deterministic(setting: Setting, costs: Costs, length: float) -> Dict[str, float]:
    """Rollouts/s of the deterministic loop (fixed lengths, no delays) in its two simple
    regimes: lock-step, where each version waits for generation and training in turn, and a
    limit loose enough that actors and learner overlap, where the slower side sets the rate."""
    b, n, a = setting.batch_size, setting.num_actors, setting.actor_batch
    gen = costs.generation_s(np.full(a, length))
    train = costs.learner_s(b * (length + costs.prompt_tokens)) + costs.publish_s + \
        costs.learner_other_s
    rounds = math.ceil(b / (n * a))        # actor batches one version waits for, in lock-step
    return {"lockstep": b / (costs.load_s + rounds * gen + train),
            "overlapped": min(n * a / gen, b / train)}
