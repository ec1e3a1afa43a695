"""Keeping strangers out of the variable server: auth token on every call, publisher token,
bind rules, payload validation, message size limits, TLS, and 1000+ malformed requests.
Real gRPC on 127.0.0.1, no mocks."""
from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys

import grpc
import numpy as np
import pytest
from safetensors.numpy import save as save_safetensors

from sao_actor_learner.builder import make_program
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.protos_gen import variables_pb2
from sao_actor_learner.variables import (AUTH_TOKEN_METADATA_KEY, PUBLISHER_TOKEN_METADATA_KEY,
                                         PublishError, SafetensorsValidator, VariableClient,
                                         VariableClientError, VariablePublisher, VariableServer)
from sao_actor_learner.variables.security import PayloadRejected, safetensors_manifest
from sao_actor_learner.variables.server import SERVICE_NAME

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUTH = "a" * 16 + "-shared-secret"
PUB = "publisher-secret"
BOTH = ((AUTH_TOKEN_METADATA_KEY, AUTH), (PUBLISHER_TOKEN_METADATA_KEY, PUB))
pytestmark = pytest.mark.timeout(120)


def weights(seed=0, scale=1.0, **changes):
    """safetensors bytes of a small fake model (the shape of a real state dict)."""
    rng = np.random.default_rng(seed)
    tensors = {"model.embed_tokens.weight": rng.normal(size=(16, 8)).astype(np.float32) * scale,
               "model.layers.0.mlp.up_proj.weight": rng.normal(size=(8, 8)).astype(np.float32),
               "lm_head.weight": rng.normal(size=(16, 8)).astype(np.float32)}
    for name, value in changes.items():
        name = name.replace("__", ".")
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    return save_safetensors(tensors)


@pytest.fixture
def server():
    srv = VariableServer(publisher_token=PUB, auth_token=AUTH, batch_size=2, max_staleness=1,
                         validate_payload=SafetensorsValidator(), bound_progress=False).start()
    yield srv
    srv.stop(grace_s=0.1)


def publisher(srv, auth=AUTH, pub=PUB):
    return VariablePublisher(srv.address, pub, auth_token=auth)


def client(srv, auth=AUTH, **kwargs):
    return VariableClient(srv.address, auth_token=auth, **kwargs)


def _chunks(version, payload, total=None, sha=None, last=True, size=1000):
    pieces = [payload[i:i + size] for i in range(0, len(payload), size)] or [b""]
    out = []
    for i, piece in enumerate(pieces):
        c = variables_pb2.PublishChunk(version=version, data=piece, format="safetensors")
        if i == 0:
            c.total_bytes = len(payload) if total is None else total
        if i == len(pieces) - 1 and last:
            c.last = True
            c.sha256 = hashlib.sha256(payload).hexdigest() if sha is None else sha
        out.append(c.SerializeToString())
    return out


