"""The vLLM Engine: `core.Engine` over a vLLM server process (vllm_process.py), over HTTP.

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
               weight_sync_mode (core.Engine; docs/DESIGN.md "Weight sync modes"):
                 keep   (M=keep) in-flight requests are frozen, continue under the new weights
                        after the update (their KV cache is recomputed: running requests are
                        preempted by the prefix-cache reset), and their per-token versions
                        record the switch.
                 abort  (M=abort) in-flight requests are aborted (vLLM returns partial tokens
                        with finish_reason "abort"); `generate` discards those tokens and
                        re-sends the prompt once the update is done, so every token has the new
                        version.
                 off    (M=keep) a load waits until no generate call is in flight, and a
                        generate call waits for a load in progress: a call's tokens share one
                        version.
  offer_weights  is load_weights (from the caller's thread, while generate calls may be in
               flight in others); the actor calls it from its weight thread.

Log-probs and the token budget: vllm_requests.py (the requests, as pure functions).

The server-process names (`VLLMServer`, `VLLMServerError`, `resolve_vllm_python`, `free_port`,
`SERVER_DIR`) stay importable from here; `resolve_vllm_python` needs no torch.
"""
from __future__ import annotations

import http.client
import json
import os
import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

from absl import logging

from sao_actor_learner import core
from sao_actor_learner.engines.vllm_process import (SERVER_DIR, HTTPError, VLLMServer,
                                                    VLLMServerError, free_port,
                                                    resolve_vllm_python)
from sao_actor_learner.engines.vllm_requests import check_prompt, parse_choice, request_body
from sao_actor_learner.engines.vllm_weights import (check_state_dict, push_weights,
                                                    write_weights_file)

__all__ = ["SERVER_DIR", "VLLMEngine", "VLLMServer", "VLLMServerError", "WEIGHT_SYNC_MODES",
           "free_port", "resolve_vllm_python"]

WEIGHT_SYNC_MODES = core.WEIGHT_SYNC_MODES
# Failures that mean the server may be gone (then /health decides: restart, or a real error).
_TRANSPORT_ERRORS = (OSError, http.client.HTTPException, HTTPError)


