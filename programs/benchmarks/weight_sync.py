r"""Weight sync on one host and to remote actors, each against its floor, side by side.

For each model size (a Llama-like state dict of realistic tensor shapes: embeddings, per-layer
q/k/v/o and gate/up/down projections, norms, lm_head; bf16 by default, what an LLM learner
publishes), fresh processes are started: the VariableServer (auth token, publisher token,
SafetensorsValidator, shared-memory root, as builder.make_variable_server makes it), a bare gRPC
server, a *local* actor (a VariableClient with weight_transport=auto, polling every --poll_s,
then the actor's decode, as an actor does before engine.load_weights), a *remote* actor (the
same with weight_transport=grpc: what an actor on another host does) and a raw socket receiver.
This process plays the learner. Each round, interleaved:

  shm     t0 = the learner's publish starts: serialize (ckpt.state_dict_to_buffers), then
          VariablePublisher.publish with shared memory: the ShmWriter copies the payload into
          its file (reused once warm), computing the CRC-32 and checking finiteness chunk by
          chunk, renames it into place and announces it in a one-message Publish (the server
          checks the tokens and the header: layout, names, shapes, dtypes); the local actor sees
          the version on its next poll, maps the file (its mapping is reused once warm), checks
          the CRC-32 and decodes views of it. t1 = it holds the tensors.
  memcpy  the same payload bytes copied into a pre-touched buffer in this process (one
          memoryview assignment per buffer): the floor of any copy on one host.
  remote  the same publish (the learner sits beside the server); the remote actor polls and
          streams the version over gRPC: its FetchWeights starts the server's copy of the file
          into its own memory (CRC-checked) and streams each chunk once copied; the actor checks
          size and CRC-32 and decodes. t1 = it holds the tensors.
  raw     the same payload bytes over one loopback TCP connection to another process: sendall
          of an 8-byte length and the bytes; the receiver recv_into's a preallocated,
          pre-touched buffer (reused every round) and notes the time of the last byte. The floor
          of any one network hop.
  two_hop the previous design's path, for comparison: the learner streams the bytes over gRPC
          (VariablePublisher without shared memory) to a server of its own, which checks CRC-32,
          validator and sha256; the remote actor fetches as above (payloads up to
          --two_hop_max_mb only: its server and client hold ~5 payloads more).
  bare    gRPC alone over the same two hops (same transport options and message size): the
          bytes client-streamed to a bare server that keeps them in a list (Put), then
          server-streamed to the remote actor's process, which only counts them (Get; also
          reported alone: one bare hop).

GB/s = payload bytes / (t1 - t0) (1 GB = 1e9 bytes). shm_ratio = shm / memcpy and ratio =
remote / raw (targets >= 0.5 each). Medians of --repeats rounds with the min-max spread, the
serialize / publish / held-after-publish splits, the local actor's shared-memory counters
(every timed round must be a shm load) and the peak RSS (VmHWM) of each process. The first
--warmup rounds are not timed: version 0 pins the validator's manifest, and by then the writer
reuses its files, the actors their mappings and the server and clients their receive buffers,
as all through a long run. After each publish the benchmark waits for the server's copy
(wait_copied starts it when no gRPC fetch did) before it times anything else. Ends with one
JSON line of figures.

  OMP_NUM_THREADS=1 .venv/bin/python programs/benchmarks/weight_sync.py

Smoke run (tests/entry_points/test_bench_weight_sync.py): --sizes=300K,1M --repeats=2 --warmup=1.
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
                     "manifest; by round 3 files, mappings and receive buffers are reused, as "
                     "in a long run.")
flags.DEFINE_float("poll_s", 0.002, "The client's update_period_s (how often it polls).")
flags.DEFINE_integer("chunk_bytes", 0, "Publisher and server chunk size; 0: their defaults.")
flags.DEFINE_integer("seed", 0, "Seed of the random weights.")
flags.DEFINE_string("shm_dir", "/dev/shm", "Shared-memory directory (a tmpfs).")
flags.DEFINE_integer("two_hop_max_mb", 600, "Run the two-hop path (a second server and client, "
                     "~5 payloads of memory more) only for payloads up to this many MB.")

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

def _serve(conn, chunk_bytes: int, shm_dir: str) -> None:
    """Child: the variable server, configured as builder.make_variable_server does. Answers
    ("copied", version) once it holds that version's bytes (its copy of a shared-memory
    version, started then if no fetch started it)."""
    from sao_actor_learner.variables import SafetensorsValidator, VariableServer
    from sao_actor_learner.variables.shm import writer_root
    kwargs = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
    if chunk_bytes:
        kwargs["max_message_bytes"] = max(8 << 20, chunk_bytes + (1 << 20))
    server = VariableServer(publisher_token=PUBLISHER_TOKEN, auth_token=AUTH_TOKEN,
                            validate_payload=SafetensorsValidator(), shm_root=writer_root(shm_dir),
                            **kwargs).start()
    conn.send(server.address)
    while True:
        message = conn.recv()
        if message == "stop":
            break
        conn.send(server.wait_copied(message[1], timeout_s=600))
    stats = server.stats()
    server.stop(grace_s=0.5)
    conn.send((_peak_rss_mb(), stats))


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


def _fetch(conn, addresses: Tuple[str, ...], bare_address: str, poll_s: float,
           transport: str) -> None:
    """Child: an actor's fetch path: VariableClient, then the actor's decode, per version.
    Messages: (server index, version) to time, ("sync", server index) to catch up untimed
    with that server's newest version (so a timed round fetches nothing older first), "bare"."""
    from sao_actor_learner.variables import VariableClient
    import grpc
    clients = [VariableClient(address, update_period_s=poll_s, auth_token=AUTH_TOKEN,
                              weight_transport=transport) for address in addresses]
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
        if version[0] == "sync":
            clients[version[1]].update_and_wait(timeout_s=600)
            conn.send("synced")
            continue
        client = clients[version[0]]
        before = dict(client.counters)
        client.wait_for_version(version[1], timeout_s=600)
        held, params = client.get_variables()
        tensors = actor_decode(params)
        done = time.perf_counter()
        how = {k: n - before.get(k, 0) for k, n in client.counters.items()
               if n != before.get(k, 0)}               # how this version arrived
        conn.send((held, done, len(tensors), sum(t.numel() for t in tensors.values()), how))
        del tensors, params
    for client in clients:
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


