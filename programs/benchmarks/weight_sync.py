r"""Weight sync: publish-and-fetch through the variable server vs a raw loopback socket copy.

For each model size (a Llama-like state dict of realistic tensor shapes: embeddings, per-layer
q/k/v/o and gate/up/down projections, norms, lm_head; bf16 by default, what an LLM learner
publishes; --dtype=fp32 also runs the server's finiteness check), four fresh processes are
started: the VariableServer (auth token, publisher token and SafetensorsValidator, as
builder.make_variable_server makes it), a bare gRPC server, one fetching client (a
VariableClient polling every --poll_s, then the actor's decode, as an actor does before
engine.load_weights) and a raw socket receiver. This process plays the learner. Each round,
interleaved (ours, bare, raw, ours, bare, raw, ...):

  ours  t0 = the learner's publish starts: the builder's serialize (ckpt.state_dict_to_buffers),
        VariablePublisher.publish (chunks + CRC-32; the server checks the auth and publisher
        tokens, size limits and the CRC-32 and runs the validator (names, shapes, dtypes)
        before the version becomes visible; it finishes the sha256 before Publish answers),
        the client sees the new version on its next poll, streams it, checks its size and
        CRC-32, and decodes it to tensors (ckpt.bytes_to_state_dict_views). t1 = the client
        holds the tensors.
  bare  the same two hops with gRPC alone, same transport options and message size: the same
        bytes as bytes messages, client-streamed to a bare server that keeps them in a list,
        then server-streamed to the client process, which only counts them. No tokens, checks,
        buffers or decoding: what gRPC itself costs.
  raw   the same payload bytes over one loopback TCP connection to another process: sendall of
        an 8-byte length and the bytes; the receiver recv_into's a preallocated, pre-touched
        buffer (reused every round) and notes the time of the last byte. No checks, no copies.

GB/s = payload bytes / (t1 - t0) (1 GB = 1e9 bytes); ratio = ours / raw (target >= 0.5). The
median of --repeats rounds is reported with the min-max spread, how long ours spent serializing
and in VariablePublisher.publish, and the peak RSS (VmHWM) of the server and client processes.
The first --warmup rounds are not timed: version 0 pins the validator's manifest, and from
version 3 on the server and the client assemble into reused buffers, as they do all through a
long run (the raw receiver's buffer is warm from the start). Ends with one JSON line of figures.

  OMP_NUM_THREADS=1 .venv/bin/python programs/benchmarks/weight_sync.py

Smoke run (tests/test_bench_weight_sync.py): --sizes=300K,1M --repeats=2 --warmup=1.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import resource
import socket
import statistics
import struct
import sys
import time
from typing import Dict, List, Tuple

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["10M", "50M", "100M", "250M", "500M"],
                  "Model sizes in parameters (K/M/G suffixes).")
flags.DEFINE_enum("dtype", "bf16", ["bf16", "fp32"], "Dtype of the published state dict.")
flags.DEFINE_integer("repeats", 3, "Timed rounds per size and path (after the warm-up).")
flags.DEFINE_integer("warmup", 3, "Untimed rounds first: version 0 pins the validator's "
                     "manifest; by version 3 the server and client reuse receive buffers, as "
                     "in a long run.")
flags.DEFINE_float("poll_s", 0.002, "The client's update_period_s (how often it polls).")
flags.DEFINE_integer("chunk_bytes", 0, "Publisher and server chunk size; 0: their defaults.")
flags.DEFINE_integer("seed", 0, "Seed of the random weights.")

AUTH_TOKEN = "weight-sync-benchmark-auth-token"
PUBLISHER_TOKEN = "weight-sync-benchmark-publisher-token"
_LEN = struct.Struct("<Q")


def learner_serialize(state_dict):
    """The learner's serialize (builder.make_learner)."""
    from sao_actor_learner.models import checkpoint as ckpt
    return ckpt.state_dict_to_buffers(state_dict)


