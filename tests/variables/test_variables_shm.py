"""Weights through shared memory (variables/shm.py): the learner's publisher writes each version
once into a file, the variable server announces it, clients on the same host map it; remote
clients and every failure keep the gRPC path. Real gRPC on 127.0.0.1, real files (under
tmp_path: mmap and flock behave the same as on /dev/shm), no timing assumptions."""
import json
import os
import subprocess
import sys
import zlib

import grpc
import pytest
import torch

from sao_actor_learner.models import checkpoint as ckpt
from sao_actor_learner.protos_gen import variables_pb2
from sao_actor_learner.variables import (PublishError, SafetensorsValidator, VariableClient,
                                         VariablePublisher, VariableServer)
from sao_actor_learner.variables import shm as shm_lib
from sao_actor_learner.variables import shm_reader

TOKEN = "shm-test-token"
pytestmark = pytest.mark.timeout(60)


def _state_dict(version: int):
    g = torch.Generator().manual_seed(version)
    return {"model.embed_tokens.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
            "model.norm.weight": torch.randn(32, generator=g),
            "lm_head.bias": torch.full((8,), float(version))}


def _payload(version: int) -> bytes:
    return ckpt.state_dict_to_bytes(_state_dict(version))


@pytest.fixture
def server(tmp_path):
    srv = VariableServer(publisher_token=TOKEN, keep_versions=2,
                         shm_root=shm_lib.writer_root(str(tmp_path)),
                         validate_payload=SafetensorsValidator()).start()
    yield srv
    srv.stop(grace_s=0.1)


@pytest.fixture
def publisher(server, tmp_path):
    pub = VariablePublisher(server.address, TOKEN, shm_dir=str(tmp_path), shm_keep_versions=3,
                            shm_run_name="test")
    yield pub
    pub.close()


def _client(server, transport="auto"):
    return VariableClient(server.address, update_period_s=0.01, weight_transport=transport)


def _publish_and_fetch(publisher, client, versions):
    """Publishes each version and checks that `client` then holds exactly its bytes."""
    for version in versions:
        publisher.publish(version, ckpt.state_dict_to_buffers(_state_dict(version)))
        assert client.update_and_wait(timeout_s=20) == version
        assert bytes(client.params) == _payload(version)


def test_shm_round_trip_reuses_files_and_mappings(server, publisher, tmp_path):
    local, remote = _client(server), _client(server, "grpc")
    for version in range(7):
        publisher.publish(version, ckpt.state_dict_to_buffers(_state_dict(version)))
        for client in (local, remote):
            assert client.update_and_wait(timeout_s=20) == version
            assert bytes(client.params) == _payload(version)
            tensors = ckpt.bytes_to_state_dict_views(client.params)
            assert float(tensors["lm_head.bias"][0]) == version
            del tensors
        info = local.latest_info()
        assert info.version == version and info.sha256 == ""     # no sha256 on this path
    assert local.counters == {"shm_loads": 7}                    # never a gRPC fetch
    assert remote.counters == {"grpc_loads": 7}                  # never shared memory
    writer = publisher.shm_writer
    assert publisher.counters == {"shm_publishes": 7}
    # Three files were made; every later version went into the oldest file nobody held.
    assert writer.counters["created"] == 3 and writer.counters["reused"] == 4
    assert local._shm.mapped == 3 and local._shm.locked == 1     # mapped once per file
    assert server.stats()["shm_published"] == 7 and server.wait_copied(6)
    local.close()
    remote.close()


def test_a_version_is_visible_only_whole(server, publisher):
    """The writer fills `<name>.tmp` and renames it when whole: while it writes, the version's
    name does not exist (a reader finds it missing) and the other kept versions read as they
    were. When it reuses the oldest file, that version's name is gone before the first byte
    changes."""
    reader = shm_reader.ShmReader()
    for version in (0, 1):
        publisher.publish(version, ckpt.state_dict_to_buffers(_state_dict(version)))
    writer = publisher.shm_writer
    path = lambda v: os.path.join(writer.directory, shm_lib.version_file_name(v))  # noqa: E731
    real_fill = writer._fill
    checked = []

    def fill_and_look(dst, views, total, new_version, readable, gone):
        names = os.listdir(writer.directory)
        assert shm_lib.version_file_name(new_version) + shm_lib.TMP_SUFFIX in names
        assert shm_lib.version_file_name(new_version) not in names
        half = len(views) // 2
        crc = real_fill(dst, views, total)          # whole, not yet renamed
        assert reader.load(path(new_version), total, crc) == (None, "missing")
        for v in gone:
            assert reader.load(path(v), total, zlib.crc32(_payload(v))) == (None, "missing")
        for v in readable:
            got, why = reader.load(path(v), total, zlib.crc32(_payload(v)))
            assert why == "" and bytes(got) == _payload(v)
            del got
        reader.release_unused()
        checked.append((new_version, half))
        return crc

    for new_version, readable, gone in ((2, (0, 1), ()), (3, (1, 2), (0,))):  # 3 reuses 0's
        writer._fill = lambda dst, views, total: fill_and_look(  # noqa: E731
            dst, views, total, new_version, readable, gone)
        publisher.publish(new_version, ckpt.state_dict_to_buffers(_state_dict(new_version)))
    assert [v for v, _ in checked] == [2, 3] and writer.counters["reused"] == 1
    client = _client(server)
    assert client.update_and_wait(timeout_s=20) == 3 and bytes(client.params) == _payload(3)
    client.close()
    reader.close()


