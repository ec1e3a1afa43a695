"""Tests of the variable server and its clients: real gRPC on 127.0.0.1, no mocks."""
import hashlib
import multiprocessing
import os
import pickle
import random
import socket
import threading
import time

import grpc
import pytest

from sao_actor_learner import core
from sao_actor_learner.protos_gen import variables_pb2, variables_pb2_grpc
from sao_actor_learner.variables import (PUBLISHER_TOKEN_METADATA_KEY, PublishError,
                                         VariableClient, VariableClientError, VariablePublisher,
                                         VariableServer)
from sao_actor_learner.variables.server import SERVICE_NAME

TOKEN = "test-token"
AUTH = ((PUBLISHER_TOKEN_METADATA_KEY, TOKEN),)


@pytest.fixture
def server():
    srv = VariableServer(publisher_token=TOKEN, chunk_bytes=64 << 10, keep_versions=2,
                         bound_progress=False).start()   # credit without actors admitted
    yield srv
    srv.stop(grace_s=0.1)


@pytest.fixture
def stub(server):
    channel = grpc.insecure_channel(server.address)
    yield variables_pb2_grpc.VariableServiceStub(channel)
    channel.close()


def _fetch_raw(stub, version=-1, chunk_bytes=0):
    chunks = list(stub.FetchWeights(variables_pb2.FetchRequest(version=version,
                                                               chunk_bytes=chunk_bytes),
                                    timeout=10))
    return chunks, b"".join(c.data for c in chunks)