def _start(ctx, target, args, what: str):
    conn, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(child, *args), daemon=True)
    process.start()
    return process, conn, _reply(conn, what)


def _memcpy(dst: memoryview, parts) -> None:
    """The payload's buffers copied back to back into `dst` (memcpy per buffer)."""
    offset = 0
    for part in parts:
        view = memoryview(part).cast("B")
        dst[offset:offset + view.nbytes] = view
        offset += view.nbytes


PATHS = ("shm", "memcpy", "ours", "raw", "two_hop", "bare_grpc", "bare_get")


def measure_size(label: str, num_params: int, ctx) -> Dict:
    """Interleaved rounds of every path for one model size; fresh child processes."""
    import grpc

    from sao_actor_learner.variables import VariablePublisher

    shapes = model_shapes(num_params)
    state_dict = make_state_dict(shapes, FLAGS.dtype, FLAGS.seed)
    params = sum(t.numel() for t in state_dict.values())
    payload_bytes = sum(memoryview(p).nbytes for p in learner_serialize(state_dict))

    server, server_conn, address = _start(ctx, _serve, (FLAGS.chunk_bytes, FLAGS.shm_dir),
                                          "server")
    # The previous design's path gets a server of its own, so that the local actor only ever
    # sees shared-memory versions.
    two_hop = payload_bytes <= FLAGS.two_hop_max_mb * 1e6
    server2 = server2_conn = None
    addresses = (address,)
    if two_hop:
        server2, server2_conn, address2 = _start(ctx, _serve, (FLAGS.chunk_bytes, FLAGS.shm_dir),
                                                 "two-hop server")
        addresses = (address, address2)
    bare, bare_conn, bare_address = _start(ctx, _serve_bare_grpc, (), "bare gRPC server")
    local, local_conn, _ = _start(ctx, _fetch, ((address,), bare_address, FLAGS.poll_s,
                                                "auto"), "local client")
    remote, remote_conn, _ = _start(ctx, _fetch, (addresses, bare_address, FLAGS.poll_s,
                                                  "grpc"), "remote client")
    raw, raw_conn, raw_port = _start(ctx, _raw_receive, (payload_bytes,), "raw receiver")
    sock = socket.create_connection(("127.0.0.1", raw_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    copy_buffer = bytearray(payload_bytes)           # pre-touched (bytearray zero-fills)
    copy_view = memoryview(copy_buffer)

    pub_kwargs = {"chunk_bytes": FLAGS.chunk_bytes} if FLAGS.chunk_bytes else {}
    shm_publisher = VariablePublisher(address, PUBLISHER_TOKEN, auth_token=AUTH_TOKEN,
                                      shm_dir=FLAGS.shm_dir, shm_run_name="weight_sync",
                                      **pub_kwargs)
    grpc_publisher = VariablePublisher(addresses[-1], PUBLISHER_TOKEN, auth_token=AUTH_TOKEN,
                                       **pub_kwargs)
    bare_channel = grpc.insecure_channel(bare_address, options=_bare_options())
    bare_put = bare_channel.stream_unary("/Bare/Put")
    times = {path: [] for path in PATHS}
    split = {f"{path}_{k}": [] for path in ("shm", "ours", "two_hop")
             for k in ("serialize_s", "publish_s", "held_after_publish_s")}
    counters: Dict[str, int] = {}                   # how the last version reached the local actor
    local_counters: Dict[str, int] = {}              # and all of them, summed
    versions = [0, 0]                                # the next version, per server

    def publish_and_hold(publisher, client_conn, what, index=0):
        """(t1 - t0, serialize, publish, held after publish) of one version to one client."""
        nonlocal counters
        version = versions[index]
        client_conn.send(("sync", index))
        _reply(client_conn, what, 600)
        client_conn.send((index, version))
        t0 = time.perf_counter()
        payload = learner_serialize(state_dict)
        t_serialized = time.perf_counter()
        publisher.publish(version, payload)
        t_published = time.perf_counter()
        held, t_done, n_tensors, n_params, how = _reply(client_conn, what, 600)
        if held != version or n_tensors != len(shapes) or n_params != params:
            raise RuntimeError(f"{what} holds version {held} with {n_tensors} tensors / "
                               f"{n_params} params; expected {version}, {len(shapes)}, {params}")
        conn = (server_conn, server2_conn)[index]
        conn.send(("copied", version))               # nothing else runs while it copies
        if not _reply(conn, "server", 600):
            raise RuntimeError(f"the server has no copy of version {version}")
        versions[index] += 1
        if what == "local client":
            counters = how
        return (t_done - t0, t_serialized - t0, t_published - t_serialized, t_done - t_published)

    try:
        for round_ in range(FLAGS.warmup + FLAGS.repeats):
            timed = round_ >= FLAGS.warmup
            measured = {
                "shm": publish_and_hold(shm_publisher, local_conn, "local client")}
            if counters != {"shm_loads": 1}:
                raise RuntimeError(f"the local client did not load version {versions[0] - 1} "
                                   f"from shared memory: {counters}")
            for k, n in counters.items() if timed else ():
                local_counters[k] = local_counters.get(k, 0) + n
            payload = learner_serialize(state_dict)
            c0 = time.perf_counter()
            _memcpy(copy_view, payload)
            measured["memcpy"] = (time.perf_counter() - c0,)
            measured["ours"] = publish_and_hold(shm_publisher, remote_conn, "remote client")
            # raw: the same bytes over a loopback socket.
            r0 = time.perf_counter()
            sock.sendall(_LEN.pack(payload_bytes))
            for part in payload:
                sock.sendall(part)
            r_done, got = _reply(raw_conn, "raw receiver", 600)
            if got != payload_bytes:
                raise RuntimeError(f"raw receiver got {got} of {payload_bytes} bytes")
            measured["raw"] = (r_done - r0,)
            if two_hop:
                measured["two_hop"] = publish_and_hold(grpc_publisher, remote_conn,
                                                       "remote client", index=1)
            # bare gRPC: the same bytes, Put then Get in publisher.chunk_bytes messages.
            b0 = time.perf_counter()
            bare_put(_messages(payload, grpc_publisher.chunk_bytes), timeout=600)
            g0 = time.perf_counter()
            remote_conn.send("bare")
            b_done, got = _reply(remote_conn, "remote client", 600)
            if got != payload_bytes:
                raise RuntimeError(f"bare gRPC client got {got} of {payload_bytes} bytes")
            measured["bare_grpc"] = (b_done - b0,)
            measured["bare_get"] = (b_done - g0,)
            del payload
            if not timed:
                continue
            for path, figures in measured.items():
                times[path].append(figures[0])
                if len(figures) == 4:
                    for k, value in zip(("serialize_s", "publish_s", "held_after_publish_s"),
                                        figures[1:]):
                        split[f"{path}_{k}"].append(value)
    finally:
        writer = shm_publisher.shm_writer
        writer_counters = dict(writer.counters) if writer is not None else {}
        shm_publisher.close()
        grpc_publisher.close()
        bare_channel.close()
        local_conn.send(None)
        remote_conn.send(None)
        sock.close()
        server_conn.send("stop")
        if two_hop:
            server2_conn.send("stop")
        bare_conn.send("stop")
        rss = {}
        for what, conn in (("local_client", local_conn), ("client", remote_conn),
                           ("server", server_conn), ("server2", server2_conn),
                           ("raw_receiver", raw_conn), ("bare_server", bare_conn)):
            rss[what] = conn.recv() if conn is not None and conn.poll(30) else float("nan")
        for p in (server, server2, bare, local, remote, raw):
            if p is None:
                continue
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    server_rss, server_stats = rss["server"] if isinstance(rss["server"], tuple) else \
        (rss["server"], {})
    summary = {path: _summary(t, payload_bytes) for path, t in times.items() if t}
    row = {"size": label, "params": params, "tensors": len(shapes), "dtype": FLAGS.dtype,
           "payload_bytes": payload_bytes}
    for path, figures in summary.items():
        row.update({f"{path}_gbps": figures["gbps"], f"{path}_gbps_min": figures["gbps_min"],
                    f"{path}_gbps_max": figures["gbps_max"], f"{path}_s": figures["median_s"]})
    ours_no_ser = [t - s for t, s in zip(times["ours"], split["ours_serialize_s"])]
    if not two_hop:                                   # not run at this size
        row.update({f"two_hop_{k}": None for k in ("gbps", "gbps_min", "gbps_max", "s",
                                                   "serialize_s", "publish_s",
                                                   "held_after_publish_s", "ratio")})
    row.update({
        "shm_ratio": summary["shm"]["gbps"] / summary["memcpy"]["gbps"],
        "ratio": summary["ours"]["gbps"] / summary["raw"]["gbps"],
        "ratio_without_serialize": _summary(ours_no_ser, payload_bytes)["gbps"] /
        summary["raw"]["gbps"],
        **({"two_hop_ratio": summary["two_hop"]["gbps"] / summary["raw"]["gbps"]}
           if two_hop else {}),
        "bare_grpc_ratio": summary["bare_grpc"]["gbps"] / summary["raw"]["gbps"],
        "bare_get_ratio": summary["bare_get"]["gbps"] / summary["raw"]["gbps"],
        # the remote path's splits under their previous names
        "serialize_s": statistics.median(split["ours_serialize_s"]),
        "publish_s": statistics.median(split["ours_publish_s"]),
        "held_after_publish_s": statistics.median(split["ours_held_after_publish_s"]),
        **{k: statistics.median(v) for k, v in split.items() if v},
        "local_client_counters": local_counters,
        # created + reused = written; held_by_reader: a file still in use, so a fresh one
        "shm_writer_counters": writer_counters,
        "server_shm_published": server_stats.get("shm_published", 0),
        "server_peak_rss_mb": server_rss, "client_peak_rss_mb": rss["client"],
        "local_client_peak_rss_mb": rss["local_client"],
        "raw_receiver_peak_rss_mb": rss["raw_receiver"],
        "bare_grpc_server_peak_rss_mb": rss["bare_server"],
    })
    return row


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
    load_start = os.getloadavg()[0]
    for label, n in sizes:
        rows.append(measure_size(label, n, ctx))
        r = rows[-1]
        logging.warning("%s: shm %.2f GB/s = %.2fx memcpy; remote %.2f GB/s = %.2fx raw", label,
                        r["shm_gbps"], r["shm_ratio"], r["ours_gbps"], r["ratio"])
    print(f"\nWeight sync, {FLAGS.dtype}, median of {FLAGS.repeats} interleaved rounds "
          f"(min-max), client poll {FLAGS.poll_s * 1e3:.0f} ms, load {load_start:.2f} -> "
          f"{os.getloadavg()[0]:.2f}")
    print("\nOn the learner's host: shared memory (publish -> actor holds tensors) vs memcpy")
    print(f"{'size':>6}{'params':>13}{'MB':>6}{'shm GB/s':>19}{'memcpy GB/s':>19}"
          f"{'shm/memcpy':>11}{'shm s':>8}{'pub s':>8}{'held s':>8}{'memcpy s':>9}")
    for r in rows:
        cells = [f"{r[k + '_gbps']:.2f} ({r[k + '_gbps_min']:.2f}-{r[k + '_gbps_max']:.2f})"
                 for k in ("shm", "memcpy")]
        print(f"{r['size']:>6}{r['params']:>13,}{r['payload_bytes'] / 1e6:>6.0f}"
              f"{cells[0]:>19}{cells[1]:>19}{r['shm_ratio']:>11.2f}{r['shm_s']:>8.3f}"
              f"{r['shm_publish_s']:>8.3f}{r['shm_held_after_publish_s']:>8.3f}"
              f"{r['memcpy_s']:>9.3f}")
    print("\nTo a remote actor: gRPC (publish -> actor holds tensors) vs a raw loopback socket")
    print(f"{'size':>6}{'ours GB/s':>19}{'raw GB/s':>19}{'ours/raw':>9}{'2-hop/raw':>10}"
          f"{'bare gRPC GB/s':>19}{'bare/raw':>9}{'1 bare hop/raw':>15}{'ours s':>8}"
          f"{'pub s':>7}{'srv MB':>7}{'cli MB':>7}")
    for r in rows:
        cells = [f"{r[k + '_gbps']:.2f} ({r[k + '_gbps_min']:.2f}-{r[k + '_gbps_max']:.2f})"
                 for k in ("ours", "raw", "bare_grpc")]
        print(f"{r['size']:>6}{cells[0]:>19}{cells[1]:>19}{r['ratio']:>9.2f}"
              f"{r['two_hop_ratio'] or float('nan'):>10.2f}{cells[2]:>19}"
              f"{r['bare_grpc_ratio']:>9.2f}"
              f"{r['bare_get_ratio']:>15.2f}{r['ours_s']:>8.3f}{r['publish_s']:>7.3f}"
              f"{r['server_peak_rss_mb']:>7.0f}{r['client_peak_rss_mb']:>7.0f}")
    ratios = [r["ratio"] for r in rows]
    shm_ratios = [r["shm_ratio"] for r in rows]
    print(json.dumps({"benchmark": "weight_sync", "dtype": FLAGS.dtype, "repeats": FLAGS.repeats,
                      "poll_s": FLAGS.poll_s, "target_ratio": 0.5,
                      "min_ratio": min(ratios), "min_shm_ratio": min(shm_ratios),
                      "remote_target_met": min(ratios) >= 0.5,
                      "shm_target_met": min(shm_ratios) >= 0.5,
                      "target_met": min(ratios) >= 0.5 and min(shm_ratios) >= 0.5,
                      "load_avg_1m_start": load_start, "load_avg_1m": os.getloadavg()[0],
                      "rows": rows}))


if __name__ == "__main__":
    app.run(main)