# ------------------------------------------------------------------------------ auth token
def test_every_call_needs_the_auth_token(server):
    publisher(server).publish(0, weights(0))
    channel = grpc.insecure_channel(server.address)
    calls = {
        "LatestVersion": lambda md: channel.unary_unary(f"/{SERVICE_NAME}/LatestVersion")(
            b"", metadata=md, timeout=5),
        "FetchWeights": lambda md: list(channel.unary_stream(f"/{SERVICE_NAME}/FetchWeights")(
            variables_pb2.FetchRequest(version=-1).SerializeToString(), metadata=md, timeout=5)),
        "Admit": lambda md: channel.unary_unary(f"/{SERVICE_NAME}/Admit")(
            variables_pb2.AdmitRequest(actor_id="x", count=1).SerializeToString(), metadata=md,
            timeout=5),
        "Publish": lambda md: channel.stream_unary(f"/{SERVICE_NAME}/Publish")(
            iter(_chunks(1, weights(1))), metadata=md, timeout=5),
        "ReportProgress": lambda md: channel.unary_unary(f"/{SERVICE_NAME}/ReportProgress")(
            variables_pb2.ProgressReport(dropped_total=9).SerializeToString(), metadata=md,
            timeout=5),
        "Acknowledged": lambda md: channel.unary_unary(f"/{SERVICE_NAME}/Acknowledged")(
            variables_pb2.AckRequest(actor_id=1).SerializeToString(), metadata=md, timeout=5),
    }
    for method, call in calls.items():
        for md, why in ((None, "needs the auth token"),
                        (((AUTH_TOKEN_METADATA_KEY, "x" * 30),), "wrong auth token"),
                        (((AUTH_TOKEN_METADATA_KEY, AUTH + "!"), (PUBLISHER_TOKEN_METADATA_KEY,
                                                                  PUB)), "wrong auth token")):
            with pytest.raises(grpc.RpcError) as e:
                call(md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
            assert why in e.value.details() and AUTH not in e.value.details()
    assert server.stats()["rejected_unauthenticated"] == 3 * len(calls)
    assert server.stats()["started_total"] == 0                 # no admission slipped through
    assert server.stats()["dropped_total"] == 0 and server.progress() is None

    # The clients send it on every call; without it they fail with a clear error.
    with pytest.raises(VariableClientError, match="UNAUTHENTICATED"):
        client(server, auth="").update_and_wait(timeout_s=5)
    with pytest.raises(VariableClientError, match="UNAUTHENTICATED"):
        client(server, auth="").admit("a", 1)
    with pytest.raises(VariableClientError, match="UNAUTHENTICATED"):
        client(server, auth="").acknowledged(1)
    with pytest.raises(VariableClientError, match="UNAUTHENTICATED"):
        publisher(server, auth="").report_progress(0, 1, 0, 0, {})
    good = client(server)
    assert good.update_and_wait(timeout_s=10) == 0 and good.admit("a", 1) == 1
    assert good.params == weights(0)
    assert publisher(server).report_progress(0, 1, 2, 0, {1: (3, [])}).credit == 1
    assert good.acknowledged(1).watermark == 3
    channel.close()


def test_unauthenticated_publish_is_refused_and_only_the_learner_publishes(server):
    publisher(server).publish(0, weights(0))
    for auth, pub, code in (("", PUB, grpc.StatusCode.UNAUTHENTICATED),
                            ("z" * 20, PUB, grpc.StatusCode.UNAUTHENTICATED),
                            (AUTH, "", grpc.StatusCode.PERMISSION_DENIED),
                            (AUTH, "not-the-learner", grpc.StatusCode.PERMISSION_DENIED)):
        with pytest.raises(PublishError) as e:
            publisher(server, auth=auth, pub=pub).publish(1, weights(1, scale=9.0))
        assert e.value.code == code, (auth, pub)
    reader = client(server)
    assert reader.update_and_wait(timeout_s=10) == 0 and reader.params == weights(0)
    publisher(server).publish(1, weights(1))
    assert reader.update_and_wait(timeout_s=10) == 1


def test_binding_beyond_loopback_requires_a_token(tmp_path):
    with pytest.raises(ValueError, match="bind_host='0.0.0.0'.*auth token"):
        VariableServer(host="0.0.0.0")
    with pytest.raises(ValueError, match="at least 16"):
        VariableServer(host="0.0.0.0", auth_token="short")
    with VariableServer(host="0.0.0.0", auth_token=AUTH, publisher_token=PUB,
                        insecure_transport=True) as srv:   # TLS: test_transport_security.py
        local = f"127.0.0.1:{srv.port}"
        with pytest.raises(VariableClientError, match="UNAUTHENTICATED"):
            VariableClient(local).admit("a", 1)
        assert VariableClient(local, auth_token=AUTH).latest_info().version == -1

    # The program refuses before anything starts: config, run_dir, processes.
    config = SAOConfig(bind_host="0.0.0.0", run_dir=str(tmp_path / "run"),
                       insecure_transport=True)
    with pytest.raises(ConfigError, match="auth token"):
        make_program(config, auth_token="")
    assert make_program(config, auth_token=AUTH).groups["variables"][0].kwargs == {
        "auth_token": AUTH, "run_dir": str(tmp_path / "run")}
    env = {k: v for k, v in os.environ.items() if k != "SAO_AUTH_TOKEN"}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "programs", "sao.py"),
                           "--bind_host=0.0.0.0", "--insecure_transport",
                           f"--run_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0 and "auth token" in proc.stderr + proc.stdout
    assert not (tmp_path / "run").exists()