def _chunks(version, payload, total=None, sha=None, last=True, chunk=1000):
    """PublishChunks for `payload`, with optional lies about total_bytes / sha256 / last."""
    pieces = [payload[i:i + chunk] for i in range(0, len(payload), chunk)] or [b""]
    out = []
    for i, piece in enumerate(pieces):
        c = variables_pb2.PublishChunk(version=version, data=piece)
        if i == 0:
            c.total_bytes = len(payload) if total is None else total
        if i == len(pieces) - 1 and last:
            c.last = True
            c.sha256 = hashlib.sha256(payload).hexdigest() if sha is None else sha
        out.append(c)
    return out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_publish_fetch_round_trip_multi_chunk(server, stub):
    payload = os.urandom(3 << 20) + b"tail"
    publisher = VariablePublisher(server.address, TOKEN, chunk_bytes=200_000)
    assert publisher.publish(7, payload, dropped_total=3) == 7

    info = VariableClient(server.address).latest_info()
    assert info.version == 7 and info.num_bytes == len(payload)
    assert info.sha256 == hashlib.sha256(payload).hexdigest()
    assert abs(info.publish_time - time.time()) < 60

    chunks, data = _fetch_raw(stub, version=7, chunk_bytes=100_000)
    assert data == payload and len(chunks) == -(-len(payload) // 100_000)
    assert chunks[0].total_bytes == len(payload) and chunks[0].sha256 == info.sha256
    assert chunks[0].format == "safetensors"
    assert {c.version for c in chunks} == {7}
    _, default_chunked = _fetch_raw(stub)                    # newest, server's 64 KiB chunks
    assert default_chunked == payload

    client = VariableClient(server.address, fetch_chunk_bytes=300_000,
                            decode=lambda b: hashlib.sha256(b).hexdigest())
    assert client.version == -1 and client.params is None
    assert client.update_and_wait() == 7
    assert client.params == info.sha256                      # decode ran on the exact bytes
    assert server.stats()["dropped_total"] == 3
    client.close()
    publisher.close()


def test_version_ordering_and_not_found(server, stub):
    publisher = VariablePublisher(server.address, TOKEN)
    with pytest.raises(grpc.RpcError) as e:                  # nothing published yet
        _fetch_raw(stub)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "nothing" in e.value.details()

    publisher.publish(0, b"v0")
    publisher.publish(1, b"v1")
    for stale, why in ((1, "different payload"), (0, "strictly increase")):
        with pytest.raises(PublishError) as err:
            publisher.publish(stale, b"again")
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert isinstance(err.value, core.VersionConflict)   # what a resumed learner expects
        assert why in str(err.value)
    publisher.publish(5, b"v5")                              # gaps are fine
    with pytest.raises(ValueError):
        publisher.publish(-1, b"x")

    assert _fetch_raw(stub, 5)[1] == b"v5" and _fetch_raw(stub, 1)[1] == b"v1"
    with pytest.raises(grpc.RpcError) as e:                  # keep_versions=2 evicted 0
        _fetch_raw(stub, 0)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "[1, 5]" in e.value.details()
    assert _fetch_raw(stub, -1)[1] == b"v5"
    assert VariableClient(server.address).latest_info().version == 5


def test_background_update_never_blocks_and_picks_up_versions(server):
    publisher = VariablePublisher(server.address, TOKEN, chunk_bytes=1 << 20)

    def slow_decode(b):
        time.sleep(0.5)                                      # a slow state-dict decode
        return b

    client = VariableClient(server.address, update_period_s=0.01, decode=slow_decode)
    client.update()                                          # nothing published: no error
    payloads = {v: os.urandom(2 << 20) for v in range(3)}
    worst = 0.0
    for v in range(3):
        publisher.publish(v, payloads[v])
        deadline = time.monotonic() + 10
        while client.version < v:
            t0 = time.perf_counter()
            client.update()
            worst = max(worst, time.perf_counter() - t0)
            assert time.monotonic() < deadline, f"client stuck at {client.version}, wanted {v}"
            time.sleep(0.005)
        assert client.get_variables() == (v, payloads[v])
    assert worst < 0.25, f"update() blocked {worst:.3f} s while a 0.5 s decode ran"
    assert client.last_error is None
    client.close()
    with pytest.raises(VariableClientError):
        client.update()


def test_client_before_server_and_server_restart():
    port = _free_port()
    client = VariableClient(f"127.0.0.1:{port}", update_period_s=0.01)
    for _ in range(3):
        client.update()                                      # server not up: never raises
        time.sleep(0.02)
    with pytest.raises(TimeoutError):
        client.wait_for_version(0, timeout_s=0.3)

    srv = VariableServer(port=port, publisher_token=TOKEN).start()
    VariablePublisher(srv.address, TOKEN).publish(0, b"first")
    assert client.wait_for_version(0, timeout_s=10) == 0 and client.params == b"first"
    srv.stop(grace_s=0.1)

    time.sleep(0.05)
    client.update()                                          # server gone: still no raise
    srv = VariableServer(port=port, publisher_token=TOKEN).start()
    try:
        publisher = VariablePublisher(srv.address, TOKEN)
        publisher.publish(0, b"restarted-old")               # not newer than what we hold
        publisher.publish(3, b"after-restart")
        deadline = time.monotonic() + 10
        while client.version < 3:                            # background path reconnects
            client.update()
            assert time.monotonic() < deadline, client.last_error
            time.sleep(0.01)
        assert client.params == b"after-restart"
    finally:
        client.close()
        srv.stop(grace_s=0.1)


def test_unauthenticated_publish_refused_and_server_keeps_serving(server, stub):
    VariablePublisher(server.address, TOKEN).publish(1, b"good")
    for token in ("", "wrong-token", TOKEN + "x"):
        with pytest.raises(PublishError) as err:
            VariablePublisher(server.address, token).publish(2, b"evil")
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert PUBLISHER_TOKEN_METADATA_KEY in str(err.value)
    assert _fetch_raw(stub)[1] == b"good"
    assert VariableClient(server.address).latest_info().version == 1
    VariablePublisher(server.address, TOKEN).publish(2, b"better")
    assert _fetch_raw(stub)[1] == b"better"
    assert server.stats()["rejected_Publish"] == 3


def test_corrupted_or_truncated_publishes_rejected_old_version_kept(server, stub):
    good = os.urandom(10_000)
    VariablePublisher(server.address, TOKEN).publish(1, good)
    payload = os.urandom(5_000)
    bad_streams = {
        "sha256 mismatch": _chunks(2, payload, sha="0" * 64),
        "no sha256": _chunks(2, payload, sha=""),
        "truncated": _chunks(2, payload, total=len(payload) + 1000),
        "more than total_bytes": _chunks(2, payload, total=len(payload) - 1),
        "without a chunk with last=true": _chunks(2, payload, last=False),
        "after the chunk with last=true": _chunks(2, payload) + _chunks(2, b"x"),
        "same version": (_chunks(2, payload)[:2]
                         + [variables_pb2.PublishChunk(version=3, data=b"z")]),
        "must be >= 0": _chunks(-4, payload),
        "no chunks": [],
    }
    for expected, chunks in bad_streams.items():
        with pytest.raises(grpc.RpcError) as e:
            stub.Publish(iter(chunks), metadata=AUTH, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, expected
        assert expected in e.value.details(), (expected, e.value.details())
        assert _fetch_raw(stub)[1] == good

    def dies_mid_stream():                                   # publisher crashes mid-publish
        yield _chunks(2, payload)[0]
        raise RuntimeError("learner died")
    with pytest.raises(grpc.RpcError):
        stub.Publish(dies_mid_stream(), metadata=AUTH, timeout=10)

    with pytest.raises(grpc.RpcError) as e:                  # announces more than the limit
        stub.Publish(iter(_chunks(2, payload, total=1 << 40)), metadata=AUTH, timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    info = VariableClient(server.address).latest_info()
    assert info.version == 1 and info.sha256 == hashlib.sha256(good).hexdigest()
    stub.Publish(iter(_chunks(2, payload)), metadata=AUTH, timeout=10)  # well-formed works
    assert _fetch_raw(stub)[1] == payload


def test_admission_control_arithmetic():
    with VariableServer(batch_size=3, max_staleness=1, publisher_token=TOKEN) as srv:
        client = VariableClient(srv.address)
        publisher = VariablePublisher(srv.address, TOKEN)
        # Nothing published counts as version 0: capacity (0 + 1 + 1) * 3 = 6.
        first = client.admit_details("a", 4)
        assert (first.granted, first.policy_version, first.started_total, first.capacity) == \
            (4, -1, 4, 6)
        assert client.admit("b", 4) == 2
        assert client.admit("a", 1) == 0
        publisher.publish(0, b"w0")
        assert client.admit("a", 1) == 0                     # version 0: still 6
        publisher.publish(1, b"w1")                          # (1 + 2) * 3 = 9
        assert client.admit("c", 5) == 3
        publisher.publish(2, b"w2", dropped_total=2)         # (2 + 2) * 3 + 2 = 14
        result = client.admit_details("c", 10)
        assert (result.granted, result.policy_version, result.started_total,
                result.capacity) == (5, 2, 14, 14)
        assert srv.stats()["started_by_actor"] == {"a": 4, "b": 2, "c": 8}
        with pytest.raises(ValueError):
            client.admit("a", 0)
        stub = variables_pb2_grpc.VariableServiceStub(grpc.insecure_channel(srv.address))
        for count in (0, -5):
            with pytest.raises(grpc.RpcError) as e:
                stub.Admit(variables_pb2.AdmitRequest(actor_id="a", count=count), timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "count" in e.value.details()
        client.close()

    with VariableServer(batch_size=1, max_staleness=0, admission_control=False) as srv:
        client = VariableClient(srv.address)
        assert client.admit("a", 1000) == 1000 and client.admit("b", 7) == 7
        client.close()


def _child(client, publisher, queue):
    publisher.publish(4, b"from-child")
    queue.put((client.wait_for_version(4, timeout_s=10), client.params,
               client.admit("child", 2)))


def test_clients_pickle_into_child_processes(server):
    client = VariableClient(server.address)
    publisher = VariablePublisher(server.address, TOKEN)
    publisher.publish(0, b"parent")
    client.update_and_wait()                                 # a live channel must not pickle
    clone = pickle.loads(pickle.dumps(client))
    assert clone.version == -1 and clone.address == server.address
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(client, publisher, queue))
    proc.start()
    try:
        assert queue.get(timeout=30) == (4, b"from-child", 2)
    finally:
        proc.join(timeout=10)
    assert proc.exitcode == 0


def test_fuzz_malformed_requests_server_still_answers(server, stub):
    good = os.urandom(200_000)
    VariablePublisher(server.address, TOKEN).publish(3, good)
    channel = grpc.insecure_channel(server.address)
    rng = random.Random(1234)
    methods = ("Publish", "LatestVersion", "FetchWeights", "Admit")
    allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
               grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
               grpc.StatusCode.RESOURCE_EXHAUSTED}
    seen = {}
    for i in range(200):
        method = methods[i % 4]
        path = f"/{SERVICE_NAME}/{method}"
        garbage = rng.randbytes(rng.randrange(0, 300))
        try:
            if method == "Publish":
                chunks = [garbage] + [rng.randbytes(rng.randrange(0, 50))
                                      for _ in range(rng.randrange(0, 3))]
                channel.stream_unary(path)(iter(chunks), timeout=5,
                                           metadata=AUTH if rng.random() < 0.7 else None)
            elif method == "FetchWeights":
                list(channel.unary_stream(path)(garbage, timeout=5))
            else:
                channel.unary_unary(path)(garbage, timeout=5)
            seen[(method, "OK")] = seen.get((method, "OK"), 0) + 1
        except grpc.RpcError as e:
            assert e.code() in allowed, (method, e.code(), e.details())
            assert e.details(), (method, e.code())
            seen[(method, e.code().name)] = seen.get((method, e.code().name), 0) + 1
    assert seen.get(("Publish", "INVALID_ARGUMENT"), 0) > 10, seen
    assert seen.get(("Admit", "INVALID_ARGUMENT"), 0) > 10, seen
    with pytest.raises(grpc.RpcError) as e:                  # unknown method
        channel.unary_unary(f"/{SERVICE_NAME}/Nope")(b"", timeout=5)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    big = grpc.insecure_channel(server.address,
                                options=[("grpc.max_send_message_length", 64 << 20)])
    with pytest.raises(grpc.RpcError) as e:                  # over max_message_bytes
        big.unary_unary(f"/{SERVICE_NAME}/Admit")(b"\0" * (9 << 20), timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    big.close()
    channel.close()

    # Still serving, correctly.
    info = VariableClient(server.address).latest_info()
    assert info.version == 3 and info.sha256 == hashlib.sha256(good).hexdigest()
    assert _fetch_raw(stub)[1] == good
    VariablePublisher(server.address, TOKEN).publish(4, b"after fuzz")
    client = VariableClient(server.address)
    assert client.update_and_wait() == 4 and client.params == b"after fuzz"
    client.close()


def test_concurrent_readers_during_publishes(server):
    """Readers never see a half-published version: every fetch matches its sha256."""
    publisher = VariablePublisher(server.address, TOKEN, chunk_bytes=64 << 10)
    payloads = {v: os.urandom(600_000) for v in range(6)}
    publisher.publish(0, payloads[0])
    errors = []

    def reader():
        client = VariableClient(server.address, update_period_s=0.001)
        try:
            while client.version < 5:
                client.wait_for_version(client.version + 1, timeout_s=10)
                version, params = client.get_variables()
                if params != payloads[version]:
                    errors.append(version)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
        finally:
            client.close()

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for v in range(1, 6):
        publisher.publish(v, payloads[v])
    for t in threads:
        t.join(timeout=20)
    assert not errors and not any(t.is_alive() for t in threads)


def test_server_argument_validation():
    with pytest.raises(ValueError, match="max_staleness=-1"):
        VariableServer(max_staleness=-1)
    with pytest.raises(ValueError, match="batch_size=0"):
        VariableServer(batch_size=0)
    with pytest.raises(ValueError, match="max_message_bytes"):
        VariableServer(chunk_bytes=4 << 20, max_message_bytes=4 << 20)
    with pytest.raises(RuntimeError, match="start"):
        VariableServer().port
    with VariableServer() as a:
        with pytest.raises(RuntimeError, match="could not bind"):
            VariableServer(port=a.port).start()
    with pytest.raises(ValueError, match="address"):
        VariableClient("no-port")


def test_worker_run_and_stop():
    srv = VariableServer()
    thread = threading.Thread(target=srv.run)
    thread.start()
    deadline = time.monotonic() + 5
    while srv._bound_port is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert VariableClient(srv.address).latest_info().version == -1
    srv.stop()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_republishing_the_current_version_only_refreshes_admission_credit():
    with VariableServer(batch_size=2, max_staleness=0, publisher_token=TOKEN,
                        bound_progress=False) as server:   # credit beyond the grants
        publisher = VariablePublisher(server.address, TOKEN)
        client = VariableClient(server.address)
        publisher.publish(0, b"w0", dropped_total=0)
        assert client.admit("a", 5) == 2                     # capacity (0+0+1)*2
        publisher.publish(0, b"w0", dropped_total=3)         # same weights, more credit
        assert client.admit("a", 5) == 3                     # capacity 2 + 3
        assert server.latest().version == 0 and bytes(server.latest().payload) == b"w0"
        client.close()
        publisher.close()
