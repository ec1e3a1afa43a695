"""Code that runs INSIDE the vLLM environment (`.venv-vllm`), never in the main one.

It imports vLLM, torch and safetensors from that environment and nothing from
`sao_actor_learner`: the vLLM server process gets this folder's parent
(`sao_actor_learner/engines`) on its PYTHONPATH and imports it as the top-level package
`vllm_server`, so the main package's `__init__` files (which need absl, TensorFlow, ...)
are never imported there.

  serve.py             the server's entry point: a parent-death watchdog, then vLLM's
                       OpenAI-compatible api_server (`python serve.py --parent-pid N <vllm args>`).
  weight_transfer.py   `SharedMemoryFileWeightTransferEngine`, a CPU weight-transfer backend for
                       vLLM's `/start_weight_update` / `/update_weights` / `/finish_weight_update`
                       API: the trainer side writes a safetensors file (in /dev/shm on one host)
                       and the worker loads it with the model's own `load_weights`.
  worker_extension.py  `SAOWorkerExtension` (`--worker-extension-cls`): registers that backend in
                       every worker process and reports the served checkpoint's parameter names,
                       shapes and dtypes (`collective_rpc` method `sao_expected_weights`).
  hold_scheduler.py    a test hook, never on by default (`--scheduler-cls
                       vllm_server.hold_scheduler.HoldScheduler`): holds a group of requests
                       at a known token count so a weight update provably lands mid-flight.
  procs.py             standard library only: stops the server's process group and unlinks the
                       /dev/shm files it mapped. The one module the main environment imports too
                       (`vllm_engine.VLLMServer.stop`).

Apart from procs.py, the main environment uses this folder only as file paths (see
`sao_actor_learner.engines.vllm_engine`).
"""
