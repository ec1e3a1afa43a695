"""Launches split over hosts (--groups): which part of the program a launch runs, and the end
of a launch that runs actors while the learner runs in another launch.

In one launch the program ends when its learner (and evaluator) finish, and the launcher then
stops the actors. A launch of actors alone has no learner to wait for: it asks the learner's
variable server, as an actor does, for the learner's latest progress report, and ends once that
names version max_steps (the learner reports each version it reaches), or once the server has
been unreachable for service_timeout_s (the learner's launch is over).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from absl import logging

from sao_actor_learner.config import SAOConfig
from sao_actor_learner.config.network import NetworkConfig, parse_service_addresses


class LaunchPart:
    """The part of the program one launch runs (config.groups; all of it by default)."""

    def __init__(self, config: SAOConfig) -> None:
        self.runs = config.section(NetworkConfig).runs   # runs(group) -> bool
        self._remote = parse_service_addresses(config.service_addresses)
        self.actor_ids = range(config.first_actor_id, config.first_actor_id +
                               config.num_actors) if self.runs("actor") else range(0)

    def remote(self, group: str) -> Optional[str]:
        """The address of service `group` when another launch runs it, else None."""
        return self._remote.get(group)


def trusted_certificate(config: SAOConfig) -> Optional[bytes]:
    """The PEM bytes the variable server's clients trust: config.tls_ca, else config.tls_cert
    (None: no TLS)."""
    from sao_actor_learner.variables.security import read_file_bytes
    path = config.tls_ca or config.tls_cert
    return read_file_bytes(path, "tls_ca" if config.tls_ca else "tls_cert") if path else None


def runs_remote_learner(config: SAOConfig) -> bool:
    """Whether this launch runs actors but not the learner (config.groups)."""
    runs = config.section(NetworkConfig).runs
    return runs("actor") and not runs("learner")


class RemoteTraining:
    """`finished()`: whether the learner of this split launch is done (see the module doc)."""

    def __init__(self, config: SAOConfig, auth_token: Optional[str] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from sao_actor_learner.credentials import check_launch_security
        from sao_actor_learner.variables import VariableClient
        address = parse_service_addresses(config.service_addresses)["variables"]
        self._client = VariableClient(address, auth_token=check_launch_security(config, auth_token),
                                      tls_root_cert=trusted_certificate(config))
        self._actor_id = config.first_actor_id
        self._max_steps = config.max_steps
        self._timeout_s = config.service_timeout_s
        self._clock = clock
        self._last_seen = clock()
        self.version = -1     # the newest version the learner reported

    def finished(self) -> bool:
        try:
            info = self._client.acknowledged(self._actor_id, timeout_s=5.0)
        except Exception as e:  # noqa: BLE001 - any failure to reach it counts as unreachable
            away = self._clock() - self._last_seen
            if away > self._timeout_s:
                logging.warning("the learner's variable server at %s has been unreachable for "
                                "%.0f s (service_timeout_s=%g; last error: %s) after version "
                                "%d: ending this launch", self._client.address, away,
                                self._timeout_s, e, self.version)
                return True
            return False
        self._last_seen = self._clock()
        self.version = info.version
        return info.version >= self._max_steps

    def close(self) -> None:
        self._client.close()
