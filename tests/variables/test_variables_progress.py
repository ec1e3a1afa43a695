"""ReportProgress / Acknowledged and persisted admission: real gRPC on 127.0.0.1, no mocks."""
import json
import multiprocessing
import os
import signal
import socket

import grpc
import pytest

from sao_actor_learner.protos_gen import variables_pb2, variables_pb2_grpc
from sao_actor_learner.variables import (PUBLISHER_TOKEN_METADATA_KEY, AckInfo, VariableClient,
                                         VariableClientError, VariablePublisher, VariableServer)
from sao_actor_learner.variables.progress import MAX_ACKS, MAX_SEQS

TOKEN = "test-token"
pytestmark = pytest.mark.timeout(180)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server():
    # These tests are of the merge rules, with no actors: reports are not bounded by admission
    # (test_transport_security.py tests the bound).
    srv = VariableServer(batch_size=2, max_staleness=1, publisher_token=TOKEN,
                         bound_progress=False).start()
    yield srv
    srv.stop(grace_s=0.1)


def _report(publisher, version=0, dropped=0, trained=0, epoch=0, acks=None):
    return publisher.report_progress(version, dropped, trained, epoch, acks or {})


def test_credit_from_report_progress_raises_capacity_without_any_publish(server):
    client, publisher = VariableClient(server.address), VariablePublisher(server.address, TOKEN)
    assert client.admit("a", 10) == 4                          # (0 + 1 + 1) * 2, nothing published
    result = _report(publisher, dropped=3)
    assert (result.credit, result.capacity, result.identical) == (3, 7, False)
    assert client.admit("a", 10) == 3 and server.latest() is None
    publisher.publish(0, b"w0", dropped_total=1)               # older credit in a publish: max
    assert server.stats()["dropped_total"] == 3 and client.admit("a", 1) == 0
    publisher.publish(1, b"w1", dropped_total=5)               # (1 + 2) * 2 + 5
    assert client.admit_details("b", 20).capacity == 11 and server.stats()["started_total"] == 11
    assert _report(publisher, version=1, dropped=4).credit == 5   # a report cannot lower it
    client.close()
    publisher.close()


def test_reports_are_merged_and_never_move_backwards(server):
    publisher = VariablePublisher(server.address, TOKEN)
    first = _report(publisher, 4, 2, 30, 1, {3: (7, [9])})
    assert not first.identical and first.loss_epoch == 1
    again = _report(publisher, 4, 2, 30, 1, {3: (7, [9, 5])})   # 5 < watermark: the same report
    assert again.identical
    for args in ((3, 2, 30, 1), (4, 1, 30, 1), (4, 2, 29, 1), (4, 2, 30, 0)):
        result = _report(publisher, *args)                    # older: merged, changes nothing
        assert result.identical and (result.loss_epoch, result.version) == (1, 4)
    stored = server.progress()
    assert (stored.version, stored.dropped_total, stored.trained_total, stored.loss_epoch) == \
        (4, 2, 30, 1) and stored.acked(3).consumed(9)
    bumped = _report(publisher, 2, 0, 0, 2, {3: (5, [8]), 4: (1, [])})   # a restarted learner
    assert not bumped.identical and bumped.loss_epoch == 2 and bumped.version == 4
    merged = server.progress()
    assert merged.acked(3).watermark == 7 and merged.acked(3).seqs == (8, 9)
    assert merged.acked(4).watermark == 1 and merged.trained_total == 30
    assert _report(publisher, 5, 2, 32, 2, {}).identical is False
    assert server.progress().version == 5 and server.stats()["progress_reports"] == 3
    with pytest.raises(ValueError, match="dropped_total"):
        _report(publisher, 5, -1, 32, 1)                       # refused before it is sent
    publisher.close()


def test_acks_round_trip_per_actor(server):
    client, publisher = VariableClient(server.address), VariablePublisher(server.address, TOKEN)
    assert client.acknowledged(0) == AckInfo(0, 0, (), -1, 0)  # before any report
    _report(publisher, 2, 0, 12, 1, {0: (5, [8, 6]), 1: (0, [2]), 7: (3, [])})
    assert client.acknowledged(0) == AckInfo(1, 5, (6, 8), 2, 12)
    assert client.acknowledged(1).seqs == (2,) and client.acknowledged(7).watermark == 3
    assert client.acknowledged(4) == AckInfo(1, 0, (), 2, 12)  # unknown actor
    info = client.acknowledged(0)
    assert [s for s in range(10) if info.consumed(s)] == [0, 1, 2, 3, 4, 6, 8]
    _report(publisher, 3, 0, 14, 1, {0: (9, [])})               # cumulative: replaces acks
    assert client.acknowledged(0).watermark == 9 and client.acknowledged(1).watermark == 0
    client.close()
    publisher.close()


