"""Keeping Reverb off non-loopback interfaces (issue 26, finding 3; launch/loopback.py).

Reverb 0.14's server listens on "[::]:<port>" whatever the program's --bind_host. Under local_mp
with a loopback bind_host the replay node gets a bind() interposer (LD_PRELOAD) that turns the
wildcard into loopback. Checked on a real replay node process: the kernel's table of listening
sockets shows the port on loopback only (and on every interface without the interposer, the
control), a client reaches it on 127.0.0.1, and this machine's other addresses are refused.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import launch_fixtures as fx  # noqa: E402

from sao_actor_learner import launch as lp  # noqa: E402
from sao_actor_learner.launch.addresses import port_of  # noqa: E402
from sao_actor_learner.launch.loopback import (WILDCARD_GROUPS, local_mp_guards,  # noqa: E402
                                               loopback_group_env, loopback_preload)

pytestmark = pytest.mark.timeout(300)


def make_replay(queue_capacity: int, port: int):
    from sao_actor_learner.replay.tables import ReplayServer
    return ReplayServer(queue_capacity, port=port)


def _listening(port: int):
    """The local addresses of the sockets listening on TCP `port`, from /proc/net/tcp{,6}."""
    found = []
    for path, family in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6)):
        with open(path) as f:
            rows = f.read().splitlines()[1:]
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            host, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:      # 0A: LISTEN
                continue
            raw = bytes.fromhex(host)   # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(ipaddress.ip_address(raw))
    return found


def _other_ipv4_addresses():
    """This machine's IPv4 addresses outside loopback (ioctl SIOCGIFADDR per interface)."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            address = ipaddress.ip_address(packed[20:24])
            if not address.is_loopback:
                out.append(str(address))
    return out


def test_group_env_gets_the_interposer_only_for_loopback_programs(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    placed = {"replay": {"SAO_CPU_SET": "0"}, "actor": {"SAO_CPU_SET": "1"}}
    assert loopback_group_env("0.0.0.0", placed) == placed
    assert loopback_group_env("10.1.2.3", {}) == {}
    path = loopback_preload()
    if path is None:
        pytest.skip("no C compiler here: the interposer cannot be built")
    env = loopback_group_env("127.0.0.1", placed)
    assert env["replay"] == {"SAO_CPU_SET": "0", "LD_PRELOAD": f"{path} /opt/other.so"}
    assert env["actor"] == {"SAO_CPU_SET": "1"} and set(WILDCARD_GROUPS) <= set(env)
    assert placed["replay"] == {"SAO_CPU_SET": "0"}             # the caller's dict is untouched
    # What builder.launch_options adds: heartbeats and this environment, under local_mp only.
    assert local_mp_guards("ray", "127.0.0.1", 60.0, {"group_env": placed}) == {}
    assert local_mp_guards("local_mp", "127.0.0.1", 60.0, {"group_env": placed}) == \
        {"node_timeout_s": 60.0, "group_env": env}


def test_without_a_compiler_nothing_changes_but_a_warning(monkeypatch, tmp_path, caplog):
    import sao_actor_learner.launch.loopback as loopback
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(loopback.sysconfig, "get_config_var", lambda name: "no-such-cc")
    monkeypatch.setattr(loopback, "_built", {})
    assert loopback.loopback_preload() is None
    assert loopback_group_env("127.0.0.1", {"actor": {"A": "1"}}) == {"actor": {"A": "1"}}
    assert "could not build the loopback bind() interposer with 'no-such-cc'" in caplog.text


@pytest.mark.parametrize("loopback", [True, False], ids=["interposed", "control"])
def test_a_replay_node_listens_on_loopback_only(tmp_path, loopback):
    pytest.importorskip("reverb")
    group_env = loopback_group_env("127.0.0.1", {}) if loopback else {}
    if loopback and not group_env:
        pytest.skip("no C compiler here: the interposer cannot be built")
    program = lp.Program("exposure")
    with program.group("replay"):
        handle = program.add_node(lp.ServiceNode(make_replay, 4))
    with program.group("idle"):       # a program needs a PyNode; it waits to be stopped
        program.add_node(lp.PyNode(fx.make_forever))
    with lp.launch(program, run_dir=str(tmp_path), notice_s=5, group_env=group_env):
        port = port_of(handle.address)
        addresses = _listening(port)
        assert addresses, f"nothing listens on {port}"
        from sao_actor_learner.replay.client import connect
        assert connect(f"127.0.0.1:{port}").table_status("rollouts").current_size == 0
        others = _other_ipv4_addresses()
        reachable = []
        for host in others:
            with socket.socket() as s:
                s.settimeout(2)
                if s.connect_ex((host, port)) == 0:
                    reachable.append(host)
    if loopback:
        assert all(a.is_loopback or (a.version == 6 and a.ipv4_mapped is not None and
                                     a.ipv4_mapped.is_loopback) for a in addresses), addresses
        assert reachable == []
    else:   # Reverb's own bind: every interface
        assert any(a.is_unspecified for a in addresses), addresses
        assert reachable == others