def actor_decode(payload):
    """The actor's decode (builder.make_actor), before engine.load_weights."""
    from sao_actor_learner.models import checkpoint as ckpt
    return ckpt.bytes_to_state_dict_views(payload)


def parse_size(text: str) -> int:
    """'100M' -> 100_000_000 parameters."""
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    number = float(text[:-1] if text[-1:] in "KMG" else text)
    if number <= 0:
        raise ValueError(f"--sizes entry {text!r}: must be a positive parameter count")
    return int(number * scale)


def model_shapes(num_params: int) -> Dict[str, Tuple[int, ...]]:
    """Llama-like tensor shapes with about `num_params` parameters.

    Hidden size d grows with the target; vocabulary 32000 (8192 below 20M parameters); FFN
    width ~8/3 d rounded to 64; layers fill what the embeddings and lm_head leave.
    """
    d = 128
    for hidden, at_least in ((256, 5 * 10**6), (512, 3 * 10**7), (768, 8 * 10**7),
                             (1024, 2 * 10**8), (1536, 4 * 10**8), (2048, 10**9)):
        if num_params >= at_least:
            d = hidden
    vocab = 32000 if num_params >= 2 * 10**7 else (8192 if num_params >= 10**6 else 1024)
    ffn = max(64, (8 * d // 3 + 63) // 64 * 64)
    per_layer = 4 * d * d + 3 * d * ffn + 2 * d
    layers = max(1, round((num_params - 2 * vocab * d - d) / per_layer))
    shapes = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{proj}.weight"] = (d, d)
        shapes[p + "mlp.gate_proj.weight"] = (ffn, d)
        shapes[p + "mlp.up_proj.weight"] = (ffn, d)
        shapes[p + "mlp.down_proj.weight"] = (d, ffn)
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (vocab, d)
    return shapes


def make_state_dict(shapes: Dict[str, Tuple[int, ...]], dtype: str, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    return {name: (torch.randn(shape, generator=g) * 0.02).to(torch_dtype)
            for name, shape in shapes.items()}


def _peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss, not inherited from the parent)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ---------------------------------------------------------------------------------- child processes

def _serve(conn, chunk_bytes: int) -> None:
    """Child: the variable server, configured as builder.make_variable_server does."""
    from sao_actor_learner.variables import SafetensorsValidator, VariableServer
    kwargs = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
    if chunk_bytes:
        kwargs["max_message_bytes"] = max(8 << 20, chunk_bytes + (1 << 20))
    server = VariableServer(publisher_token=PUBLISHER_TOKEN, auth_token=AUTH_TOKEN,
                            validate_payload=SafetensorsValidator(), **kwargs).start()
    conn.send(server.address)
    conn.recv()                                     # "stop"
    server.stop(grace_s=0.5)
    conn.send(_peak_rss_mb())


def _serve_bare_grpc(conn) -> None:
    """Child: gRPC and nothing else: Put stores the streamed messages, Get streams them back
    (the variable server's transport options; no tokens, checks, copies or buffers of ours)."""
    from concurrent import futures

    import grpc
    stored: List[bytes] = []

    def put(messages, context):
        stored.clear()
        stored.extend(messages)
        return b""

    def get(request, context):
        yield from stored

    handlers = {"Put": grpc.stream_unary_rpc_method_handler(put),
                "Get": grpc.unary_stream_rpc_method_handler(get)}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=_bare_options())
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("Bare", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    conn.send(f"127.0.0.1:{port}")
    conn.recv()                                     # "stop"
    server.stop(grace=0.5)
    conn.send(_peak_rss_mb())


def _bare_options():
    from sao_actor_learner.variables import wire
    return [("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_receive_message_length", 64 << 20), *wire.BULK_TRANSFER_OPTIONS]


def _fetch(conn, address: str, bare_address: str, poll_s: float) -> None:
    """Child: an actor's fetch path: VariableClient, then the actor's decode, per version."""
    from sao_actor_learner.variables import VariableClient
    import grpc
    client = VariableClient(address, update_period_s=poll_s, auth_token=AUTH_TOKEN)
    bare = grpc.insecure_channel(bare_address, options=_bare_options())
    bare_get = bare.unary_stream("/Bare/Get")
    conn.send("ready")
    while True:
        version = conn.recv()
        if version is None:
            break
        if version == "bare":                       # the bare gRPC path: receive, nothing else
            got = sum(len(message) for message in bare_get(b""))
            conn.send((time.perf_counter(), got))
            continue
        client.wait_for_version(version, timeout_s=600)
        held, params = client.get_variables()
        tensors = actor_decode(params)
        done = time.perf_counter()
        conn.send((held, done, len(tensors), sum(t.numel() for t in tensors.values())))
        del tensors, params
    client.close()
    bare.close()
    conn.send(_peak_rss_mb())


def _raw_receive(conn, max_bytes: int) -> None:
    """Child: the raw loop: recv_into one preallocated, pre-touched buffer, reused every round."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    buf = bytearray(max_bytes)
    view = memoryview(buf)
    for i in range(0, max_bytes, 4096):             # touch every page before timing
        buf[i] = 1
    conn.send(listener.getsockname()[1])
    sock, _ = listener.accept()
    header = bytearray(_LEN.size)
    while True:
        got = 0
        while got < _LEN.size:
            n = sock.recv_into(memoryview(header)[got:])
            if not n:
                sock.close()
                conn.send(_peak_rss_mb())
                return
            got += n
        (total,) = _LEN.unpack(header)
        got = 0
        while got < total:
            n = sock.recv_into(view[got:total])
            if not n:
                raise ConnectionError(f"raw sender closed after {got} of {total} bytes")
            got += n
        conn.send((time.perf_counter(), got))


# ---------------------------------------------------------------------------------- measurement

def _summary(times: List[float], num_bytes: int) -> Dict[str, float]:
    median = statistics.median(times)
    return {"median_s": median, "gbps": num_bytes / median / 1e9,
            "gbps_min": num_bytes / max(times) / 1e9, "gbps_max": num_bytes / min(times) / 1e9}


def _messages(parts, chunk_bytes: int):
    """The payload (a list of buffers) as bytes messages of `chunk_bytes` (the bare gRPC path)."""
    pending, size = [], 0
    for part in parts:
        view = memoryview(part).cast("B")
        offset = 0
        while offset < view.nbytes:
            take = min(chunk_bytes - size, view.nbytes - offset)
            pending.append(view[offset:offset + take])
            size += take
            offset += take
            if size == chunk_bytes:
                yield b"".join(pending)
                pending, size = [], 0
    if pending:
        yield b"".join(pending)


def _reply(conn, what: str, timeout_s: float = 60.0):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer from the {what} process within {timeout_s} s")
    return conn.recv()


def measure_size(label: str, num_params: int, ctx) -> Dict:
    """Interleaved ours / bare gRPC / raw rounds for one model size; fresh child processes."""
    import grpc

    from sao_actor_learner.variables import VariablePublisher

    shapes = model_shapes(num_params)
    state_dict = make_state_dict(shapes, FLAGS.dtype, FLAGS.seed)
    params = sum(t.numel() for t in state_dict.values())
    payload_bytes = sum(memoryview(p).nbytes for p in learner_serialize(state_dict))

    server_conn, child = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(child, FLAGS.chunk_bytes), daemon=True)
    server.start()
    address = _reply(server_conn, "server")
    bare_conn, child = ctx.Pipe()
    bare = ctx.Process(target=_serve_bare_grpc, args=(child,), daemon=True)
    bare.start()
    bare_address = _reply(bare_conn, "bare gRPC server")
    client_conn, child = ctx.Pipe()
    client = ctx.Process(target=_fetch, args=(child, address, bare_address, FLAGS.poll_s),
                         daemon=True)
    client.start()
    _reply(client_conn, "client")
    raw_conn, child = ctx.Pipe()
    raw = ctx.Process(target=_raw_receive, args=(child, payload_bytes), daemon=True)
    raw.start()
    sock = socket.create_connection(("127.0.0.1", _reply(raw_conn, "raw receiver")))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    pub_kwargs = {"chunk_bytes": FLAGS.chunk_bytes} if FLAGS.chunk_bytes else {}
    publisher = VariablePublisher(address, PUBLISHER_TOKEN, auth_token=AUTH_TOKEN, **pub_kwargs)
    bare_channel = grpc.insecure_channel(bare_address, options=_bare_options())
    bare_put = bare_channel.stream_unary("/Bare/Put")
    ours, bare_times, raw_times = [], [], []
    split = {"serialize_s": [], "publish_s": [], "held_after_publish_s": []}
    try:
        for version in range(FLAGS.warmup + FLAGS.repeats):
            # ours: the learner's publish (serialize + stream) until the actor holds tensors.
            client_conn.send(version)
            t0 = time.perf_counter()
            payload = learner_serialize(state_dict)
            t_serialized = time.perf_counter()
            publisher.publish(version, payload)
            t_published = time.perf_counter()
            held, t_done, n_tensors, n_params = _reply(client_conn, "client", 600)
            if held != version or n_tensors != len(shapes) or n_params != params:
                raise RuntimeError(f"client holds version {held} with {n_tensors} tensors / "
                                   f"{n_params} params; expected {version}, {len(shapes)}, "
                                   f"{params}")
            # bare gRPC: the same bytes, Put then Get in publisher.chunk_bytes messages.
            b0 = time.perf_counter()
            bare_put(_messages(payload, publisher.chunk_bytes), timeout=600)
            client_conn.send("bare")
            b_done, got = _reply(client_conn, "client", 600)
            if got != payload_bytes:
                raise RuntimeError(f"bare gRPC client got {got} of {payload_bytes} bytes")
            # raw: the same bytes over a loopback socket.
            r0 = time.perf_counter()
            sock.sendall(_LEN.pack(payload_bytes))
            for part in (payload if isinstance(payload, list) else [payload]):
                sock.sendall(part)
            r_done, got = _reply(raw_conn, "raw receiver", 600)
            if got != payload_bytes:
                raise RuntimeError(f"raw receiver got {got} of {payload_bytes} bytes")
            del payload
            if version < FLAGS.warmup:
                continue
            ours.append(t_done - t0)
            bare_times.append(b_done - b0)
            raw_times.append(r_done - r0)
            split["serialize_s"].append(t_serialized - t0)
            split["publish_s"].append(t_published - t_serialized)
            # < 0: the client held the tensors before Publish answered (the server finishes the
            # sha256 while clients fetch).
            split["held_after_publish_s"].append(t_done - t_published)
    finally:
        publisher.close()
        bare_channel.close()
        client_conn.send(None)
        sock.close()
        server_conn.send("stop")
        bare_conn.send("stop")
        rss = {}
        for what, conn in (("client", client_conn), ("server", server_conn),
                           ("raw_receiver", raw_conn), ("bare_server", bare_conn)):
            rss[what] = conn.recv() if conn.poll(30) else float("nan")
        for p in (server, bare, client, raw):
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    ours_s, raw_s = _summary(ours, payload_bytes), _summary(raw_times, payload_bytes)
    bare_s = _summary(bare_times, payload_bytes)
    ours_no_ser = [t - s for t, s in zip(ours, split["serialize_s"])]
    return {
        "size": label, "params": params, "tensors": len(shapes), "dtype": FLAGS.dtype,
        "payload_bytes": payload_bytes,
        "ours_gbps": ours_s["gbps"], "ours_gbps_min": ours_s["gbps_min"],
        "ours_gbps_max": ours_s["gbps_max"], "ours_s": ours_s["median_s"],
        "raw_gbps": raw_s["gbps"], "raw_gbps_min": raw_s["gbps_min"],
        "raw_gbps_max": raw_s["gbps_max"], "raw_s": raw_s["median_s"],
        "bare_grpc_gbps": bare_s["gbps"], "bare_grpc_gbps_min": bare_s["gbps_min"],
        "bare_grpc_gbps_max": bare_s["gbps_max"],
        "ratio": ours_s["gbps"] / raw_s["gbps"],
        "bare_grpc_ratio": bare_s["gbps"] / raw_s["gbps"],
        "ratio_without_serialize": _summary(ours_no_ser, payload_bytes)["gbps"] / raw_s["gbps"],
        **{k: statistics.median(v) for k, v in split.items()},
        "server_peak_rss_mb": rss["server"], "client_peak_rss_mb": rss["client"],
        "raw_receiver_peak_rss_mb": rss["raw_receiver"],
        "bare_grpc_server_peak_rss_mb": rss["bare_server"],
    }


def main(argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    if FLAGS.warmup < 1:
        raise app.UsageError(f"--warmup={FLAGS.warmup}: must be >= 1 (version 0 pins the "
                             "validator's manifest)")
    if FLAGS.repeats < 1:
        raise app.UsageError(f"--repeats={FLAGS.repeats}: must be >= 1")
    if FLAGS.poll_s <= 0:
        raise app.UsageError(f"--poll_s={FLAGS.poll_s}: must be > 0")
    sizes = [(s, parse_size(s)) for s in FLAGS.sizes]
    ctx = multiprocessing.get_context("spawn")
    rows = []
    for label, n in sizes:
        rows.append(measure_size(label, n, ctx))
        r = rows[-1]
        logging.warning("%s: ours %.3f GB/s, raw %.3f GB/s, ratio %.2f", label, r["ours_gbps"],
                        r["raw_gbps"], r["ratio"])
    print(f"\nWeight sync, {FLAGS.dtype}, median of {FLAGS.repeats} interleaved rounds "
          f"(min-max), client poll {FLAGS.poll_s * 1e3:.0f} ms, load {os.getloadavg()[0]:.2f}")
    print(f"{'size':>6}{'params':>13}{'MB':>6}{'ours GB/s':>19}{'bare gRPC GB/s':>19}"
          f"{'raw GB/s':>19}{'ours/raw':>9}{'bare/raw':>9}{'ours s':>7}{'pub s':>7}"
          f"{'srv MB':>7}{'cli MB':>7}")
    for r in rows:
        cells = [f"{r[k + '_gbps']:.2f} ({r[k + '_gbps_min']:.2f}-{r[k + '_gbps_max']:.2f})"
                 for k in ("ours", "bare_grpc", "raw")]
        print(f"{r['size']:>6}{r['params']:>13,}{r['payload_bytes'] / 1e6:>6.0f}"
              f"{cells[0]:>19}{cells[1]:>19}{cells[2]:>19}{r['ratio']:>9.2f}"
              f"{r['bare_grpc_ratio']:>9.2f}{r['ours_s']:>7.3f}{r['publish_s']:>7.3f}"
              f"{r['server_peak_rss_mb']:>7.0f}{r['client_peak_rss_mb']:>7.0f}")
    ratios = [r["ratio"] for r in rows]
    print(json.dumps({"benchmark": "weight_sync", "dtype": FLAGS.dtype, "repeats": FLAGS.repeats,
                      "poll_s": FLAGS.poll_s, "target_ratio": 0.5,
                      "min_ratio": min(ratios), "target_met": min(ratios) >= 0.5,
                      "load_avg_1m": os.getloadavg()[0], "rows": rows}))


if __name__ == "__main__":
    app.run(main)