def test_report_progress_needs_the_publisher_token_and_bounded_sizes(server):
    stub = variables_pb2_grpc.VariableServiceStub(grpc.insecure_channel(server.address))
    md = ((PUBLISHER_TOKEN_METADATA_KEY, TOKEN),)
    for token in ("", "wrong"):
        with pytest.raises(VariableClientError) as e:
            _report(VariablePublisher(server.address, token))
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert PUBLISHER_TOKEN_METADATA_KEY in str(e.value)
    too_many_acks = variables_pb2.ProgressReport(
        acks=[variables_pb2.ActorAck(actor_id=i) for i in range(MAX_ACKS + 1)])
    too_many_seqs = variables_pb2.ProgressReport(acks=[
        variables_pb2.ActorAck(actor_id=0, seqs=range(MAX_SEQS)),
        variables_pb2.ActorAck(actor_id=1, seqs=[1])])
    twice = variables_pb2.ProgressReport(acks=[variables_pb2.ActorAck(actor_id=1)] * 2)
    negative = variables_pb2.ProgressReport(trained_total=-4)
    for request, why in ((too_many_acks, "acks"), (too_many_seqs, "seqs"), (twice, "twice"),
                         (negative, "trained_total")):
        with pytest.raises(grpc.RpcError) as e:
            stub.ReportProgress(request, metadata=md, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()
    assert server.progress() is None                            # nothing was kept
    stub.ReportProgress(variables_pb2.ProgressReport(acks=[
        variables_pb2.ActorAck(actor_id=0, seqs=range(MAX_SEQS))]), metadata=md, timeout=10)
    assert len(server.progress().acked(0).seqs) == MAX_SEQS


def _grant_all(client, actors):
    """Admits until the bound holds every actor back; returns the grants per actor."""
    grants = {a: 0 for a in actors}
    while True:
        got = {a: client.admit(a, 3) for a in actors}
        for a, n in got.items():
            grants[a] += n
        if not any(got.values()):
            return grants


def test_admission_state_survives_a_stop_and_restart(tmp_path):
    path = str(tmp_path / "admission.json")
    kwargs = dict(batch_size=2, max_staleness=1, publisher_token=TOKEN, state_path=path,
                  bound_progress=False)
    with VariableServer(**kwargs) as old:
        client, publisher = VariableClient(old.address), VariablePublisher(old.address, TOKEN)
        publisher.publish(2, b"w2")
        _report(publisher, 2, 3, 8, 0, {1: (4, [6])})
        grants = _grant_all(client, ["0", "1"])
        assert client.admit_details("0", 2, released=2).granted == 2
        before = old.stats()
        client.close()
    assert sum(grants.values()) == before["capacity"] == (2 + 1 + 1) * 2 + 3
    with open(path) as f:
        assert json.load(f)["admission"]["started_total"] == before["started_total"]
    with VariableServer(**kwargs) as new:
        after = new.stats()
        for key in ("started_total", "started_by_actor", "capacity", "dropped_total",
                    "released"):
            assert after[key] == before[key], key
        assert after["version"] == -1                           # weights are not persisted
        client = VariableClient(new.address)
        refused = client.admit_details("2", 1)
        assert (refused.granted, refused.capacity) == (0, before["capacity"])
        assert client.acknowledged(1) == AckInfo(0, 4, (6,), 2, 8)
        publisher = VariablePublisher(new.address, TOKEN)
        assert _report(publisher, 2, 3, 8, 0, {1: (4, [6])}).identical   # a resumed learner
        assert _report(publisher, 1, 3, 8, 0).identical                  # older: no change
        publisher.publish(3, b"w3")                             # the bound moves on
        assert client.admit("2", 5) == 2
        client.close()


def test_unreadable_state_files_are_refused(tmp_path):
    path = tmp_path / "admission.json"
    for text, why in (("{not json", "not JSON"), ("[1]", "not an object"),
                      ('{"format": "other"}', "format")):
        path.write_text(text)
        with pytest.raises(ValueError, match=why):
            VariableServer(state_path=str(path))


def _serve(port, state_path, ready):
    server = VariableServer(port=port, batch_size=2, max_staleness=1, publisher_token=TOKEN,
                            bound_progress=False, state_path=state_path).start()
    ready.set()
    server.run()


def test_admission_state_survives_sigkill_of_the_server_process(tmp_path):
    port, path = _free_port(), str(tmp_path / "admission.json")
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_serve, args=(port, path, ready), daemon=True)
    proc.start()
    try:
        assert ready.wait(timeout=120), "the server process did not start"
        address = f"127.0.0.1:{port}"
        client, publisher = VariableClient(address), VariablePublisher(address, TOKEN)
        publisher.publish(1, b"w1")
        _report(publisher, 1, 1, 4, 2, {0: (3, [5])})
        grants = _grant_all(client, ["0", "1", "2"])
        last = client.admit_details("1", 2, released=1)         # the reply, then at once...
        os.kill(proc.pid, signal.SIGKILL)                       # ...SIGKILL
        proc.join(timeout=30)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            proc.kill()
    grants["1"] += last.granted
    with pytest.raises(VariableClientError) as e:               # nothing serves the port now
        client.admit("0", 1, timeout_s=0.5)
    assert e.value.retryable
    with VariableServer(port=port, batch_size=2, max_staleness=1, publisher_token=TOKEN,
                        bound_progress=False, state_path=path) as new:
        stats = new.stats()
        assert stats["started_by_actor"] == grants
        assert stats["started_total"] == last.started_total == sum(grants.values()) - 1
        assert stats["capacity"] == last.capacity == (1 + 1 + 1) * 2 + 1
        assert client.admit_details("0", 1).granted == 0        # over the bound: refused
        assert client.admit_details("0", 2, released=1).granted == 1
        assert client.acknowledged(0) == AckInfo(2, 3, (5,), 1, 4)
    client.close()
    publisher.close()
