"""Issue 26, finding 9: a run over two hosts for real.

Two network namespaces joined by a veth pair are two hosts (netns_fixtures.py): host A runs
replay, the variable server and the learner (`programs/sao.py --groups=replay,variables,learner
--bind_host=<A's address>` with TLS), host B one actor (`--groups=actor --service_addresses=...
--tls_ca=...`), each launch with its secrets in its environment, none on a command line. The
test checks that training works across them (every step trained on rollouts B made, weights
reaching B over gRPC with TLS), that wrong credentials are refused from B (a wrong token, a
certificate B does not trust, no TLS, the actor's token used to publish or report progress), and
what listens where (`ss -ltn` in each namespace). Skipped, with the reason, where namespaces
cannot be made (not root) or `ip`, `ss` or `openssl` are missing.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from netns_fixtures import Hosts, HostsUnavailable
from sao_actor_learner.actors.spool import read_ledger
from sao_actor_learner.observers import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUTH, LEARNER, ROLLOUT = "actor-token-" + "a" * 20, "learner-token-" + "b" * 20, "c" * 64
RUN_ID = "two-hosts-" + "d" * 22   # both launches share the run id (run_identity.py)
MAX_STEPS, BATCH = 3, 8
pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def hosts():
    missing = [c for c in ("ip", "ss", "openssl") if shutil.which(c) is None]
    if missing:
        pytest.skip(f"needs the {', '.join(missing)} command(s)")
    try:
        made = Hosts.create(f"sao{os.getpid()}")          # a pid has at most 7 digits
    except HostsUnavailable as e:
        pytest.skip(f"two hosts need network namespaces: {e}")
    try:
        yield made
    finally:
        made.remove()


def _certificate(directory, name, ip):
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", f"/CN={name}", "-addext", f"subjectAltName=IP:{ip}",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def _launch(hosts, host, flags, run_dir, env):
    """programs/sao.py in namespace `host`, its own session (killed as a group on failure)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{run_dir.name}.out", "w")
    argv = [sys.executable, os.path.join(REPO, "programs", "sao.py"), "--progress=false",
            f"--run_dir={run_dir}", *flags]
    return subprocess.Popen(hosts.command(host, argv), stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=REPO, start_new_session=True)