class VLLMEngine(core.Engine):
    """`core.Engine` over a vLLM server it starts (see the module docstring).

    Args:
      model_dir: the Hugging Face checkpoint folder the server loads (save_checkpoint's output).
      eos_token_id: always a stop token (as in TorchEngine).
      version: the policy version of the checkpoint's weights.
      weight_sync_mode: "keep", "abort" or "off" (what a weight update does to requests in
        flight; module docstring).
      python: the vLLM environment's python (default: resolve_vllm_python()).
      log_path: the server's log file.
      max_concurrency: requests in flight at once (vLLM batches them).
      max_restarts: server restarts allowed over the engine's life before errors propagate.
      request_timeout_s: one generate request's limit.
      tokenizer: the model's tokenizer, kept as `.tokenizer` (tasks encode prompts with it).
      Other arguments go to VLLMServer.
    """

    def __init__(self, model_dir: str, eos_token_id: int, version: int = 0,
                 weight_sync_mode: str = "keep", python: str = "",
                 log_path: Optional[str] = None, max_concurrency: int = 64,
                 max_restarts: int = 3, request_timeout_s: float = 300.0,
                 start_timeout_s: float = 300.0, kv_cache_gb: int = 1, threads: int = 1,
                 enforce_eager: bool = True, seed: int = 0, extra_args: Sequence[str] = (),
                 tokenizer: Optional[core.Tokenizer] = None):
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
        self.tokenizer = tokenizer
        # vLLM SamplingParams.extra_args sent with every generate request (None: none), for
        # server-side hooks, e.g. the tests' hold scheduler (vllm_server/hold_scheduler.py).
        self.request_extra_args: Optional[dict] = None
        # sent: generate requests sent (re-sends included); in_flight: sent, not answered yet;
        # requests / tokens: answered requests and their tokens.
        self.counters: Dict[str, float] = {"requests": 0, "tokens": 0, "weight_updates": 0,
                                           "sent": 0, "in_flight": 0,
                                           "aborted_and_resent": 0, "server_restarts": 0,
                                           "rejected_weight_updates": 0,
                                           "sequences_switched": 0, "tokens_discarded": 0}
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
        self._state = threading.Condition()  # guards _updating, _server_epoch, _generating
        self._updating = False
        self._generating = 0                           # generate calls in flight
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
        return cls(path, eos_token_id=tokenizer.eos_id, version=version, tokenizer=tokenizer,
                   **kwargs)

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
        prompts = [check_prompt(i, p, self._vocab, self._max_model_len)
                   for i, p in enumerate(prompts)]
        for t in params.stop_token_ids:
            if not 0 <= int(t) < self._vocab:
                raise ValueError(f"stop_token_ids contains {t}, outside the vocabulary "
                                 f"[0, {self._vocab})")
        stop_ids = sorted({self._eos, *map(int, params.stop_token_ids)})
        with self._state:
            while self.weight_sync_mode == "off" and self._updating:
                self._state.wait(timeout=1.0)
            self._generating += 1
        try:
            futures = [self._pool.submit(self._generate_one, p, params, stop_ids,
                                         None if params.seed is None else int(params.seed) + i)
                       for i, p in enumerate(prompts)]
            return [fut.result() for fut in futures]
        finally:
            with self._state:
                self._generating -= 1
                self._state.notify_all()

    def offer_weights(self, state_dict: dict, version: int) -> None:
        """load_weights(state_dict, version) unless `version` is not newer than the engine's:
        with keep/abort it lands while generate calls are in flight (module docstring)."""
        if int(version) > self._version:
            self.load_weights(state_dict, version)

    def weight_sync_counters(self) -> Dict[str, float]:
        with self._counter_lock:
            return {k: self.counters[k] for k in ("tokens", "sequences_switched",
                                                  "tokens_discarded", "aborted_and_resent")}

    def load_weights(self, state_dict: dict, version: int) -> None:
        """Validates `state_dict`, then pushes it to the server tagged with `version`."""
        if self._closed:
            raise RuntimeError("VLLMEngine.load_weights() after close()")
        try:
            self.check_weights(state_dict)
        except ValueError:
            self._count("rejected_weight_updates")
            raise
        path = write_weights_file(state_dict, f"sao_vllm_{os.getpid()}_{id(self):x}_v{version}")
        with self._update_lock:
            t0 = time.time()
            with self._state:
                while self.weight_sync_mode == "off" and self._generating:
                    self._state.wait(timeout=1.0)   # off: between generate calls only
                self._updating = True
                epoch = self._server_epoch
            try:
                try:
                    push_weights(self._server, path, int(version),
                                 "abort" if self.weight_sync_mode == "abort" else "keep")
                except _TRANSPORT_ERRORS as e:
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
        check_state_dict(state_dict, self._expected, self._server.model_dir)

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
    def _start_server(self, restart: bool = False) -> None:
        """(Re)starts the server process and brings it to this engine's weights and version."""
        if restart:
            self._server.restart(grace_s=2.0)
        else:
            self._server.start()
        try:
            self._server.call("POST", "/init_weight_transfer_engine", {"init_info": {}})
            results = self._server.call("POST", "/collective_rpc",
                                        {"method": "sao_expected_weights"})["results"]
            self._expected = {n: (tuple(s), d) for n, (s, d) in results[0].items()}
            if self._weights_file is not None:
                push_weights(self._server, self._weights_file, self._version, "abort")
            else:
                self._server.call("POST", "/update_weight_version",
                                  {"new_version": str(self._version)})
        except (*_TRANSPORT_ERRORS, KeyError) as e:
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
            self._start_server(restart=True)
            with self._state:
                self._server_epoch += 1
                self._state.notify_all()

    # Weights ----------------------------------------------------------------------------------
    def _replace_weights_file(self, path: str) -> None:
        old = self._weights_file
        self._weights_file = path
        self._cleanup_box[0] = path
        if old and old != path and os.path.exists(old):
            os.remove(old)

    # Generation -------------------------------------------------------------------------------
    def _generate_one(self, prompt: List[int], params: core.SamplingParams,
                      stop_ids: List[int], seed: Optional[int]) -> core.Generation:
        body = request_body(prompt, params, stop_ids, seed, self._max_model_len,
                            self.request_extra_args)
        failures = 0
        while True:
            with self._state:
                epoch = self._server_epoch
            body["request_id"] = f"sao-{uuid.uuid4().hex}"
            self._count("sent")
            self._count("in_flight")
            try:
                reply = self._server.call("POST", "/inference/v1/generate", body,
                                         timeout=self._request_timeout_s)
            except _TRANSPORT_ERRORS as e:
                if self._closed:
                    raise RuntimeError("VLLMEngine closed during generate()") from e
                if isinstance(e, HTTPError) and e.status < 500:
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
                self._count("tokens_discarded", len(choice.get("token_ids") or []))
                if failures > 20:
                    raise VLLMServerError("a generate request was aborted 20 times in a row; "
                                          "is something else aborting requests on the server?")
                with self._state:
                    while self._updating:
                        self._state.wait(timeout=1.0)
                continue
            generation = parse_choice(choice, self._initial_version)
            self._count("requests")
            self._count("tokens", len(generation.tokens))
            if len(set(generation.versions)) > 1:
                self._count("sequences_switched")
            return generation


def _cleanup(server: VLLMServer, pool: ThreadPoolExecutor, weights_file: list) -> None:
    """At garbage collection or interpreter exit: stop the server, remove the weights file."""
    pool.shutdown(wait=False, cancel_futures=True)
    server.stop(grace_s=5.0)
    if weights_file[0] and os.path.exists(weights_file[0]):
        os.remove(weights_file[0])