def test_security_config_fields_fail_before_launch(tmp_path):
    pem = tmp_path / "cert.pem"
    pem.write_text("x")
    with pytest.raises(ConfigError, match="give both"):
        SAOConfig(tls_cert=str(pem))
    with pytest.raises(ConfigError, match="tls_key=.*no such file"):
        SAOConfig(tls_cert=str(pem), tls_key=str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="bind_host"):
        SAOConfig(bind_host="bad host")
    with pytest.raises(ConfigError, match="restart_groups contains 'actors'"):
        SAOConfig(restart_groups=("actors",))
    with pytest.raises(ConfigError, match="ray_resources entry 'learner:x'"):
        SAOConfig(launch="ray", ray_resources=("learner:x",))
    assert "auth_token" not in SAOConfig().to_json()            # the secret is never saved


# ------------------------------------------------------------------------------ payloads
def test_published_weights_are_validated_before_clients_see_them(server):
    good = weights(0)
    publisher(server).publish(0, good)
    assert safetensors_manifest(good)["lm_head.weight"] == ("F32", (16, 8))
    nan = np.full((16, 8), np.nan, np.float32)
    bad = {
        "unexpected tensors": weights(1, extra__bias=np.zeros(3, np.float32)),
        "missing tensors": weights(1, lm_head__weight=None),
        "F32[16, 9] != expected F32[16, 8]": weights(
            1, lm_head__weight=np.zeros((16, 9), np.float32)),
        "F64": weights(1, lm_head__weight=np.zeros((16, 8), np.float64)),
        "NaN or infinite": weights(1, lm_head__weight=nan),
        "truncated or padded": weights(1) + b"\0" * 8,
        "too short": b"\1\2",
        "does not fit": (2 ** 40).to_bytes(8, "little") + b"{}",
        "not JSON": (4).to_bytes(8, "little") + b"{{{{",
        "holds no tensors": (2).to_bytes(8, "little") + b"{}",
    }
    reader = client(server)
    for why, payload in bad.items():
        with pytest.raises(PublishError) as e:
            publisher(server).publish(1, payload)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, why
        assert "payload rejected" in str(e.value) and why in str(e.value), (why, str(e.value))
        assert reader.update_and_wait(timeout_s=10) == 0 and reader.params == good
    publisher(server).publish(1, weights(1))
    assert reader.update_and_wait(timeout_s=10) == 1

    validator = SafetensorsValidator(expected={"w": ("F32", (2,))}, check_finite=False)
    validator(0, save_safetensors({"w": np.array([np.inf, 1], np.float32)}), "safetensors")
    with pytest.raises(PayloadRejected, match="format 'pickle'"):
        validator(0, b"", "pickle")


