"""vLLM worker extension (`--worker-extension-cls vllm_server.worker_extension.SAOWorkerExtension`).

Runs inside the vLLM environment. Importing this module in a worker process registers the
`sao_shm_file` weight-transfer backend (see weight_transfer.py) before vLLM builds the worker's
weight-transfer engine, and the class adds one `collective_rpc` method.
"""
from __future__ import annotations

from vllm_server import weight_transfer

weight_transfer.register()


class SAOWorkerExtension:
    """Mixed into vLLM's worker class; its methods are callable through `/collective_rpc`."""

    def sao_expected_weights(self) -> dict:
        """{name: [shape, dtype]} of the served checkpoint (Hugging Face names).

        A weight update must send exactly these; the client checks before sending, the
        weight-transfer backend checks again before loading.
        """
        model_dir = self.vllm_config.model_config.model
        return {n: [list(s), d] for n, (s, d) in
                weight_transfer.checkpoint_weight_metadata(model_dir).items()}
