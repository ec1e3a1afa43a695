"""The service nodes of an SAO program: replay and the variable server, and the security and
shared-memory settings their clients share (builder.py wires them).

Each `make_*` runs inside its node's own process and imports what it needs lazily.
"""
from __future__ import annotations

import os
from typing import Optional

from sao_actor_learner.config import SAOConfig
from sao_actor_learner.run_dirs import (make_owned_dir, make_recorded_dir, replay_checkpoint_dir,
                                        variables_state_dir)

__all__ = ["make_replay_server", "make_variable_server", "tls_files",
           "variables_client_security", "server_keep_versions", "publisher_shm"]


def make_replay_server(config: SAOConfig, port: int = 0, run_dir: Optional[str] = None):
    """The replay node; with config.replay_checkpoints it restores the newest Reverb checkpoint
    in replay_checkpoint_dir when it starts and writes one periodically and when it stops."""
    from sao_actor_learner.replay import ReplayServer
    # Recorded in the run folder, not marked inside: Reverb's checkpointer deletes every file
    # there it did not write (run_dirs.py); a fresh run may clear it.
    checkpoint_dir = make_recorded_dir(replay_checkpoint_dir(config, run_dir),
                                       run_dir or config.run_dir) \
        if config.replay_checkpoints else None
    return ReplayServer(config.effective_queue_capacity, port=port, checkpoint_dir=checkpoint_dir,
                        checkpoint_every_s=config.replay_checkpoint_every_s if checkpoint_dir
                        else 0.0)


def tls_files(config: SAOConfig):
    """(certificate bytes, key bytes) of the variable server's TLS, or (None, None)."""
    if not config.tls_cert:
        return None, None
    from sao_actor_learner.variables.security import read_file_bytes
    return (read_file_bytes(config.tls_cert, "tls_cert"), read_file_bytes(config.tls_key,
                                                                         "tls_key"))


def variables_client_security(config: SAOConfig, auth_token: str) -> dict:
    """VariableClient / VariablePublisher keyword arguments for the auth token and TLS."""
    from sao_actor_learner.split_launch import trusted_certificate
    return {"auth_token": auth_token, "tls_root_cert": trusted_certificate(config)}


def server_keep_versions(config: SAOConfig) -> int:
    """Versions the variable server keeps fetchable by number: with forced staleness, every
    version a lag can reach back to (k, or max_staleness with a lag distribution) and two."""
    if config.forced_staleness < 0:
        return 2
    if config.forced_staleness_distribution != "constant":
        return config.max_staleness + 2
    return config.forced_staleness + 2


def publisher_shm(config: SAOConfig, run_dir: str) -> dict:
    """VariablePublisher keyword arguments for shared-memory publishes (none with
    weight_transport=grpc). The writer keeps one file more than the server keeps versions, so
    every version the server can still name has its file."""
    if config.weight_transport == "grpc":
        return {}
    return {"shm_dir": config.weight_shm_dir, "shm_run_name": os.path.basename(
        os.path.normpath(run_dir)) or "run", "shm_keep_versions": server_keep_versions(config) + 1}


def make_variable_server(config: SAOConfig, publisher_token: str, port: int = 0,
                         auth_token: str = "", run_dir: Optional[str] = None):
    from sao_actor_learner.variables import SafetensorsValidator, VariableServer
    from sao_actor_learner.variables.shm import writer_root
    forced = config.forced_staleness >= 0
    # Forced staleness k: admission lets actors start exactly one batch per version (eta 0), and
    # the server keeps the k older versions they generate with. It binds config.bind_host
    # (non-loopback needs the auth token), optional TLS, and every published version is
    # checked (names, dtypes, shapes pinned by version 0, finite values) before any client can
    # fetch it.
    cert, key = tls_files(config)
    # Shared-memory publishes may name files in the learner's writer directory only.
    shm_root = None if config.weight_transport == "grpc" else writer_root(config.weight_shm_dir)
    return VariableServer(port=port, batch_size=config.batch_size,
                          max_staleness=0 if forced else config.max_staleness,
                          admission_control=config.admission_control,
                          publisher_token=publisher_token,
                          keep_versions=server_keep_versions(config), shm_root=shm_root,
                          host=config.bind_host, auth_token=auth_token,
                          tls_cert_chain=cert, tls_private_key=key,
                          insecure_transport=config.insecure_transport,
                          validate_payload=SafetensorsValidator(),
                          state_path=os.path.join(make_owned_dir(variables_state_dir(
                              run_dir or config.run_dir)), "state.json"))

