"""A test hook: a vLLM scheduler that holds a group of requests at a known point.

Runs inside the vLLM environment (engine-core process). Never used by default; a server started
with `--scheduler-cls vllm_server.hold_scheduler.HoldScheduler` uses it (the vLLM tests do, so a
weight update provably lands while every request of a group is in flight, on any machine
speed). A request whose SamplingParams.extra_args has

  "sao_hold": {"group": <str>, "size": <n>, "tokens": <k>, "signal_file": <path>}

joins group `group`, and the group goes through:

  gather  until n requests of the group have arrived, the scheduler is paused (PAUSED_ALL, as
          `/pause?mode=keep` pauses it: nothing is scheduled), so all n start in the same step
          and then advance in lockstep (the server's token budget fits them all);
  hold    after the step in which every unfinished request of the group has >= k output
          tokens, the scheduler pauses again (PAUSED_ALL) and writes `signal_file` (JSON:
          group, each request's output tokens so far). The tokens of that step carry the weight
          version of the step, like any others. It stays paused until the next `/resume` (a
          weight update, `push_weights`, ends with one).

A group holds once: requests that join it afterwards (re-sent after an abort) run normally. If
every request of the group finishes before k tokens, the signal file says "finished" instead.
Requests without "sao_hold" are scheduled as by vLLM's Scheduler, whose subclass this is.
"""
from __future__ import annotations

import json
import os

from vllm.logger import init_logger
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler

logger = init_logger("vllm.sao_hold_scheduler")   # under vLLM's configured "vllm" logger
HOLD_KEY = "sao_hold"


def _hold_spec(request):
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    spec = extra.get(HOLD_KEY)
    return spec if isinstance(spec, dict) else None


def _signal(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)   # the reader sees the whole file or none


class HoldScheduler(Scheduler):
    """vLLM's Scheduler plus the gather/hold of `sao_hold` request groups (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sao_groups: dict = {}

    def add_request(self, request) -> None:
        super().add_request(request)
        spec = _hold_spec(request)
        if spec is None:
            return
        group = self._sao_groups.setdefault(
            str(spec["group"]), {"spec": spec, "ids": [], "state": "gather", "paused": False})
        if group["state"] != "gather":
            return      # joined after the hold (a re-sent request): runs normally
        group["ids"].append(request.request_id)
        if len(group["ids"]) < int(spec["size"]):
            if self.pause_state == PauseState.UNPAUSED:
                self.set_pause_state(PauseState.PAUSED_ALL)
                group["paused"] = True
            return
        group["state"] = "run"
        logger.info("sao hold: group %s complete (%d requests); running them together",
                    spec["group"], len(group["ids"]))
        if group["paused"] and self.pause_state == PauseState.PAUSED_ALL:
            self.set_pause_state(PauseState.UNPAUSED)

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for name, group in self._sao_groups.items():
            if group["state"] != "run":
                continue
            spec = group["spec"]
            alive = [self.requests.get(i) for i in group["ids"]]
            alive = [r for r in alive if r is not None and not r.is_finished()]
            if not alive:
                group["state"] = "done"
                _signal(spec["signal_file"], {"group": name, "held": False,
                                              "why": "every request finished before the hold"})
                continue
            if all(r.num_output_tokens >= int(spec["tokens"]) for r in alive):
                group["state"] = "held"
                if self.pause_state == PauseState.UNPAUSED:
                    self.set_pause_state(PauseState.PAUSED_ALL)
                tokens = [r.num_output_tokens for r in alive]
                logger.info("sao hold: group %s held with %d requests at %s output tokens",
                            name, len(alive), sorted(set(tokens)))
                _signal(spec["signal_file"], {"group": name, "held": True,
                                              "requests": len(alive), "tokens": tokens,
                                              "finished": len(group["ids"]) - len(alive)})
        return outputs
