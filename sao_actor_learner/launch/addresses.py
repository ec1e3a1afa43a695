"""Service addresses: free ports, the bind-host rules, and what a handle's address resolves to.

Guarantees:
- `free_ports(n, host)` returns n distinct ports that were free on `host` at the time of the
  call (bound together, then released: a port can still be taken by someone else before the
  service binds it).
- A service bound to a loopback host (an IP literal in 127.0.0.0/8, "::1" (bracketed or not),
  or exactly "localhost"; a name such as "127.example.org" is not one) is reached at 127.0.0.1; bound to a wildcard ("0.0.0.0", "::", "") it is reached at 127.0.0.1 from its
  own machine and at the machine's address from elsewhere; bound to an interface, at that
  interface.
- Addresses are "host:port", with IPv6 hosts in brackets ("[::1]:5000").

Pure standard library.
"""
from __future__ import annotations

import ipaddress
import socket
from typing import List, Tuple

__all__ = ["LOOPBACK_HOSTS", "WILDCARD_HOSTS", "is_loopback", "is_wildcard",
           "local_service_host", "advertised_host", "probe_host", "bracket", "join_address",
           "split_address", "port_of", "free_ports", "port_open"]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


def is_loopback(host: str) -> bool:
    """Whether binding (or dialling) `host` stays on this machine: an IP literal in 127.0.0.0/8,
    ::1 (bracketed or not), or exactly "localhost". A DNS name that merely starts with "127."
    (e.g. "127.attacker.example") resolves wherever its owner likes, so it is not loopback."""
    if host == "localhost":
        return True
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        address = ipaddress.ip_address(literal)
    except ValueError:
        return False
    if address.version == 4:
        return address in ipaddress.ip_network("127.0.0.0/8")
    return address == ipaddress.IPv6Address("::1")


def is_wildcard(host: str) -> bool:
    """Whether binding `host` listens on every interface of the machine."""
    return host in WILDCARD_HOSTS


def local_service_host(bind_host: str) -> str:
    """The host that reaches a service bound to `bind_host` from this machine."""
    if is_loopback(bind_host) or is_wildcard(bind_host):
        return "127.0.0.1"
    return bind_host


def advertised_host(bind_host: str, machine_host: str) -> str:
    """The host other nodes dial for a service bound to `bind_host` on the machine whose address
    is `machine_host`: 127.0.0.1 for a loopback bind, the machine for a wildcard bind, else
    the bound interface."""
    if is_loopback(bind_host):
        return "127.0.0.1"
    if is_wildcard(bind_host):
        return machine_host
    return bind_host


def probe_host(bind_host: str, host: str) -> str:
    """The host a readiness probe on the service's own machine dials for address host `host`."""
    if host == "127.0.0.1" or is_wildcard(bind_host):
        return "127.0.0.1"
    return host


def bracket(host: str) -> str:
    """`host` as it appears before ":port" (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def join_address(host: str, port: int) -> str:
    return f"{bracket(host)}:{int(port)}"


def split_address(address: str) -> Tuple[str, int]:
    """("host", port) of "host:port" (brackets of an IPv6 host removed)."""
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def port_of(address: str) -> int:
    return split_address(address)[1]


def free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """n distinct free TCP ports on `host` (bound together, then released)."""
    socks = []
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        for _ in range(n):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind((host.strip("[]"), 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether `host:port` accepts a TCP connection now."""
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False
