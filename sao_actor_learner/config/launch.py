"""The launch section of the run configuration: scale-out (Ray, placement), restarts of
crashed nodes, liveness, resuming, and the variable server's interface and TLS files.

Standard library only (placement's checks are imported when a placement is given).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Tuple

from sao_actor_learner.config.sections import PROGRAM_GROUPS, Fail, Section, option


@dataclasses.dataclass(frozen=True)
class LaunchConfig(Section):
    """Scale-out, restarts and security."""
    ray_address: str = option("", "launch=ray: empty starts a local Ray (or uses this process's "
                              "ray.init()); auto or ray://HEAD:10001 joins a cluster.")
    ray_resources: Tuple[str, ...] = option((), "launch=ray: GROUP:CPUS[:GPUS] reserved by each "
                                            "node of GROUP, e.g. learner:1:1,actor:1.")
    placement: Tuple[str, ...] = option((), "launch=local_mp: GROUP:cpuN[-M] and/or "
                                        "GROUP:gpuN[-M] pins each group's processes to those "
                                        "cores (torch threads sized to them) and GPUs "
                                        "(CUDA_VISIBLE_DEVICES), e.g. actor:cpu0,learner:cpu1 "
                                        "or actor:gpu0-3,learner:gpu4-7. Unnamed groups run "
                                        "anywhere; ignored with a warning under Ray. "
                                        "critic:cpuN[-M] or critic:gpuN places the concurrent "
                                        "critic (--critic_concurrent) in the learner's process.")
    restart_groups: Tuple[str, ...] = option(("actor", "evaluator"), "Crashed nodes of these "
                                             "groups are restarted (the learner resumes from "
                                             "its checkpoint and journal).")
    max_restarts: int = option(3, "Restarts per node; one crash more fails the run.")
    restart_backoff_s: float = option(1.0, "Wait before a node's first restart; doubles per "
                                      "restart (at most 30 s).")
    service_timeout_s: float = option(300.0, "How long a service node (replay, variables) may "
                                      "take to accept connections; importing TensorFlow takes "
                                      "minutes on a loaded machine.")
    node_timeout_s: float = option(60.0, "launch=local_mp: a node process whose heartbeat "
                                   "thread is silent this long (stopped, deadlocked) is killed "
                                   "and restarted as if it crashed (restart_groups), else fails "
                                   "the run; long work never silences it; 0: off.")
    resume: bool = option(False, "Continue the run in run_dir (checkpoints, journal, replay, "
                          "spools); otherwise they are cleared first.")
    bind_host: str = option("127.0.0.1", "Interface the variable server binds; another needs "
                            "an auth token ($SAO_AUTH_TOKEN or --auth_token) and TLS "
                            "(--tls_cert, --tls_key) or --insecure_transport.")
    tls_cert: str = option("", "PEM certificate chain: the variable server speaks TLS only.")
    tls_key: str = option("", "PEM private key of --tls_cert.")

    def check(self, fail: Fail) -> None:
        for group in self.restart_groups:
            if group not in PROGRAM_GROUPS:
                fail(f"restart_groups contains {group!r}: must name groups of the program "
                     f"({', '.join(PROGRAM_GROUPS)})")
        if self.max_restarts < 0:
            fail(f"max_restarts={self.max_restarts}: must be >= 0 (0: a crash fails the run)")
        if self.restart_backoff_s < 0:
            fail(f"restart_backoff_s={self.restart_backoff_s}: must be >= 0 seconds")
        if self.service_timeout_s <= 0:
            fail(f"service_timeout_s={self.service_timeout_s}: must be > 0 seconds")
        if not self.node_timeout_s >= 0:
            fail(f"node_timeout_s={self.node_timeout_s}: must be >= 0 seconds (0: no liveness "
                 "checks)")
        try:
            parse_ray_resources(self.ray_resources)
        except ValueError as e:
            fail(str(e))
        if self.placement:
            from sao_actor_learner.launch.placement import (IN_PROCESS_GROUPS, check_placement,
                                                            critic_placement, parse_placement)
            try:
                check_placement(parse_placement(self.placement,
                                                PROGRAM_GROUPS + IN_PROCESS_GROUPS))
                critic_placement(self.placement, PROGRAM_GROUPS)
            except ValueError as e:
                fail(str(e))
        if bool(self.tls_cert) != bool(self.tls_key):
            fail(f"tls_cert={self.tls_cert!r}, tls_key={self.tls_key!r}: give both (TLS on the "
                 "variable server) or neither")
        for field in ("tls_cert", "tls_key"):
            path = getattr(self, field)
            if path and not os.path.isfile(path):
                fail(f"{field}={path!r}: no such file (a PEM file)")
        if not self.bind_host or any(c in self.bind_host for c in " /"):
            fail(f"bind_host={self.bind_host!r}: must be an interface address such as 127.0.0.1 "
                 "or 0.0.0.0")


def parse_ray_resources(entries) -> dict:
    """{group: {"num_cpus": c, "num_gpus": g}} from entries "GROUP:CPUS[:GPUS]"."""
    out = {}
    for entry in entries:
        parts = str(entry).split(":")
        if len(parts) not in (2, 3) or parts[0] not in PROGRAM_GROUPS:
            raise ValueError(f"ray_resources entry {entry!r}: must be GROUP:CPUS[:GPUS] with "
                             f"GROUP one of {', '.join(PROGRAM_GROUPS)}, e.g. learner:1:1")
        try:
            amounts = [float(x) for x in parts[1:]]
        except ValueError:
            raise ValueError(f"ray_resources entry {entry!r}: CPUS and GPUS must be numbers, "
                             "e.g. actor:1 or learner:2:1") from None
        if any(a < 0 for a in amounts):
            raise ValueError(f"ray_resources entry {entry!r}: amounts must be >= 0")
        if parts[0] in out:
            raise ValueError(f"ray_resources names group {parts[0]!r} twice")
        out[parts[0]] = {"num_cpus": amounts[0], "num_gpus": amounts[1] if len(amounts) > 1
                         else 0.0}
    return out
