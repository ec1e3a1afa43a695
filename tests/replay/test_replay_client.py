"""replay/client.py against a real Reverb server: the TableInfo fields decoded without the
TensorFlow-generated protos agree with Reverb's own decoding, and a process started with
`lite_env()` writes and reads rollouts through Reverb's C++ client, and hosts the replay server
(replay/tables.py), with neither TensorFlow nor the reverb package imported."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("reverb")

from sao_actor_learner.replay import ReplayServer, RolloutReader, RolloutWriter, connect, lite_env
from sao_actor_learner.replay.client import LITE_ENV, ReplayClient, decode_table_info

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_replay import MAX_LEN, VOCAB, make_rollout  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def server():
    srv = ReplayServer(queue_capacity=12).start()
    yield srv
    srv._shutdown()


def test_table_info_decoding_matches_reverbs_own(server):
    from reverb.cc import schema_pb2

    client = connect(server.address)
    with RolloutWriter(client, max_sequence_length=MAX_LEN, vocab_size=VOCAB) as writer:
        assert all(r.confirmed for r in writer.write_many(
            [make_rollout(5 + i, seed=i) for i in range(5)], timeout_s=30.0))
    protos = client._client.ServerInfo(5)
    assert protos
    for proto in protos:
        ours, theirs = decode_table_info(proto), schema_pb2.TableInfo.FromString(proto)
        assert ours.name == theirs.name == "rollouts"
        assert ours.current_size == theirs.current_size == 5
        assert ours.max_size == theirs.max_size == 12
        assert ours.samples_per_insert == theirs.rate_limiter_info.samples_per_insert == 1.0
        assert ours.max_diff == theirs.rate_limiter_info.max_diff == 12.0
        assert ours.inserts == theirs.rate_limiter_info.insert_stats.completed == 5
        assert ours.insert_capacity == 12
    status = client.table_status("rollouts")
    assert (status.current_size, status.insert_capacity) == (5, 12)
    with pytest.raises(KeyError, match="has no table 'nope'.*rollouts"):
        client.table_status("nope")


def test_connect_accepts_addresses_clients_and_refuses_the_rest(server):
    assert connect(server.address).server_address == server.address
    wrapped = connect(server.client())                        # a reverb.Client
    assert isinstance(wrapped, ReplayClient) and connect(wrapped) is wrapped
    for bad, error in (("localhost", ValueError), (42, TypeError)):
        with pytest.raises(error):
            connect(bad)


CHILD = r"""
import json, resource, sys
import numpy as np
from sao_actor_learner.replay import RolloutReader, RolloutWriter
from sao_actor_learner.replay.client import lite_active
from sao_actor_learner.types import Rollout

def rollout(length, seed):
    rng = np.random.default_rng(seed)
    mask = (np.arange(length) >= 2).astype(np.int8)
    return Rollout(tokens=rng.integers(0, 50, length), action_mask=mask,
                   rollout_logp=np.where(mask == 1, -rng.random(length), 0.0),
                   versions=np.where(mask == 1, 0, -1), rewards=np.eye(length)[-1],
                   prompt_id=seed, seq=seed)

sent = [rollout(6 + 3 * i, seed=100 + i) for i in range(6)]
with RolloutWriter(sys.argv[1], max_sequence_length=64, vocab_size=50) as writer:
    results = writer.write_many(sent, timeout_s=30.0)
with RolloutReader(sys.argv[1]) as reader:
    got = []
    while len(got) < 3:
        got += reader.sample(3 - len(got), timeout_s=5.0)
print(json.dumps({
    "lite": lite_active(), "tensorflow": "tensorflow" in sys.modules,
    "reverb": "reverb" in sys.modules, "confirmed": [r.confirmed for r in results],
    "same": [bool(np.array_equal(a.tokens, b.tokens) and a.prompt_id == b.prompt_id
                  and np.array_equal(a.rollout_logp, b.rollout_logp)) for a, b in zip(sent, got)],
    "left": [[r.prompt_id, r.tokens.tolist(), r.rollout_logp.tolist()] for r in sent[3:]],
    "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
"""


def test_a_lite_process_writes_and_reads_without_tensorflow(server):
    env = {**os.environ, **lite_env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    assert env[LITE_ENV] == "1"
    out = subprocess.run([sys.executable, "-c", CHILD, server.address], capture_output=True,
                         text=True, timeout=240, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["lite"] and not report["tensorflow"] and not report["reverb"], report
    assert report["confirmed"] == [True] * 6 and report["same"] == [True] * 3
    # What the child left in the table reads back here, through the reverb package.
    with RolloutReader(server.address) as reader:
        rest = []
        while len(rest) < 3:
            rest += reader.sample(3 - len(rest), timeout_s=5.0)
    for r, (prompt_id, tokens, logp) in zip(rest, report["left"]):
        assert r.prompt_id == prompt_id and r.tokens.tolist() == tokens
        np.testing.assert_array_equal(r.rollout_logp, np.asarray(logp, np.float32))
    assert server.client().server_info()["rollouts"].current_size == 0


SERVER_CHILD = r"""
import json, os, resource, sys
import numpy as np
from sao_actor_learner.replay import ReplayServer, RolloutReader, RolloutWriter, connect
from sao_actor_learner.replay.client import lite_active
from sao_actor_learner.types import Rollout

server = ReplayServer(queue_capacity=4, checkpoint_dir=sys.argv[1]).start()
mask = np.array([0, 1, 1], np.int8)
sent = [Rollout(tokens=np.array([1, 2, i]), action_mask=mask, rollout_logp=np.array([0, -1., -2]),
                versions=np.array([-1, 0, 0]), rewards=np.array([0, 0, 1.]), prompt_id=i, seq=i)
        for i in range(3)]
with RolloutWriter(server.address, max_sequence_length=8, vocab_size=10) as writer:
    confirmed = [r.confirmed for r in writer.write_many(sent, timeout_s=30.0)]
status = connect(server.address).table_status("rollouts")
path = server.checkpoint()
with RolloutReader(server.address) as reader:
    got = []
    while len(got) < 1:
        got += reader.sample(1, timeout_s=5.0)
server._shutdown()
print(json.dumps({"lite": lite_active(), "tensorflow": "tensorflow" in sys.modules,
                  "reverb": "reverb" in sys.modules,
                  "confirmed": confirmed, "size": status.current_size,
                  "capacity": status.insert_capacity, "checkpoint": os.path.isdir(path),
                  "first": got[0].prompt_id,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
"""


def test_a_lite_process_hosts_the_replay_server_without_tensorflow(tmp_path):
    """The replay node in a lite process: the server, its rate limiter (capacity 4) and a
    checkpoint, with neither TensorFlow nor the reverb package imported (the writer checks its
    items against the table's signature, the bytes it was given); then this process (with the
    reverb package) restores that checkpoint: all 3 rollouts, in order, as it was written before
    the child's sample."""
    env = {**os.environ, **lite_env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", SERVER_CHILD, str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["lite"] and not report["tensorflow"] and not report["reverb"], report
    assert report["confirmed"] == [True] * 3 and report["size"] == 3
    assert report["capacity"] == 4 and report["checkpoint"] and report["first"] == 0
    restored = ReplayServer(queue_capacity=4, checkpoint_dir=str(tmp_path / "ckpt")).start()
    try:
        with RolloutReader(restored.address) as reader:
            got = []
            while len(got) < 3:   # the checkpoint was written before the child's sample
                batch = reader.sample(3 - len(got), timeout_s=5.0)
                if not batch:
                    break
                got += batch
        assert [r.prompt_id for r in got] == [0, 1, 2]
    finally:
        restored._shutdown()
