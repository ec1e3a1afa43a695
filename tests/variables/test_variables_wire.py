"""The variable server's copy-free weight path: hand-framed chunk messages checked
against protobuf, CRC-32 checks on both hops, receive buffers reused only when nothing references
them, and state dicts streamed as views / decoded as views. Real gRPC on 127.0.0.1, no mocks."""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
import zlib
from concurrent import futures

import grpc
import pytest
import safetensors.torch
import torch

from sao_actor_learner.models import checkpoint as ckpt
from sao_actor_learner.protos_gen import variables_pb2
from sao_actor_learner.variables import (PUBLISHER_TOKEN_METADATA_KEY, SafetensorsValidator,
                                         VariableClient, VariableClientError, VariablePublisher,
                                         VariableServer)
from sao_actor_learner.variables import wire
from sao_actor_learner.variables.buffers import BufferPool, PayloadAssembler
from sao_actor_learner.variables.server import SERVICE_NAME

pytestmark = pytest.mark.timeout(120)
TOKEN = "wire-test-publisher-token"
AUTH = ((PUBLISHER_TOKEN_METADATA_KEY, TOKEN),)


# ------------------------------------------------------------------------------ wire framing

def _random_chunk(rng: random.Random, cls):
    msg = cls(version=rng.randrange(0, 1 << 40), data=rng.randbytes(rng.randrange(0, 3000)))
    if rng.random() < 0.5:
        msg.total_bytes = rng.randrange(0, 1 << 50)
    if rng.random() < 0.5:
        msg.sha256 = rng.randbytes(32).hex()
    if rng.random() < 0.5:
        msg.format = rng.choice(["safetensors", "", "é-ünïcode"])
    if rng.random() < 0.5:
        msg.crc32 = rng.randrange(0, 1 << 32)
    if cls is variables_pb2.PublishChunk and rng.random() < 0.5:
        msg.last = True
        msg.dropped_total = rng.randrange(0, 1000)
    return msg


@pytest.mark.parametrize("cls", [variables_pb2.PublishChunk, variables_pb2.WeightsChunk])
def test_split_and_encode_agree_with_protobuf(cls):
    rng = random.Random(0)
    for _ in range(300):
        msg = _random_chunk(rng, cls)
        raw = msg.SerializeToString()                       # protobuf puts data 2nd
        rest, data = wire.split_data_field(raw)
        parsed = cls.FromString(rest)
        assert bytes(data) == msg.data and not parsed.data
        parsed.data = bytes(data)
        assert parsed == msg
        head = cls()
        head.CopyFrom(msg)
        head.ClearField("data")
        pieces = [msg.data[:7], memoryview(msg.data)[7:100], bytearray(msg.data[100:])]
        framed = wire.encode_chunk(head.SerializeToString(), pieces)   # data last
        assert cls.FromString(framed) == msg


def test_split_takes_the_last_data_field_like_protobuf_and_refuses_bad_wire_data():
    raw = (variables_pb2.WeightsChunk(version=3, data=b"first").SerializeToString()
           + variables_pb2.WeightsChunk(data=b"second", format="x").SerializeToString())
    rest, data = wire.split_data_field(raw)
    expected = variables_pb2.WeightsChunk.FromString(raw)
    assert bytes(data) == expected.data == b"second"
    got = variables_pb2.WeightsChunk.FromString(rest)
    assert (got.version, got.format, got.data) == (3, "x", b"")
    for bad, why in [(b"\x12\x05abc", "claims 5 bytes"), (b"\x08\xff", "truncated varint"),
                     (b"\x00\x01", "field number 0"), (b"\x0b\x0c", "wire type 3"),
                     (b"\x08" + b"\xff" * 11, "longer than 10"), (b"\x09abc", "runs past"),
                     (b"\x08\x01" * 65, "more than 64 fields")]:
        with pytest.raises(wire.MalformedMessage, match=why):
            wire.split_data_field(bad)
    rng = random.Random(1)
    for _ in range(2000):                                   # garbage never crashes otherwise
        garbage = rng.randbytes(rng.randrange(0, 64))
        try:
            rest, data = wire.split_data_field(garbage)
        except wire.MalformedMessage:
            continue
        assert len(rest) + data.nbytes <= len(garbage)
    assert wire.encode_varint(0) == b"\x00" and wire.encode_varint(300) == b"\xac\x02"


