"""The three secrets of a run, where they come from, and which nodes get each.

- auth token: held by every node that calls the variable server (actors, evaluator, learner)
  and by the server; every call needs it (weights, admission, acknowledgements). From
  $SAO_AUTH_TOKEN (or `--auth_token`); may be empty only when everything binds loopback.
- learner token: held by the learner and the variable server; Publish and ReportProgress need
  it (weights, acknowledgements, admission credit, loss epochs). From $SAO_LEARNER_TOKEN, else
  made per launch.
- rollout secret: held by the learner (and the launcher); each actor is given only its own key,
  HMAC(secret, run id | actor id) (replay/validation.py), with which it signs every rollout;
  the learner trains on nothing else. From $SAO_ROLLOUT_SECRET, else made per launch. The run
  id (run_identity.py; not a secret) binds the keys to the run.

A single launch makes the learner token and the rollout secret itself (random, per launch).
A launch split over hosts (`--groups`, config/network.py) cannot: a secret shared by two
launches must be given to both, through the environment, never on a command line (where `ps`
shows it) nor in config.json or logs. A launch that runs the learner without the variable
server (or the other way round) needs $SAO_LEARNER_TOKEN; one that runs the actors without the
learner (or the other way round) needs $SAO_ROLLOUT_SECRET (and $SAO_RUN_ID, new for every
fresh run, run_identity.py). The learner token must differ from
the auth token: actors hold the auth token, and must not be able to publish or report progress.

Nodes get their secrets as arguments of their factories (builder.make_program): pickled over a
pipe to each local_mp process, or through Ray's object store under launch=ray; a node is not
given a secret it does not use. They also inherit the launcher's environment, so a host that
runs actors should not have $SAO_LEARNER_TOKEN set.
"""
from __future__ import annotations

import dataclasses
import os
import secrets
from typing import Mapping, Optional

from absl import logging

from sao_actor_learner.config import ConfigError, NetworkConfig, SAOConfig
from sao_actor_learner.variables.security import (MIN_AUTH_TOKEN_CHARS, check_bind,
                                                  is_loopback, resolve_auth_token)

from sao_actor_learner.secret_env import LEARNER_TOKEN_ENV, ROLLOUT_SECRET_ENV  # noqa: F401


@dataclasses.dataclass(frozen=True)
class Credentials:
    """The secrets of one launch (see the module docstring); never printed."""
    auth_token: str
    learner_token: str
    rollout_secret: str

    def __repr__(self) -> str:
        return (f"Credentials(auth_token={'set' if self.auth_token else 'none'}, "
                "learner_token=set, rollout_secret=set)")


def check_launch_security(config: SAOConfig, auth_token: Optional[str] = None) -> str:
    """The auth token to use (`auth_token`, else $SAO_AUTH_TOKEN); ConfigError when the variable
    server would bind a non-loopback address without one (or without TLS, unless
    config.insecure_transport), or a remote variable server is named without one."""
    token = resolve_auth_token(auth_token)
    runs = config.section(NetworkConfig).runs
    try:
        if runs("variables"):
            check_bind(config.bind_host, token, "the variable server", tls=bool(config.tls_cert),
                       insecure_transport=config.insecure_transport)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    remote_beyond_loopback = _remote_variables_beyond_loopback(config)
    if config.insecure_transport and not (config.tls_cert or config.tls_ca) and (
            remote_beyond_loopback or (runs("variables") and not is_loopback(config.bind_host))):
        logging.warning("INSECURE TRANSPORT (--insecure_transport): the variable server is "
                        "reached beyond loopback without TLS; the auth and learner tokens cross "
                        "the network in clear text")
    if not runs("variables") and not token and remote_beyond_loopback:
        raise ConfigError(f"service_addresses={','.join(config.service_addresses)}: a variable "
                          "server on another host needs the auth token it was started with: "
                          "set $SAO_AUTH_TOKEN")
    return token


def _remote_variables_beyond_loopback(config: SAOConfig) -> bool:
    from sao_actor_learner.config.network import parse_service_addresses
    address = parse_service_addresses(config.service_addresses).get("variables", "")
    return bool(address) and not is_loopback(address.rpartition(":")[0].strip("[]"))


def launch_credentials(config: SAOConfig, auth_token: Optional[str] = None,
                       environ: Optional[Mapping[str, str]] = None) -> Credentials:
    """The secrets of a launch of `config` (ConfigError naming the variable to set when a split
    launch lacks one, or when the learner token equals the auth token)."""
    environ = os.environ if environ is None else environ
    auth = check_launch_security(config, auth_token)
    runs = config.section(NetworkConfig).runs
    learner_token = _secret(environ, LEARNER_TOKEN_ENV, runs("learner") != runs("variables"),
                            "the learner and the variable server", 16)
    if learner_token == auth:
        raise ConfigError(f"${LEARNER_TOKEN_ENV} equals the auth token: actors hold the auth "
                          "token, and the learner token is what keeps them from publishing "
                          "weights or reporting progress; give it a value of its own")
    rollout_secret = _secret(environ, ROLLOUT_SECRET_ENV, runs("learner") != runs("actor"),
                             "the actors and the learner", 32)
    return Credentials(auth, learner_token, rollout_secret)


def _secret(environ: Mapping[str, str], name: str, split: bool, between: str,
            random_bytes: int) -> str:
    value = environ.get(name, "")
    if value:
        if len(value) < MIN_AUTH_TOKEN_CHARS:
            raise ConfigError(f"${name} has {len(value)} characters: use at least "
                              f"{MIN_AUTH_TOKEN_CHARS} random ones (e.g. `python -c 'import "
                              "secrets; print(secrets.token_hex(16))'`)")
        return value
    if split:
        raise ConfigError(f"this launch runs only one of {between} (--groups): they must share "
                          f"a secret, so set ${name} to the same random value (at least "
                          f"{MIN_AUTH_TOKEN_CHARS} characters) in the environment of both "
                          "launches; not on a command line, where other users can read it")
    return secrets.token_hex(random_bytes)