def test_message_size_limits(tmp_path):
    with VariableServer(publisher_token=PUB, auth_token=AUTH, chunk_bytes=64 << 10,
                        max_message_bytes=256 << 10, max_payload_bytes=1 << 20) as srv:
        channel = grpc.insecure_channel(srv.address, options=[
            ("grpc.max_send_message_length", 64 << 20)])
        with pytest.raises(grpc.RpcError) as e:                 # one message over the limit
            channel.unary_unary(f"/{SERVICE_NAME}/Admit")(b"\0" * (300 << 10), metadata=BOTH,
                                                          timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(PublishError) as e:                  # a chunk over the limit
            VariablePublisher(srv.address, PUB, auth_token=AUTH,
                              chunk_bytes=300 << 10).publish(0, os.urandom(400 << 10))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(PublishError) as e:                  # a payload over the limit
            VariablePublisher(srv.address, PUB, auth_token=AUTH,
                              chunk_bytes=64 << 10).publish(0, os.urandom(2 << 20))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_payload_bytes" in str(e.value)
        VariablePublisher(srv.address, PUB, auth_token=AUTH, chunk_bytes=64 << 10).publish(
            0, os.urandom(500 << 10))                           # within every limit
        assert VariableClient(srv.address, auth_token=AUTH).update_and_wait(timeout_s=10) == 0
        channel.close()


# ------------------------------------------------------------------------------ fuzzing
def test_fuzz_1200_malformed_requests_and_the_server_still_serves(server):
    good = weights(0)
    publisher(server).publish(0, good)
    publisher(server).report_progress(0, 50, 0, 0, {0: (7, [])})
    channel = grpc.insecure_channel(server.address, options=[
        ("grpc.max_send_message_length", 64 << 20)])
    rng = random.Random(7)
    allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
               grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION,
               grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
               grpc.StatusCode.UNIMPLEMENTED}
    unary = {m: channel.unary_unary(f"/{SERVICE_NAME}/{m}")
             for m in ("LatestVersion", "Admit", "ReportProgress", "Acknowledged")}
    fetch = channel.unary_stream(f"/{SERVICE_NAME}/FetchWeights")
    publish = channel.stream_unary(f"/{SERVICE_NAME}/Publish")
    payload = weights(3)

    def garbage(lo=0, hi=300):
        return rng.randbytes(rng.randrange(lo, hi))

    def report(acks=0, seqs=0, dropped_total=50):
        return variables_pb2.ProgressReport(version=0, dropped_total=dropped_total, acks=[
            variables_pb2.ActorAck(actor_id=i, seqs=range(seqs if i == 0 else 0))
            for i in range(max(acks, 1))]).SerializeToString()

    def metadata():
        roll = rng.random()
        if roll < 0.1:
            return None
        if roll < 0.2:
            return ((AUTH_TOKEN_METADATA_KEY, garbage(1, 40).hex()),)
        return BOTH

    kinds = [
        lambda: unary["Admit"](garbage(), metadata=metadata(), timeout=5),
        lambda: unary["LatestVersion"](garbage(1), metadata=metadata(), timeout=5),
        lambda: list(fetch(garbage(), metadata=metadata(), timeout=5)),
        lambda: list(fetch(variables_pb2.FetchRequest(version=rng.randrange(5, 10 ** 6))
                           .SerializeToString(), metadata=BOTH, timeout=5)),      # unknown
        lambda: list(fetch(variables_pb2.FetchRequest(chunk_bytes=-rng.randrange(1, 99))
                           .SerializeToString(), metadata=BOTH, timeout=5)),
        lambda: unary["Admit"](variables_pb2.AdmitRequest(
            actor_id="a" * rng.choice([0, 300, 5000]), count=rng.randrange(-5, 1))
            .SerializeToString(), metadata=metadata(), timeout=5),
        lambda: publish(iter([garbage() for _ in range(rng.randrange(0, 4))]),
                        metadata=metadata(), timeout=5),
        lambda: publish(iter(_chunks(1, payload, sha="0" * 64)), metadata=BOTH, timeout=5),
        lambda: publish(iter(_chunks(1, payload, total=len(payload) + rng.randrange(1, 99))),
                        metadata=BOTH, timeout=5),                               # truncated
        lambda: publish(iter(_chunks(1, payload, last=False)), metadata=BOTH, timeout=5),
        lambda: publish(iter(_chunks(1, payload)[:-1] + [garbage(1)]), metadata=BOTH,
                        timeout=5),
        lambda: publish(iter(_chunks(rng.randrange(-9, 1), payload)), metadata=BOTH,
                        timeout=5),                                              # old versions
        lambda: publish(iter(_chunks(1, garbage(8, 4000))), metadata=BOTH, timeout=5),
        lambda: publish(iter(_chunks(1, payload)), timeout=5,
                        metadata=((AUTH_TOKEN_METADATA_KEY, AUTH),)),             # no pub token
        lambda: channel.unary_unary(f"/{SERVICE_NAME}/{garbage(1, 9).hex()}")(
            b"", metadata=BOTH, timeout=5),                                      # no such method
        lambda: unary["ReportProgress"](garbage(), metadata=metadata(), timeout=5),
        lambda: unary["Acknowledged"](garbage(), metadata=metadata(), timeout=5),
        lambda: unary["ReportProgress"](report(acks=rng.randrange(4097, 5000)),
                                        metadata=BOTH, timeout=5),               # too many acks
        lambda: unary["ReportProgress"](report(seqs=rng.randrange(65537, 70000)),
                                        metadata=BOTH, timeout=5),               # too many seqs
        lambda: unary["ReportProgress"](report(), timeout=5, metadata=(
            (AUTH_TOKEN_METADATA_KEY, AUTH), (PUBLISHER_TOKEN_METADATA_KEY, garbage(1).hex()))),
        lambda: unary["ReportProgress"](report(dropped_total=-rng.randrange(1, 9)),
                                        metadata=BOTH, timeout=5),
        lambda: unary["ReportProgress"](report(dropped_total=0), metadata=BOTH,
                                        timeout=5),                              # goes backwards
    ]
    seen = {}
    n = 0
    for i in range(1200):
        kind = i % len(kinds)
        try:
            kinds[kind]()
            seen[(kind, "OK")] = seen.get((kind, "OK"), 0) + 1
        except grpc.RpcError as e:
            assert e.code() in allowed, (kind, e.code(), e.details())
            assert e.details(), (kind, e.code())
            seen[(kind, e.code().name)] = seen.get((kind, e.code().name), 0) + 1
        n += 1
    for _ in range(5):                                          # oversized requests
        with pytest.raises(grpc.RpcError) as e:
            unary["Admit"](b"\0" * (9 << 20), metadata=BOTH, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        n += 1
    assert n >= 1000
    # Every kind was refused every time (none slipped through as OK), except the few legal
    # requests among the random ones (an Admit whose random bytes parse as a valid request).
    oks = sum(v for (kind, code), v in seen.items() if code == "OK" and kind != 21)
    assert oks <= 20, seen
    for kind in (3, 4, 7, 8, 9, 11, 12, 13, 17, 18, 19, 20):
        assert seen.get((kind, "OK"), 0) == 0, (kind, seen)
    for kind, code in ((13, "PERMISSION_DENIED"), (19, "PERMISSION_DENIED"),
                       (3, "NOT_FOUND"), (17, "INVALID_ARGUMENT"), (18, "INVALID_ARGUMENT"),
                       (21, "OK")):   # a backwards report is merged: accepted, changes nothing
        assert seen[(kind, code)] == 1200 // len(kinds) + (kind < 1200 % len(kinds)), kind
    for kind in (15, 16):                                       # garbage for the new calls
        assert seen.get((kind, "INVALID_ARGUMENT"), 0) > 10, (kind, seen)
    channel.close()

    # Still serving, correctly: the same version, then a good publish, fetch and admission.
    reader = client(server)
    assert reader.update_and_wait(timeout_s=10) == 0 and reader.params == good
    publisher(server).publish(1, weights(1))
    assert reader.update_and_wait(timeout_s=10) == 1 and reader.params == weights(1)
    assert client(server).admit("after-fuzz", 1) >= 0
    assert client(server).acknowledged(0).watermark == 7        # the report before the fuzz
    assert publisher(server).report_progress(1, 50, 2, 0, {0: (8, [])}).credit == 50
    assert client(server).acknowledged(0).watermark == 8
    stats = server.stats()
    assert stats["rejected_Publish"] > 400 and stats["rejected_unauthenticated"] > 50


# ------------------------------------------------------------------------------ TLS
def _self_signed(tmp_path, name):
    cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert.read_bytes(), key.read_bytes()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_only_with_the_auth_token(tmp_path):
    cert, key = _self_signed(tmp_path, "server")
    other, _ = _self_signed(tmp_path, "other")
    with VariableServer(publisher_token=PUB, auth_token=AUTH, tls_cert_chain=cert,
                        tls_private_key=key) as srv:
        VariablePublisher(srv.address, PUB, auth_token=AUTH, tls_root_cert=cert).publish(
            0, b"over tls")
        tls = VariableClient(srv.address, auth_token=AUTH, tls_root_cert=cert)
        assert tls.update_and_wait(timeout_s=10) == 0 and tls.params == b"over tls"
        for stranger in (VariableClient(srv.address, auth_token=AUTH, rpc_timeout_s=3),  # plain
                         VariableClient(srv.address, auth_token=AUTH, tls_root_cert=other,
                                        rpc_timeout_s=3)):                        # untrusted
            with pytest.raises(VariableClientError) as e:
                stranger.latest_info(timeout_s=3)
            assert e.value.code in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED)
        with pytest.raises(VariableClientError, match="UNAUTHENTICATED"):
            VariableClient(srv.address, tls_root_cert=cert).admit("a", 1)
    with pytest.raises(ValueError, match="give both"):
        VariableServer(tls_cert_chain=cert)