# ------------------------------------------------------------------------------ buffer reuse

def test_buffer_pool_reuses_only_unreferenced_buffers_of_the_same_size():
    pool = BufferPool(max_spares=1)
    buf = bytearray(b"x" * 1000)
    view = memoryview(buf)[10:20]            # someone still reads it
    pool.give(buf)
    del buf
    assert pool.take(1000) is None
    del view
    assert pool.take(999) is None            # exact size only
    reused = pool.take(1000)
    assert reused is not None and reused == b"x" * 1000 and pool.reused == 1
    held = reused                            # a plain reference blocks reuse too
    pool.give(reused)
    del reused
    assert pool.take(1000) is None
    tensor = torch.frombuffer(held, dtype=torch.uint8)       # so does a tensor view
    del held
    assert pool.take(1000) is None
    del tensor
    assert pool.take(1000) is not None and pool.take(1000) is None
    with pytest.raises(ValueError, match="max_spares"):
        BufferPool(max_spares=-1)


def test_payload_assembler_in_place_and_growing():
    pool = BufferPool()
    pool.give(bytearray(b"?" * 10))
    for expect_in_place in (True, False):
        asm = PayloadAssembler(10, pool)
        for piece in (b"abc", memoryview(b"defg"), bytearray(b"hij")):
            asm.add(piece)
        assert asm.payload() == b"abcdefghij" and asm.received == 10
        with pytest.raises(ValueError, match="more than the announced 10"):
            asm.add(b"k")
        del asm


# ------------------------------------------------------------------------------ state dicts

def safetensors_offsets(data: bytes):
    length = int.from_bytes(data[:8], "little")
    return {k: v["data_offsets"] for k, v in json.loads(data[8:8 + length]).items()}


def test_state_dict_buffers_views_and_copies():
    sd = {"b.weight": torch.randn(4, 6).to(torch.bfloat16), "a.ids": torch.arange(5),
          "flag": torch.tensor(True), "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5),
          "half": torch.randn(3).half(), "t": torch.randn(2, 3).t()}   # non-contiguous
    sd["tied"] = sd["a.ids"]
    parts = ckpt.state_dict_to_buffers(sd)
    data = ckpt.state_dict_to_bytes(sd)
    assert isinstance(data, bytes) and b"".join(parts) == data
    assert parts[1].ctypes.data == sd["a.ids"].data_ptr()    # the largest items first, in place
    for decoded in (safetensors.torch.load(data), ckpt.bytes_to_state_dict(data),
                    ckpt.bytes_to_state_dict_views(bytearray(data))):
        assert decoded.keys() == sd.keys()
        for name, t in sd.items():
            assert decoded[name].dtype == t.dtype and torch.equal(decoded[name], t), name
    # Files written by safetensors itself decode too.
    theirs = safetensors.torch.save({k: v.contiguous().clone() for k, v in sd.items()})
    assert torch.equal(ckpt.bytes_to_state_dict(theirs)["b.weight"], sd["b.weight"])
    buf = bytearray(data)
    views, copies = ckpt.bytes_to_state_dict_views(buf), ckpt.bytes_to_state_dict(buf)
    start = len(parts[0]) + safetensors_offsets(data)["b.weight"][0]
    buf[start] ^= 0xFF                       # the views see the payload, the copies do not
    assert not torch.equal(views["b.weight"], sd["b.weight"])
    assert torch.equal(copies["b.weight"], sd["b.weight"])
    with pytest.raises(ValueError, match="too short"):
        ckpt.bytes_to_state_dict(b"abc")
    with pytest.raises(ValueError, match="do not hold"):
        ckpt.bytes_to_state_dict(data[:-2])
    with pytest.raises(TypeError, match="not a tensor"):
        ckpt.state_dict_to_buffers({"x": [1, 2]})