def _services(run_dir, timeout_s=120):
    """{label: address} of the running services in run_dir/nodes.json."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(run_dir / "nodes.json") as f:
                nodes = json.load(f)["nodes"]
        except (OSError, ValueError, KeyError):
            nodes = []
        services = {n["label"]: n["address"] for n in nodes if n.get("address")}
        learner = [n for n in nodes if n["label"] == "learner"]
        if {"replay", "variables"} <= set(services) and learner and \
                learner[0]["status"] == "running":            # PyNodes start once services serve
            return services
        time.sleep(0.2)
    raise AssertionError(f"host A's services did not come up; {run_dir}.out:\n"
                         + (run_dir.parent / f"{run_dir.name}.out").read_text()[-3000:])


def _finish(proc, what, timeout_s):
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"{what} did not finish within {timeout_s} s")


def test_training_across_two_hosts_with_tls_and_tokens(hosts, tmp_path, warm_start):
    a_ip, b_ip = hosts.addresses
    cert, key = _certificate(tmp_path, "host_a", a_ip)
    wrong, _ = _certificate(tmp_path, "stranger", a_ip)   # same name, another key: untrusted
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("SAO_")}
    base_env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    # Each host's environment holds only the secrets its nodes use (credentials.py).
    env_a = {**base_env, "SAO_AUTH_TOKEN": AUTH, "SAO_LEARNER_TOKEN": LEARNER,
             "SAO_ROLLOUT_SECRET": ROLLOUT, "SAO_RUN_ID": RUN_ID}
    env_b = {**base_env, "SAO_AUTH_TOKEN": AUTH, "SAO_ROLLOUT_SECRET": ROLLOUT,
             "SAO_RUN_ID": RUN_ID}
    common = [f"--model={warm_start}", f"--max_steps={MAX_STEPS}", f"--batch_size={BATCH}",
              "--actor_batch=4", "--max_staleness=1", "--num_actors=1", "--evaluator=off",
              "--replay_checkpoints=false", "--weight_transport=grpc"]
    run_a, run_b = tmp_path / "host_a", tmp_path / "host_b"
    a = _launch(hosts, 0, [*common, "--groups=replay,variables,learner", f"--bind_host={a_ip}",
                           f"--tls_cert={cert}", f"--tls_key={key}"], run_a, env_a)
    b = None
    try:
        services = _services(run_a)
        replay, variables = services["replay"], services["variables"]
        assert replay.startswith(f"{a_ip}:") and variables.startswith(f"{a_ip}:")

        # From host B, before any actor runs (the learner waits for rollouts meanwhile).
        probe = subprocess.run(hosts.command(1, [
            sys.executable, os.path.join(REPO, "tests", "netns_fixtures.py"), variables,
            str(cert), str(wrong)]), capture_output=True, text=True, env=env_a, timeout=120)
        assert probe.returncode == 0, probe.stderr[-3000:]
        got = json.loads(probe.stdout.splitlines()[-1])
        for no_connection in ("wrong_certificate", "no_tls"):   # the TLS handshake fails: the
            if got[no_connection] in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):   # client waits for a
                got[no_connection] = "no connection"                         # channel in vain
        assert got == {
            "right_token_and_certificate": "ok",
            "wrong_token": "UNAUTHENTICATED",
            "wrong_certificate": "no connection",
            "no_tls": "no connection",
            "actor_credential_publishes": "PERMISSION_DENIED",
            "actor_credential_reports_progress": "PERMISSION_DENIED",
            "learner_token_without_auth_token": "UNAUTHENTICATED",
        }

        listening_a = hosts.listening(0)   # A serves, its learner waits for B's rollouts
        b = _launch(hosts, 1, [*common, "--groups=actor", f"--tls_ca={cert}",
                               f"--service_addresses=replay={replay},variables={variables}",
                               "--service_timeout_s=20"], run_b, env_b)
        deadline = time.monotonic() + 120
        while not (run_b / "actor_0_stats.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        listening_b = hosts.listening(1)   # B's actor has made rollouts; A needs more of them
        assert b.poll() is None, "host B's launch ended before its actor could be looked at"

        for proc, run, limit_s in ((a, run_a, 150), (b, run_b, 60)):
            out = run.parent / f"{run.name}.out"
            assert _finish(proc, run.name, limit_s) == 0, out.read_text()[-3000:]
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    # What listens where: on A the variable server on A's veth address only, Reverb on every
    # interface (it takes no host; docs/OPERATIONS.md section 2); on B nothing at all.
    replay_port, variables_port = int(replay.rsplit(":", 1)[1]), int(variables.rsplit(":", 1)[1])
    assert (a_ip, variables_port) in listening_a
    assert [host for host, port in listening_a if port == variables_port] == [a_ip]
    assert {host for host, port in listening_a if port == replay_port} <= {"*", "0.0.0.0", "::"}
    assert {port for _, port in listening_a} == {replay_port, variables_port}, listening_a
    assert listening_b == [], listening_b

    # Training worked across the hosts: every step on a full batch, and host A runs no actor,
    # so every rollout it trained came from B's (whose spool logs what it made), made with
    # weights B fetched over gRPC: nothing staler than max_staleness=1 was trained, so the last
    # step (version 2) trained rollouts of versions B loaded after version 0.
    with open(run_a / "nodes.json") as f:
        assert {n["label"] for n in json.load(f)["nodes"]} == {"replay", "variables", "learner"}
    train = read_metrics(str(run_a), "train")
    assert [r["step"] for r in train] == list(range(1, MAX_STEPS + 1))
    assert all(r["batch_size"] == BATCH and r["staleness_max"] <= 1 for r in train)
    with open(run_a / "summary.json") as f:
        assert json.load(f)["rollouts_trained"] == MAX_STEPS * BATCH
    assert len(read_ledger(str(run_b / "spool" / "actor_0"))["completed"]) >= MAX_STEPS * BATCH
    with open(run_b / "actor_0_stats.json") as f:
        transport = json.load(f)["weight_transport_counters"]
    assert transport.get("grpc_loads", 0) >= 1 and transport.get("shm_loads", 0) == 0
    for log in (run_a.parent / "host_a.out", run_b.parent / "host_b.out", *run_a.glob("logs/*"),
                *run_b.glob("logs/*")):
        text = log.read_text(errors="replace")
        for secret in (AUTH, LEARNER, ROLLOUT):              # no secret in any log
            assert secret not in text, (log, secret[:8])
    assert LEARNER not in (run_b / "config.json").read_text()