def test_a_file_in_use_is_never_rewritten_and_unlink_keeps_it_readable(server, publisher):
    client = _client(server)
    publisher.publish(0, ckpt.state_dict_to_buffers(_state_dict(0)))
    assert client.update_and_wait(timeout_s=20) == 0
    held = client.params                      # an actor still using version 0's tensors
    tensors = ckpt.bytes_to_state_dict_views(held)
    for version in (1, 2, 3):                 # version 3 wants version 0's file back
        publisher.publish(version, ckpt.state_dict_to_buffers(_state_dict(version)))
        assert client.update_and_wait(timeout_s=20) == version
    writer = publisher.shm_writer
    assert writer.counters["held_by_reader"] == 1 and writer.counters["reused"] == 0
    assert bytes(held) == _payload(0)         # unlinked, still mapped, unchanged
    assert float(tensors["lm_head.bias"][0]) == 0.0
    del held, tensors
    for version in (4, 5):                    # nothing holds old files now: reused again
        publisher.publish(version, ckpt.state_dict_to_buffers(_state_dict(version)))
        assert client.update_and_wait(timeout_s=20) == version
    assert writer.counters["reused"] == 2
    assert client.counters == {"shm_loads": 6}
    # Only local clients: the server never copied a version (no second copy in its memory).
    assert server.stats().get("shm_copied", 0) == 0 and server.latest().payload is None
    client.close()


def test_corrupt_or_missing_file_falls_back_to_grpc_and_is_counted(server, publisher):
    client = _client(server, "shm")
    publisher.publish(0, ckpt.state_dict_to_buffers(_state_dict(0)))
    assert server.wait_copied(0)                 # the server's own, CRC-checked copy
    path = server.latest().shm_path
    with open(path, "r+b") as f:                 # something scribbles over the file
        f.seek(os.path.getsize(path) - 3)
        f.write(b"\xff\xff\xff")
    assert client.update_and_wait(timeout_s=20) == 0
    assert bytes(client.params) == _payload(0)   # from the server's copy, over gRPC
    assert client.counters == {"shm_fallbacks": 1, "shm_fallback_corrupt": 1, "grpc_loads": 1}

    publisher.publish(1, ckpt.state_dict_to_buffers(_state_dict(1)))
    assert server.wait_copied(1)
    os.unlink(server.latest().shm_path)
    assert client.update_and_wait(timeout_s=20) == 1 and bytes(client.params) == _payload(1)
    assert client.counters["shm_fallback_missing"] == 1 and client.counters["grpc_loads"] == 2
    client.close()


def test_clients_of_another_host_use_grpc(server, publisher):
    """auto: when the version's directory does not exist here (another host or container), the
    client fetches over gRPC without counting a fallback; grpc never looks."""
    auto, grpc_only = _client(server), _client(server, "grpc")
    publisher.publish(0, ckpt.state_dict_to_buffers(_state_dict(0)))
    assert server.wait_copied(0)
    directory = publisher.shm_writer.directory
    os.rename(directory, directory + ".elsewhere")   # as seen from another host
    try:
        for client in (auto, grpc_only):
            assert client.update_and_wait(timeout_s=20) == 0
            assert bytes(client.params) == _payload(0)
    finally:
        os.rename(directory + ".elsewhere", directory)
    assert auto.counters == {"shm_not_here": 1, "grpc_loads": 1}
    assert grpc_only.counters == {"grpc_loads": 1}
    auto.close()
    grpc_only.close()


def test_server_without_shm_gets_the_bytes_streamed(tmp_path):
    with VariableServer(publisher_token=TOKEN, shm_root=None) as server:
        pub = VariablePublisher(server.address, TOKEN, shm_dir=str(tmp_path))
        client = _client(server)
        _publish_and_fetch(pub, client, (0, 1))
        assert pub.counters == {"shm_refused": 1, "grpc_publishes": 2}
        assert client.counters == {"grpc_loads": 2}
        assert server.latest().shm_path == "" and server.latest().sha256
        pub.close()
        client.close()


