"""The run configuration's network section: transport security and launches split over hosts.

A program can run on several hosts as several launches of `programs/sao.py`, one per host, each
running some of the program's groups (`groups`) and reaching the services it does not run at
the addresses given (`service_addresses`), e.g. replay, variables and the learner on one host
and the actors on another. `check_transport` relates these fields to the bind host and TLS
fields of `LaunchConfig`: a variable server on a non-loopback address needs TLS, and so does a
client of a remote one, unless `insecure_transport` accepts clear text on a trusted network.

Only the standard library is imported here (the launcher validates configs without torch).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, Tuple

from sao_actor_learner.config.sections import PROGRAM_GROUPS, Fail, Section, option
from sao_actor_learner.launch.addresses import is_loopback

# Services a launch may reach on another host, and which groups need each of them.
REMOTE_SERVICES = ("replay", "variables")
SERVICE_USERS = {"replay": ("learner", "actor"), "variables": ("learner", "actor", "evaluator")}


@dataclasses.dataclass(frozen=True)
class NetworkConfig(Section):
    """Transport security and launches split over hosts."""
    insecure_transport: bool = option(
        False, "Allow a non-loopback --bind_host (or a remote variable server) without TLS: "
        "the auth and learner tokens then cross the network in clear text. Only for a network "
        "you trust; logged as a warning.")
    tls_ca: str = option("", "PEM certificate(s) the variable server's clients trust (default: "
                         "--tls_cert). A launch that only reaches a remote variable server "
                         "(its --groups leave out variables) needs this one file, not the key.")
    groups: Tuple[str, ...] = option((), "Run only these groups of the program in this launch "
                                     "(one launch per host), e.g. replay,variables,learner on "
                                     "one host and actor on another; empty: every group.")
    service_addresses: Tuple[str, ...] = option(
        (), "GROUP=HOST:PORT of each service this launch uses but does not run (replay, "
        "variables), e.g. replay=10.0.0.1:41000,variables=10.0.0.1:41001: the addresses in the "
        "nodes.json of the launch that runs them.")
    first_actor_id: int = option(0, "The id of this launch's first actor (the others follow): "
                                 "give the actors of each host ids of their own.")

    def check(self, fail: Fail) -> None:
        for group in self.groups:
            if group not in PROGRAM_GROUPS:
                fail(f"groups contains {group!r}: must name groups of the program "
                     f"({', '.join(PROGRAM_GROUPS)})")
        try:
            remote = parse_service_addresses(self.service_addresses)
        except ValueError as e:
            fail(str(e))
        for group in remote:
            if self.runs(group):
                fail(f"service_addresses names {group!r}, which this launch runs itself "
                     f"(groups={','.join(self.groups) or 'all'}); drop one of the two")
        if self.first_actor_id < 0:
            fail(f"first_actor_id={self.first_actor_id}: must be >= 0")
        if self.tls_ca and not os.path.isfile(self.tls_ca):
            fail(f"tls_ca={self.tls_ca!r}: no such file (a PEM file)")

    def runs(self, group: str) -> bool:
        """Whether this launch runs `group` (every group when `groups` is empty)."""
        return not self.groups or group in self.groups


def parse_service_addresses(entries) -> Dict[str, str]:
    """{group: "host:port"} from entries "GROUP=HOST:PORT" (GROUP one of REMOTE_SERVICES)."""
    out: Dict[str, str] = {}
    for entry in entries:
        group, _, address = str(entry).partition("=")
        host, _, port = address.rpartition(":")
        if group not in REMOTE_SERVICES or not host or not port.isdigit() or \
                not 0 < int(port) < 65536:
            raise ValueError(f"service_addresses entry {entry!r}: must be GROUP=HOST:PORT with "
                             f"GROUP one of {', '.join(REMOTE_SERVICES)}, e.g. "
                             "variables=10.0.0.1:41001")
        if group in out:
            raise ValueError(f"service_addresses names {group!r} twice")
        out[group] = address
    return out


def check_transport(config, fail: Fail) -> None:
    """The checks across `NetworkConfig` and the bind/TLS fields of `LaunchConfig` (and
    learners): every service a launched group uses is run here or given an address; a variable
    server bound beyond loopback has TLS, and a client of a remote one trusts a certificate,
    unless `insecure_transport`."""
    runs = config.section(NetworkConfig).runs
    remote = parse_service_addresses(config.service_addresses)
    if config.groups and config.launch == "ray":
        fail(f"groups={','.join(config.groups)} with launch='ray': a Ray cluster places every "
             "group itself across its machines; drop --groups (it is for local_mp launches, one "
             "per host)")
    if config.groups and not any(runs(g) for g in ("learner", "actor", "evaluator")):
        fail(f"groups={','.join(config.groups)}: a launch needs a learner, actor or evaluator "
             "group to run (services alone would have nothing to wait for)")
    for service, users in SERVICE_USERS.items():
        needed_by = [g for g in users if runs(g) and (g != "evaluator" or
                                                     config.evaluator in ("node", "record"))]
        if needed_by and not runs(service) and service not in remote:
            verb = "needs" if len(needed_by) == 1 else "need"
            fail(f"groups={','.join(config.groups)}: {', '.join(needed_by)} {verb} the {service} "
                 f"service, which this launch does not run; give its address as "
                 f"--service_addresses={service}=HOST:PORT (from the nodes.json of the launch "
                 f"that runs it) or add {service} to --groups")
    if config.learners > 1 and runs("learner") != runs("learner_store"):
        fail(f"learners={config.learners} with groups={','.join(config.groups)}: the learner "
             "ranks and their learner_store must run in the same launch")
    if config.insecure_transport:
        return
    if runs("variables") and not is_loopback(config.bind_host) and not config.tls_cert:
        fail(f"bind_host={config.bind_host!r} without TLS: the variable server would receive "
             "the auth and learner tokens in clear text, readable by anyone on the network "
             "path; give --tls_cert and --tls_key (a certificate for that address), or pass "
             "--insecure_transport on a network you trust")
    address = remote.get("variables", "")
    if address and not is_loopback(address.rpartition(":")[0]) and \
            not (config.tls_ca or config.tls_cert):
        fail(f"service_addresses variables={address} without TLS: the auth token (and the "
             "learner's token) would cross the network in clear text; give --tls_ca, the "
             "certificate the variable server presents (or its CA's), or pass "
             "--insecure_transport on a network you trust")