# ------------------------------------------------------------------------------ end to end

@pytest.fixture
def server():
    srv = VariableServer(publisher_token=TOKEN, chunk_bytes=64 << 10, keep_versions=2,
                         validate_payload=SafetensorsValidator()).start()
    yield srv
    srv.stop(grace_s=0.1)


def _state_dict(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(300, 64, generator=g).to(torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64, generator=g),
            "lm_head.weight": torch.randn(300, 64, generator=g).to(torch.bfloat16)}


def test_buffers_publish_crc_on_both_hops_and_reuse_never_changes_held_versions(server):
    publisher = VariablePublisher(server.address, TOKEN, chunk_bytes=50_000)
    client = VariableClient(server.address, update_period_s=0.01, fetch_chunk_bytes=30_000)
    held = {}
    for version in range(6):
        sd = _state_dict(version)
        publisher.publish(version, ckpt.state_dict_to_buffers(sd))
        expected = ckpt.state_dict_to_bytes(sd)
        assert server.latest().sha256 == hashlib.sha256(expected).hexdigest()
        assert server.latest().crc32 == zlib.crc32(expected)
        assert client.wait_for_version(version, timeout_s=30) == version
        assert client.params == expected
        held[version] = (expected, client.params,                 # raw payload and views of it
                         ckpt.bytes_to_state_dict_views(client.params), server.latest().payload)
        if version >= 2:
            del held[version - 1]            # dropped: its buffers may now be reused; version 0
                                             # stays held (its buffers must never be)
    assert server._store.buffers.reused >= 1 and client._buffers.reused >= 1
    for version, (expected, params, views, server_view) in held.items():
        assert params == expected and bytes(server_view) == expected
        assert torch.equal(views["lm_head.weight"], _state_dict(version)["lm_head.weight"])
    client.close()
    publisher.close()