def test_shm_publish_checks_finiteness_header_paths_and_republish(server, publisher, tmp_path):
    bad = _state_dict(0)
    bad["model.embed_tokens.weight"][3, 4] = float("nan")      # bf16
    with pytest.raises(PublishError, match="NaN or infinite") as e:
        publisher.publish(0, ckpt.state_dict_to_buffers(bad))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and server.latest() is None
    publisher.publish(0, ckpt.state_dict_to_buffers(_state_dict(0)))
    publisher.publish(0, ckpt.state_dict_to_buffers(_state_dict(0)))   # a resumed learner
    assert server.stats()["republished"] == 1
    with pytest.raises(PublishError, match="different payload"):
        publisher.publish(0, ckpt.state_dict_to_buffers(_state_dict(5)))

    # The server reads only .safetensors files under its shm_root, and checks the header.
    outside = tmp_path.parent / "outside.safetensors"
    outside.write_bytes(_payload(1))
    publish = grpc.insecure_channel(server.address).stream_unary(
        "/sao_actor_learner.variables.VariableService/Publish")
    metadata = (("x-sao-publisher-token", TOKEN),)
    inside = os.path.join(shm_lib.writer_root(str(tmp_path)), "x.safetensors")
    for path, payload, why in ((str(outside), _payload(1), "must be a .safetensors file"),
                               (inside, b"x" * 64, "payload rejected")):
        if why == "payload rejected":
            with open(inside, "wb") as f:
                f.write(payload)
        chunk = variables_pb2.PublishChunk(version=1, total_bytes=len(payload), last=True,
                                           crc32=zlib.crc32(payload), shm_path=path)
        with pytest.raises(grpc.RpcError) as e:
            publish(iter([chunk.SerializeToString()]), metadata=metadata, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()
    assert server.latest().version == 0


def test_writer_keeps_n_versions_and_cleans_up(tmp_path):
    root = shm_lib.writer_root(str(tmp_path))
    writer = shm_lib.ShmWriter(root, "gc", keep=2)
    for version in range(5):
        writer.write(version, [_payload(version)])
    names = sorted(n for n in os.listdir(writer.directory) if n != shm_lib.OWNER_FILE)
    assert names == [shm_lib.version_file_name(3), shm_lib.version_file_name(4)]
    # A crashed run's directory (its owner process is gone) is removed by the next writer;
    # a live one's is kept.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    crashed = os.path.join(root, "crashed-abc")
    os.makedirs(crashed)
    with open(os.path.join(crashed, shm_lib.OWNER_FILE), "w") as f:
        json.dump({"pid": int(dead), "start_time": 1}, f)
    other = shm_lib.ShmWriter(root, "other", keep=2)
    assert other.swept == [crashed] and os.path.isdir(writer.directory)
    writer.close()
    assert os.listdir(root) == [os.path.basename(other.directory)]
    other.close()
    assert not os.path.exists(root)            # the last writer out leaves nothing behind


def test_server_stop_removes_the_files_of_a_killed_learner(tmp_path):
    """A learner killed with SIGKILL cannot remove its directory; the variable server's stop
    does (its owner process is gone), and so removes the then empty root."""
    root = shm_lib.writer_root(str(tmp_path))
    script = ("import sys; from sao_actor_learner.variables import shm; "
              "w = shm.ShmWriter(sys.argv[1], 'killed'); w.write(0, [b'x' * 4096]); "
              "print(w.directory, flush=True); import os; os._exit(0)")   # no clean-up
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    left = subprocess.run([sys.executable, "-c", script, root], capture_output=True, text=True,
                          check=True, env=env).stdout.strip()
    assert sorted(os.listdir(left)) == [shm_lib.OWNER_FILE, shm_lib.version_file_name(0)]
    server = VariableServer(publisher_token=TOKEN, shm_root=root).start()
    server.stop(grace_s=0.1)
    assert not os.path.exists(root)


def test_a_root_other_users_could_enter_is_refused_and_gRPC_used(server, tmp_path):
    root = shm_lib.writer_root(str(tmp_path))
    os.makedirs(root, exist_ok=True)
    os.chmod(root, 0o755)
    with pytest.raises(shm_lib.ShmUnavailable, match="mode 0700"):
        shm_lib.ShmWriter(root, "open")
    pub = VariablePublisher(server.address, TOKEN, shm_dir=str(tmp_path))
    client = _client(server)
    _publish_and_fetch(pub, client, (0,))
    assert pub.counters == {"shm_unavailable": 1, "grpc_publishes": 1}
    assert client.counters == {"grpc_loads": 1}
    pub.close()
    client.close()


def test_weight_transport_config_names_the_choices():
    from sao_actor_learner.config import ConfigError, SAOConfig
    from sao_actor_learner.config import sections
    from sao_actor_learner.variables import client as client_lib
    assert sections.WEIGHT_TRANSPORTS == client_lib.WEIGHT_TRANSPORTS
    with pytest.raises(ConfigError, match="weight_transport='tcp': must be one of auto"):
        SAOConfig(weight_transport="tcp")
    with pytest.raises(ConfigError, match="weight_shm_dir='shm': must be an absolute path"):
        SAOConfig(weight_shm_dir="shm")
    assert SAOConfig(weight_transport="grpc", weight_shm_dir="").weight_transport == "grpc"
    with pytest.raises(ValueError, match="weight_transport='tcp': must be one of"):
        VariableClient("127.0.0.1:1", weight_transport="tcp")


def test_has_nonfinite_matches_torch_for_every_float_dtype():
    from sao_actor_learner.variables.security import has_nonfinite
    base = torch.tensor([0.0, -0.0, 1.0, -3.0e38, 3.0e38, 1e-40, -2.5])
    for dtype, name in ((torch.bfloat16, "BF16"), (torch.float16, "F16"),
                        (torch.float32, "F32"), (torch.float64, "F64")):
        for value in (0.5, float("nan"), float("inf"), float("-inf"), -1e-30):
            values = base.clone()
            values[2] = value
            values = values.to(dtype)
            expected = not bool(torch.isfinite(values).all())
            got = has_nonfinite(values.view(torch.uint8).numpy().tobytes(), name)
            assert got == expected, (name, value)


def test_threaded_checks_and_two_thread_crc_agree_with_inline(server, publisher, monkeypatch):
    """Large payloads take the writer's helper thread and the reader's two-thread CRC; forced
    here on small ones (thresholds 0): the same bytes, CRC-32s and NaN refusals."""
    from sao_actor_learner.variables import wire
    monkeypatch.setattr(shm_lib, "PIPELINE_MIN_BYTES", 0)
    monkeypatch.setattr(wire, "PARALLEL_CRC_MIN_BYTES", 0)
    client = _client(server)
    for version in (0, 1):
        publisher.publish(version, ckpt.state_dict_to_buffers(_state_dict(version)))
        assert client.update_and_wait(timeout_s=20) == version
        assert bytes(client.params) == _payload(version)
        assert server.latest().crc32 == zlib.crc32(_payload(version))
    assert client.counters == {"shm_loads": 2}
    bad = _state_dict(2)
    bad["model.norm.weight"][-1] = float("-inf")                # f32, the last chunk
    with pytest.raises(PublishError, match="NaN or infinite"):
        publisher.publish(2, ckpt.state_dict_to_buffers(bad))
    assert server.latest().version == 1
    client.close()


def test_remote_fetch_streams_while_the_server_copies(server, publisher, monkeypatch):
    """FetchWeights of a shared-memory version streams each chunk as soon as the server's copy
    has passed it; the client uses nothing before the whole payload's CRC-32 checks out. The
    copy is held at its half here: the fetch waits there, then completes."""
    import threading
    halfway, go = threading.Event(), threading.Event()
    real_read = shm_reader.ShmSource.read_into

    def slow_read(self, buf, crc32, chunk_bytes=shm_lib.COPY_CHUNK_BYTES, progress=None):
        def held(copied):
            progress(copied)
            if copied >= self.size // 2 and not go.is_set():
                halfway.set()
                assert go.wait(30)
        return real_read(self, buf, crc32, chunk_bytes=1024, progress=held)

    monkeypatch.setattr(shm_reader.ShmSource, "read_into", slow_read)
    client = VariableClient(server.address, update_period_s=0.01, weight_transport="grpc",
                            fetch_chunk_bytes=1024)
    publisher.publish(0, ckpt.state_dict_to_buffers(_state_dict(0)))
    assert server.stats().get("shm_copied", 0) == 0     # no copy until a gRPC client asks
    fetcher = threading.Thread(target=client.update_and_wait, kwargs={"timeout_s": 30})
    fetcher.start()
    assert halfway.wait(30)
    assert client.version == -1 and server.latest().payload is None   # held at the half
    go.set()
    fetcher.join(30)
    assert client.version == 0 and bytes(client.params) == _payload(0)
    assert server.wait_copied(0) and server.stats()["shm_copied"] == 1
    client.close()


def test_no_room_in_shared_memory_streams_every_version(server, publisher, monkeypatch):
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm_lib.os, "posix_fallocate", full)      # e.g. a 64 MB /dev/shm
    client = _client(server)
    _publish_and_fetch(publisher, client, (0, 1))
    assert publisher.counters == {"shm_unavailable": 1, "grpc_publishes": 2}
    assert os.listdir(publisher.shm_writer.directory) == [shm_lib.OWNER_FILE]   # no debris
    assert client.counters == {"grpc_loads": 2}
    client.close()
