"""The critic's K steps, in sequence or off the policy's critical path (config
critic_concurrent; docs/METHOD.md section 8, docs/DESIGN.md section 8).

SAO's critic steps need the batch and the estimate's targets (returns, old values), not the
policy step: the critic (critic=separate) is a network of its own with its own optimizer. So
after the estimate, `CriticUpdate.start(batch, estimate)` hands `estimator.update` to a worker
thread of its own (torch releases the GIL in its operators) while the learner's thread runs the
policy step, and `join()` waits for it before the learner step ends, i.e. before the version is
published, before a checkpoint, the critic's yardstick or the next estimate read the critic. The
critic trains on the same batch and targets from the same parameters as in sequence, and the
policy step reads nothing the critic writes, so both networks end every step with the
parameters of the sequential order (tests/learner/test_concurrent_critic.py); the critic is
never behind the policy (`critic_lag_steps` 0 in every step row).

Placement (--placement's critic entry, launch/placement.py): `cores` pins the worker thread
(os.sched_setaffinity of its thread id, inherited by the OpenMP threads it starts) and sizes its
torch intra-op threads (per thread with OpenMP); on CUDA the worker runs on the critic's device
(`critic:gpuN`, or the policy's) on a stream of its own, ordered after the estimate's work by an
event and before the next estimate by another.

Statistics of each update: the estimator's, `critic_step_s` (the update's own seconds),
`critic_wait_s` (what the learner's thread waited for it after the policy step: the critic's
part of the critical path; all of critic_step_s in sequence), `critic_overlap_frac`
(1 - wait / step: the share hidden behind the policy step), `critic_version` (critic updates
finished before this one started) and `critic_lag_steps` (updates started but unfinished when
this one started: 0 by construction), `critic_concurrent`.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Dict, Optional, Sequence

import torch

from sao_actor_learner.learner.estimator_base import AdvantageEstimator, Estimate
from sao_actor_learner.types import Batch


def dropout_settings(*modules: torch.nn.Module) -> list:
    """Names of the dropout settings above 0 of `modules` (their Hugging Face configs' *dropout
    and *pdrop fields, dropout layers): a training-mode forward of either network then draws
    from torch's global generator, and two threads would draw in an order that changes from run
    to run."""
    found = []
    for module in modules:
        config = getattr(module, "config", None)
        for key, value in (config.to_dict().items() if config is not None else ()):
            if ("dropout" in key or "pdrop" in key) and isinstance(value, (int, float)) \
                    and value > 0:
                found.append(f"{key}={value}")
        found += [f"{name}.p={m.p}" for name, m in module.named_modules()
                  if "Dropout" in type(m).__name__ and getattr(m, "p", 0) > 0]
    return found


class CriticUpdate:
    """Runs `estimator.update(batch, estimate)` once per learner step (see the module
    docstring): in sequence (`join` runs it) or, `concurrent`, in a worker thread that `start`
    hands it to.

    Args:
      estimator: the AdvantageEstimator (a critic=separate CriticGAE when concurrent).
      concurrent: run the update in the worker thread.
      cores: the cores the worker thread is pinned to (empty: where the process may run).
      threads: the worker's torch intra-op threads (0: len(cores), else the creating thread's).
    """

    def __init__(self, estimator: AdvantageEstimator, concurrent: bool = False,
                 cores: Sequence[int] = (), threads: int = 0):
        if concurrent and (not estimator.has_critic or estimator.critic.shares_trunk):
            raise ValueError("critic_concurrent=True needs a separate critic "
                             f"(critic=separate), not {type(estimator).__name__}")
        if cores and not concurrent:
            raise ValueError(f"critic cores {list(cores)} without critic_concurrent: the "
                             "critic runs in the learner's thread; add --critic_concurrent")
        self.estimator = estimator
        self.concurrent = concurrent
        self.cores = tuple(cores)
        self.threads = threads or len(self.cores) or torch.get_num_threads()
        self.started = self.finished = 0
        self.thread_affinity: Optional[set] = None   # the worker thread's cores, as it saw them
        self._pending: Optional[tuple] = None
        self._jobs: "queue.Queue" = queue.Queue()
        self._done: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._stream = None

    @property
    def device(self) -> Optional[torch.device]:
        return self.estimator.device if self.estimator.has_critic else None

    def start(self, batch: Batch, estimate: Estimate) -> None:
        """The update of this step, from now on (concurrent) or at `join` (in sequence)."""
        if self._pending is not None:
            raise RuntimeError("a critic update is still pending: join() it first")
        lag, version = self.started - self.finished, self.finished
        self.started += 1
        ready = None
        if self.concurrent:
            self._ensure_thread()
            ready = self._record_event()   # the estimate's GPU work, before the critic's
            self._jobs.put((batch, estimate, ready))
        self._pending = (batch, estimate, lag, version, time.perf_counter())

    def join(self) -> Dict[str, float]:
        """Waits for (or runs) the pending update; its statistics (see the module docstring)."""
        if self._pending is None:
            raise RuntimeError("no critic update was started")
        batch, estimate, lag, version, _ = self._pending
        self._pending = None
        t = time.perf_counter()
        if self.concurrent:
            stats, seconds, done, error = self._done.get()
            if done is not None:       # the next estimate's GPU work waits for the critic's
                torch.cuda.current_stream(self.device).wait_event(done)
            if error is not None:
                raise error
        else:
            stats = self.estimator.update(batch, estimate)
            seconds = time.perf_counter() - t
        wait = time.perf_counter() - t
        self.finished += 1
        return {**stats, "critic_step_s": seconds, "critic_wait_s": wait,
                "critic_overlap_frac": max(0.0, 1.0 - wait / seconds) if seconds > 0 else 0.0,
                "critic_version": version, "critic_lag_steps": lag,
                "critic_concurrent": int(self.concurrent)}

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def settle(self) -> None:
        """Joins a pending update (its statistics dropped): nothing reads the critic while it
        is being trained. A learner step always joins its own; this is for what reads the
        critic after a step that failed half-way (a checkpoint, the end of the run)."""
        if self._pending is not None:
            self.join()

    def close(self) -> None:
        """Ends the worker thread, after a pending update."""
        self.settle()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    # The worker thread ---------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is not None:
            return
        ready = threading.Event()
        main_threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._work, args=(ready,), daemon=True,
                                        name="critic-update")
        self._thread.start()
        ready.wait()
        # set_num_threads in the worker also set the default for threads started later: the
        # learner's own (per-thread) count is set again, which restores that default.
        torch.set_num_threads(main_threads)

    def _record_event(self):
        device = self.device
        if device is None or device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def _work(self, ready: threading.Event) -> None:
        tid = threading.get_native_id()
        if self.cores:
            os.sched_setaffinity(tid, self.cores)
        self.thread_affinity = set(os.sched_getaffinity(tid))
        torch.set_num_threads(self.threads)
        device = self.device
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
            self._stream = torch.cuda.Stream(device)
        ready.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            batch, estimate, event = job
            t = time.perf_counter()
            stats, done, error = {}, None, None
            try:
                stats, done = self._run(batch, estimate, event)
            except BaseException as e:   # handed to the learner's thread at join()
                error = e
            self._done.put((stats, time.perf_counter() - t, done, error))

    def _run(self, batch: Batch, estimate: Estimate, event) -> tuple:
        if self._stream is None:
            return self.estimator.update(batch, estimate), None
        self._stream.wait_event(event)
        with torch.cuda.stream(self._stream):
            stats = self.estimator.update(batch, estimate)
            done = torch.cuda.Event()
            done.record(self._stream)
        return stats, done