def test_publisher_crc_is_checked_and_sha256_alone_still_works(server):
    channel = grpc.insecure_channel(server.address)
    publish = channel.stream_unary(f"/{SERVICE_NAME}/Publish")
    payload = ckpt.state_dict_to_bytes(_state_dict(0))

    def chunks(version, **last_fields):
        head = variables_pb2.PublishChunk(version=version, total_bytes=len(payload), last=True,
                                          **last_fields).SerializeToString()
        return iter([wire.encode_chunk(head, [payload])])

    with pytest.raises(grpc.RpcError) as e:
        publish(chunks(0, crc32=zlib.crc32(payload) ^ 1), metadata=AUTH, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "crc32 mismatch" in e.value.details() and server.latest() is None
    with pytest.raises(grpc.RpcError) as e:                  # a right CRC, a wrong sha256
        publish(chunks(0, crc32=zlib.crc32(payload), sha256="0" * 64), metadata=AUTH, timeout=10)
    assert "sha256 mismatch" in e.value.details()
    publish(chunks(0, sha256=hashlib.sha256(payload).hexdigest()), metadata=AUTH, timeout=10)
    publish(chunks(1, crc32=zlib.crc32(payload)), metadata=AUTH, timeout=10)
    assert server.latest().version == 1
    assert server.latest().sha256 == hashlib.sha256(payload).hexdigest()
    channel.close()


class _LyingServer:
    """A real gRPC server that answers LatestVersion and FetchWeights with a chosen lie."""

    def __init__(self, payload: bytes, crc32=None, sha256="", data=None):
        self.payload, self.crc32, self.sha256 = payload, crc32, sha256
        self.data = payload if data is None else data

    def latest(self, raw, context):
        return variables_pb2.VersionInfo(version=0, num_bytes=len(self.payload))

    def fetch(self, raw, context):
        head = variables_pb2.WeightsChunk(version=0, total_bytes=len(self.payload),
                                          sha256=self.sha256)
        if self.crc32 is not None:
            head.crc32 = self.crc32
        yield wire.encode_chunk(head.SerializeToString(), [self.data])

    def start(self):
        handlers = {
            "LatestVersion": grpc.unary_unary_rpc_method_handler(
                self.latest, response_serializer=lambda m: m.SerializeToString()),
            "FetchWeights": grpc.unary_stream_rpc_method_handler(self.fetch)}
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        return self


def test_client_refuses_payloads_that_fail_the_servers_checksum():
    payload = os.urandom(10_000)
    flipped = bytearray(payload)
    flipped[1234] ^= 0x10
    cases = [(dict(crc32=zlib.crc32(payload), data=bytes(flipped)), "CRC-32"),
             (dict(sha256=hashlib.sha256(payload).hexdigest(), data=bytes(flipped)), "sha256"),
             (dict(crc32=zlib.crc32(payload), data=payload[:-1]), "9999 of 10000")]
    for lie, why in cases:
        fake = _LyingServer(payload, **lie).start()
        client = VariableClient(f"127.0.0.1:{fake.port}", update_period_s=0.01)
        with pytest.raises(VariableClientError, match=why):
            client.fetch_version(0, timeout_s=10)
        deadline = time.monotonic() + 10
        while why not in (client.last_error or "") and time.monotonic() < deadline:
            client.update()                  # the actor's path: a background fetch
            time.sleep(0.01)
        assert why in client.last_error
        assert client.version == -1 and client.params is None
        client.close()
        fake.server.stop(0)
    for honest in (dict(crc32=zlib.crc32(payload)),
                   dict(sha256=hashlib.sha256(payload).hexdigest())):
        fake = _LyingServer(payload, **honest).start()
        client = VariableClient(f"127.0.0.1:{fake.port}", update_period_s=0.01)
        assert client.update_and_wait(timeout_s=10) == 0 and client.params == payload
        client.close()
        fake.server.stop(0)


def test_finiteness_check_in_the_tensors_own_precision_is_exact():
    import numpy as np
    from safetensors.numpy import save
    from sao_actor_learner.variables.security import PayloadRejected
    accept = {"F32 whose sum overflows": np.full(1000, 3e38, np.float32),
              "F16 whose sum overflows F16": np.full(100, 6e4, np.float16),
              "F64": np.arange(5, dtype=np.float64)}
    refuse = {"inf and -inf": np.array([np.inf, -np.inf, 1], np.float32),
              "NaN in F16": np.array([1, np.nan], np.float16),
              "-inf in F64": np.array([-np.inf], np.float64)}
    for what, values in accept.items():
        SafetensorsValidator()(0, save({"w": values}), "safetensors")
    for what, values in refuse.items():
        with pytest.raises(PayloadRejected, match="NaN or infinite"):
            SafetensorsValidator()(0, save({"w": values}), "safetensors")


def test_finiteness_check_covers_bfloat16():
    """bf16 (what an LLM learner publishes) has no numpy dtype: NaN/inf are found from the bits,
    checked here against torch's own bfloat16 values."""
    import torch
    from safetensors.torch import save
    from sao_actor_learner.variables.security import PayloadRejected
    finite = torch.tensor([0.0, -0.0, 1.0, -3.0e38, 3.0e38, 1e-40, -2.5], dtype=torch.bfloat16)
    SafetensorsValidator()(0, save({"w": finite}), "safetensors")
    for bad in (float("nan"), float("inf"), float("-inf")):
        values = finite.clone()
        values[3] = bad
        with pytest.raises(PayloadRejected, match="NaN or infinite"):
            SafetensorsValidator()(0, save({"w": values}), "safetensors")
