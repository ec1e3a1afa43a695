"""Issue 26, finding 4: no tokens in clear text beyond loopback, a learner credential actors do
not hold, and progress reports bounded by what actors were admitted to start.

Real gRPC on 127.0.0.1 (TLS with certificates made by the openssl command), the real program
builder and `programs/sao.py`; no mocks. The same rules across two network namespaces:
test_two_hosts.py."""
from __future__ import annotations

import logging
import os
import pickle
import random
import shutil
import subprocess
import sys

import grpc
import pytest

from sao_actor_learner.builder import make_program
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.credentials import (LEARNER_TOKEN_ENV, ROLLOUT_SECRET_ENV,
                                           launch_credentials)
from sao_actor_learner.variables import (PublishError, VariableClient, VariableClientError,
                                         VariablePublisher, VariableServer)
from sao_actor_learner.variables.progress import beyond_admitted, make_progress

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUTH = "actor-credential-0123456789"
LEARNER = "learner-credential-9876543210"
pytestmark = pytest.mark.timeout(120)
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None,
                                   reason="needs the openssl command to make certificates")


def self_signed(directory, name, san="IP:127.0.0.1,DNS:localhost"):
    """(certificate path, key path) of a self-signed certificate for `san`."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", f"/CN={name}", "-addext", f"subjectAltName={san}",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


# ------------------------------------------------------------------------------ TLS
@needs_openssl
def test_a_non_loopback_bind_needs_tls_unless_insecure_transport(tmp_path, caplog):
    with pytest.raises(ValueError, match="bind_host='0.0.0.0' without TLS.*--insecure_transport"):
        VariableServer(host="0.0.0.0", auth_token=AUTH, publisher_token=LEARNER)
    with pytest.raises(ConfigError, match="bind_host='0.0.0.0' without TLS"):
        SAOConfig(bind_host="0.0.0.0")
    split = dict(groups=("actor",), service_addresses=("replay=10.9.0.1:4000",
                                                       "variables=10.9.0.1:4001"))
    with pytest.raises(ConfigError, match="variables=10.9.0.1:4001 without TLS.*--tls_ca"):
        SAOConfig(**split)                                  # a client of a remote server too
    cert, key = self_signed(tmp_path, "server")
    SAOConfig(**split, tls_ca=str(cert))                    # the certificate alone: no key
    SAOConfig(bind_host="0.0.0.0", tls_cert=str(cert), tls_key=str(key))

    # The program refuses before anything starts (run_dir untouched), naming the way out.
    env = {**os.environ, "SAO_AUTH_TOKEN": AUTH}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "programs", "sao.py"),
                           "--bind_host=0.0.0.0", f"--run_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0 and "without TLS" in proc.stderr + proc.stdout
    assert "--insecure_transport" in proc.stderr + proc.stdout
    assert not (tmp_path / "run").exists()

    # TLS on a wildcard bind: a client that trusts the certificate gets in, a plain one cannot.
    with VariableServer(host="0.0.0.0", auth_token=AUTH, publisher_token=LEARNER,
                        tls_cert_chain=cert.read_bytes(), tls_private_key=key.read_bytes()
                        ) as srv:
        local = f"127.0.0.1:{srv.port}"
        VariablePublisher(local, LEARNER, auth_token=AUTH,
                          tls_root_cert=cert.read_bytes()).publish(0, b"w0")
        assert VariableClient(local, auth_token=AUTH, tls_root_cert=cert.read_bytes()
                              ).update_and_wait(timeout_s=10) == 0
        with pytest.raises(VariableClientError) as e:
            VariableClient(local, auth_token=AUTH, rpc_timeout_s=3).latest_info(timeout_s=3)
        assert e.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

    # Explicitly insecure: allowed, and loud.
    with caplog.at_level(logging.WARNING):
        with VariableServer(host="0.0.0.0", auth_token=AUTH, publisher_token=LEARNER,
                            insecure_transport=True) as srv:
            assert VariableClient(f"127.0.0.1:{srv.port}", auth_token=AUTH).admit("0", 1) == 1
    assert "INSECURE TRANSPORT" in caplog.text


# ------------------------------------------------------------------------------ credentials
def _node_bytes(program, group):
    return b"".join(pickle.dumps((n.args, n.kwargs)) for n in program.groups[group])


def test_the_learner_credential_is_its_own_and_actors_never_hold_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SAO_AUTH_TOKEN", AUTH)
    monkeypatch.setenv(LEARNER_TOKEN_ENV, LEARNER)
    monkeypatch.delenv(ROLLOUT_SECRET_ENV, raising=False)
    config = SAOConfig(run_dir=str(tmp_path / "run"))
    program = make_program(config)
    for group in ("variables", "learner"):                  # from the environment, not made
        assert LEARNER.encode() in _node_bytes(program, group), group
    for group in ("actor", "evaluator", "replay"):          # what actors hold: no learner token
        assert LEARNER.encode() not in _node_bytes(program, group), group
    assert AUTH.encode() in _node_bytes(program, "actor")
    assert LEARNER not in config.to_json() and AUTH not in repr(launch_credentials(config))
    # The rollout secret: the learner's alone; each actor holds its own derived key.
    monkeypatch.setenv(ROLLOUT_SECRET_ENV, "e" * 64)
    signing = make_program(config.replace(num_actors=2))
    assert b"e" * 64 in _node_bytes(signing, "learner")
    assert b"e" * 64 not in _node_bytes(signing, "actor")
    keys = [n.kwargs["rollout_key"] for n in signing.groups["actor"]]
    assert len(set(keys)) == 2 and all(len(k) == 64 for k in keys)
    monkeypatch.delenv(ROLLOUT_SECRET_ENV)

    monkeypatch.setenv(LEARNER_TOKEN_ENV, AUTH)
    with pytest.raises(ConfigError, match="equals the auth token"):
        make_program(config)
    monkeypatch.setenv(LEARNER_TOKEN_ENV, "short")
    with pytest.raises(ConfigError, match=f"{LEARNER_TOKEN_ENV} has 5 characters"):
        make_program(config)

    # A launch split over hosts must be given the secrets it shares with the other launch.
    monkeypatch.delenv(LEARNER_TOKEN_ENV)
    learner_host = config.replace(groups=("replay", "learner"), service_addresses=(
        "variables=127.0.0.1:4001",))
    with pytest.raises(ConfigError, match=f"set \\${LEARNER_TOKEN_ENV}"):
        make_program(learner_host)
    monkeypatch.setenv(LEARNER_TOKEN_ENV, LEARNER)
    with pytest.raises(ConfigError, match=f"set \\${ROLLOUT_SECRET_ENV}"):
        make_program(learner_host)                          # its actors run elsewhere
    monkeypatch.setenv(ROLLOUT_SECRET_ENV, "r" * 64)
    with pytest.raises(ConfigError, match="set \\$SAO_RUN_ID"):
        make_program(learner_host)                          # and the run id (run_identity.py)
    monkeypatch.setenv("SAO_RUN_ID", "s" * 32)
    assert set(make_program(learner_host).groups) == {"replay", "learner"}


def test_the_actor_credential_cannot_publish_or_report_progress():
    with VariableServer(auth_token=AUTH, publisher_token=LEARNER, batch_size=2) as srv:
        learner = VariablePublisher(srv.address, LEARNER, auth_token=AUTH)
        learner.publish(0, b"w0")
        actor = VariableClient(srv.address, auth_token=AUTH)
        assert actor.admit("0", 2) == 2
        for pub in ("", AUTH):                              # none, or the one actors hold
            impostor = VariablePublisher(srv.address, pub, auth_token=AUTH)
            with pytest.raises(PublishError) as e:
                impostor.publish(1, b"forged")
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(VariableClientError) as e:
                impostor.report_progress(0, 0, 0, 1, {0: (2, [])})
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert srv.progress() is None and srv.latest().version == 0   # nothing moved
        assert actor.update_and_wait(timeout_s=10) == 0 and actor.params == b"w0"
        assert learner.report_progress(0, 0, 2, 0, {0: (2, [])}).credit == 0


# ------------------------------------------------------------------------------ progress bound
def test_a_progress_report_may_not_claim_more_than_was_admitted(tmp_path):
    with VariableServer(publisher_token=LEARNER, batch_size=4, max_staleness=1,
                        state_path=str(tmp_path / "state.json")) as srv:
        learner, actor = VariablePublisher(srv.address, LEARNER), VariableClient(srv.address)
        assert actor.admit("0", 3) == 3 and actor.admit("1", 2) == 2     # 5 rollouts admitted
        refused = {
            "watermark beyond the grants": dict(acks={0: (4, [])}),
            "a seq beyond the grants": dict(acks={1: (0, [2])}),
            "an actor never admitted": dict(acks={7: (1, [])}),
            "a credit beyond every grant": dict(dropped_total=6),
            "more trained than admitted": dict(trained_total=6),
        }
        for why, fields in refused.items():
            args = {"version": 1, "dropped_total": 0, "trained_total": 0, "acks": {},
                    **fields}
            with pytest.raises(VariableClientError) as e:
                learner.report_progress(**args)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, why
            assert "ReportProgress refused" in str(e.value), why
        assert srv.progress() is None and srv.stats()["dropped_total"] == 0
        # At the bound: accepted; the server kept serving throughout.
        result = learner.report_progress(1, 1, 4, 0, {0: (3, []), 1: (0, [1])})
        assert result.credit == 1 and actor.acknowledged(0).watermark == 3
        assert actor.acknowledged(1).seqs == (1,)
        # A publish's credit is capped at what was admitted, so admission cannot be lifted.
        learner.publish(0, b"w0", dropped_total=10 ** 9)
        assert srv.stats()["dropped_total"] == 5
        assert actor.admit_details("2", 100).capacity == (0 + 1 + 1) * 4 + 5


def _beyond_admitted_slowly(acks, dropped, trained, granted):
    """The rule spelled out: every seq a report acknowledges (all below each watermark, each
    listed one) was admitted to its actor, and no total exceeds all the grants."""
    for actor, (watermark, seqs) in acks.items():
        for seq in list(range(watermark)) + list(seqs):
            if seq >= granted.get(actor, 0):
                return True
    return max(dropped, trained) > sum(granted.values())


def test_beyond_admitted_matches_the_rule_spelled_out():
    rng = random.Random(26)
    for _ in range(2000):
        granted = {a: rng.randrange(0, 6) for a in range(3) if rng.random() < 0.8}
        acks = {a: (rng.randrange(0, 7), [rng.randrange(0, 8) for _ in range(rng.randrange(3))])
                for a in range(4) if rng.random() < 0.5}
        dropped, trained = rng.randrange(0, 12), rng.randrange(0, 12)
        report = make_progress(1, dropped, trained, 0, acks)
        why = beyond_admitted(report, lambda a: granted.get(a, 0), sum(granted.values()))
        assert (why is not None) == _beyond_admitted_slowly(acks, dropped, trained, granted), \
            (granted, acks, dropped, trained, why)
