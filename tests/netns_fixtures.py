"""Two "hosts" on one machine: two Linux network namespaces joined by a veth pair.

Each namespace has its own interfaces, routes and ports (its own loopback too); the pair gives
them private addresses only this machine sees, and no traffic leaves the machine. Processes run
in a namespace with `ip netns exec NAME ...`. Needs root (or CAP_NET_ADMIN) and the `ip` and
`ss` commands; `Hosts.create` raises HostsUnavailable with the reason otherwise.

Run as a script, this file is the probe test_two_hosts.py runs on the actor's host: it calls the
variable server with right and wrong credentials and prints what each call got, as JSON.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Sequence, Tuple

SUBNET = "10.231.7"


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Hosts:
    """Namespaces `<prefix>a` (address SUBNET.1) and `<prefix>b` (SUBNET.2), up to `remove()`."""

    def __init__(self, prefix: str) -> None:
        self.names = (f"{prefix}a", f"{prefix}b")
        self.addresses = (f"{SUBNET}.1", f"{SUBNET}.2")
        self._made: List[str] = []

    @classmethod
    def create(cls, prefix: str) -> "Hosts":
        hosts = cls(prefix)
        try:
            hosts._create()
        except BaseException:
            hosts.remove()
            raise
        return hosts

    def _create(self) -> None:
        for name in self.names:
            made = _ip("netns", "add", name, check=False)
            if made.returncode != 0:
                raise HostsUnavailable(f"`ip netns add {name}` failed: {made.stderr.strip()} "
                                       "(network namespaces need root or CAP_NET_ADMIN)")
            self._made.append(name)
        a, b = (f"{n[:14]}v" for n in self.names)      # interface names: at most 15 characters
        try:
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            for name, veth, address in zip(self.names, (a, b), self.addresses):
                _ip("link", "set", veth, "netns", name)
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", veth)
                _ip("-n", name, "link", "set", veth, "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            raise HostsUnavailable(f"`{' '.join(e.cmd)}` failed: {e.stderr.strip()} (a veth "
                                   "pair between namespaces is needed)") from None

    def command(self, host: int, argv: Sequence[str]) -> List[str]:
        """`argv` run in namespace `host` (0 or 1)."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def listening(self, host: int) -> List[Tuple[str, int]]:
        """(local address, port) of every listening TCP socket in namespace `host` (`ss -ltn`)."""
        out = subprocess.run(self.command(host, ["ss", "-ltnH"]), capture_output=True,
                             text=True, check=True).stdout
        found = []
        for line in out.splitlines():
            local = line.split()[3]                      # State Recv-Q Send-Q Local Peer
            address, _, port = local.rpartition(":")
            address = address.strip("[]")
            if address.startswith("::ffff:"):               # IPv4 on an IPv6 socket (gRPC)
                address = address[len("::ffff:"):]
            found.append((address, int(port)))
        return found

    def remove(self) -> None:
        """Kills what still runs in the namespaces (only this test's processes can be there),
        then deletes them (and with them the veth pair)."""
        for name in self._made:
            pids = _ip("netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                _ip("netns", "pids", n, check=False).stdout.strip() for n in self._made):
            time.sleep(0.1)
        for name in self._made:
            _ip("netns", "del", name, check=False)
        self._made = []


def probe(address: str, cert_path: str, wrong_cert_path: str) -> Dict[str, str]:
    """What each call to the variable server at `address` gets: "ok" or the gRPC code's name.
    The tokens come from the environment ($SAO_AUTH_TOKEN, $SAO_LEARNER_TOKEN)."""
    from sao_actor_learner.variables import (PublishError, VariableClient, VariableClientError,
                                             VariablePublisher)
    auth, learner = os.environ["SAO_AUTH_TOKEN"], os.environ["SAO_LEARNER_TOKEN"]
    with open(cert_path, "rb") as f:
        cert = f.read()
    with open(wrong_cert_path, "rb") as f:
        wrong = f.read()

    def outcome(call) -> str:
        try:
            call()
            return "ok"
        except (VariableClientError, PublishError) as e:
            return e.code.name if e.code is not None else str(e)

    def client(**kwargs):
        return VariableClient(address, rpc_timeout_s=5, **kwargs)

    return {
        "right_token_and_certificate": outcome(
            lambda: client(auth_token=auth, tls_root_cert=cert).latest_info(timeout_s=10)),
        "wrong_token": outcome(
            lambda: client(auth_token="x" * 32, tls_root_cert=cert).latest_info(timeout_s=10)),
        "wrong_certificate": outcome(
            lambda: client(auth_token=auth, tls_root_cert=wrong).latest_info(timeout_s=5)),
        "no_tls": outcome(lambda: client(auth_token=auth).latest_info(timeout_s=5)),
        "actor_credential_publishes": outcome(
            lambda: VariablePublisher(address, auth, auth_token=auth, tls_root_cert=cert)
            .publish(10 ** 6, b"forged")),
        "actor_credential_reports_progress": outcome(
            lambda: VariablePublisher(address, auth, auth_token=auth, tls_root_cert=cert)
            .report_progress(10 ** 6, 0, 0, 99, {0: (10 ** 6, [])})),
        "learner_token_without_auth_token": outcome(
            lambda: VariablePublisher(address, learner, tls_root_cert=cert)
            .report_progress(10 ** 6, 0, 0, 99, {0: (10 ** 6, [])})),
    }


if __name__ == "__main__":
    print(json.dumps(probe(*sys.argv[1:4])))
