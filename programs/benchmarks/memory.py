r"""Peak resident memory (RSS) of each node type of the default program, and what dominates it.

Runs the default program exactly as `make run` does (programs/sao.py --task=arithmetic
--init_checkpoint=checkpoints/warm_start, every other flag at its default: local_mp, 2 actors,
batch 32, 100 steps) in a child process, and samples every --interval_s, until each process
ends, from /proc/<pid>/status and /proc/<pid>/smaps_rollup:

  peak RSS   VmHWM (the kernel's high-water mark of resident memory), last value read before
             the process ended; the launcher is the programs/sao.py process, the nodes are the
             pids in <run_dir>/nodes.json.
  at peak    the sample with the highest VmRSS: anonymous memory (heap: tensors, buffers, Python
             objects) vs file-backed (mapped shared libraries and their data), its PSS (the
             share of pages used by several processes, e.g. the same libraries, counted once
             over all processes) and which frameworks are mapped (torch, TensorFlow, gRPC).

Then, in the same benchmark run, a baseline per node type: a fresh interpreter that does what
that node's process does before it runs, recording its RSS after each stage:
  py+prog      the interpreter and programs/sao.py's modules (every spawned node re-imports its
               launcher's __main__);
  torch        `import torch` (nodes that map libtorch);
  TF(+Reverb)  `import reverb`, which imports TensorFlow (nodes that map Reverb with TensorFlow's
               Python module), or `import tensorflow` (nodes that map TensorFlow without Reverb);
  Reverb C++   Reverb's C++ client alone, without TensorFlow's Python module (replay/client.py:
               actors and learner under local_mp);
  node mods    the node's own modules, as builder.make_<node> imports them;
  HF model     the transformers model class of the checkpoint (transformers loads model code
               lazily), for nodes with a model;
  weights      loading the warm start (the learner also copies it into its critic).
Peak minus the baseline ("run-time") is what the node built and did beyond that: forward and
backward buffers, optimizer state, Reverb items, gRPC buffers, threads. The largest part is
"what dominates".

  OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python programs/benchmarks/memory.py

Ends with one JSON line: per node type peak, baseline stages, run-time part and at-peak split.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # kernels.py shadows
sys.path.insert(0, REPO)                                                  # HF's `kernels`

FLAGS = flags.FLAGS
flags.DEFINE_string("run_dir", "runs/bench_memory", "The measured run's folder.")
flags.DEFINE_string("init_checkpoint", "checkpoints/warm_start", "Warm start (make run's).")
flags.DEFINE_float("interval_s", 0.1, "Sampling period.")
flags.DEFINE_list("program_args", [], "Extra programs/sao.py flags (default: none, i.e. the "
                  "`make run` settings), e.g. max_steps=10,eval_size=50.")
flags.DEFINE_float("timeout_s", 900.0, "Give up (and stop the program) after this long.")

MIB = 1024.0 * 1024.0
NODE_TYPES = ("launcher", "replay", "variables", "learner", "actor", "evaluator")
# What each process imports, as programs/sao.py and builder.make_<node> do (lazily, in the
# node's own process).
PROGRAM_MODULES = ["absl.app", "absl.flags", "sao_actor_learner.builder", "sao_actor_learner.config",
                   "sao_actor_learner.flags", "sao_actor_learner.run",
                   "sao_actor_learner.launch"]
NODE_MODULES = {
    # The launcher validates the config, whose tool-latency check imports
    # sao_actor_learner.tasks.tools (the tasks package imports the arithmetic task -> models ->
    # torch); it builds no model.
    "launcher": ["sao_actor_learner.tasks.tools"],
    "replay": ["sao_actor_learner.replay"],
    "variables": ["sao_actor_learner.variables"],
    "learner": ["sao_actor_learner.learner.journal", "sao_actor_learner.learner.learner",
                "sao_actor_learner.models.checkpoint", "sao_actor_learner.models.value",
                "sao_actor_learner.observers", "sao_actor_learner.variables",
                "sao_actor_learner.replay", "sao_actor_learner.replay.validation",
                "sao_actor_learner.observers.tensorboard"],
    "actor": ["sao_actor_learner.actors.actor", "sao_actor_learner.models.checkpoint",
              "sao_actor_learner.replay", "sao_actor_learner.variables",
              "sao_actor_learner.actors.delays", "sao_actor_learner.actors.spool",
              "sao_actor_learner.engines", "sao_actor_learner.tasks"],
    "evaluator": ["sao_actor_learner.actors.evaluator", "sao_actor_learner.models.checkpoint",
                  "sao_actor_learner.observers", "sao_actor_learner.variables",
                  "sao_actor_learner.engines", "sao_actor_learner.tasks",
                  "sao_actor_learner.observers.tensorboard"],
}
# Nodes that load the warm start: the learner also makes its critic (a copy of the body).
MODEL_NODES = {"learner": True, "actor": False, "evaluator": False}
# Shared libraries that say a framework is loaded in a process (from /proc/<pid>/maps).
FRAMEWORK_LIBS = {"torch": "libtorch_cpu.so", "tensorflow": "libtensorflow_framework.so",
                  "tensorflow python": "_pywrap_tensorflow_internal.so",
                  "reverb": "reverb/libpybind.so", "grpc": "cygrpc.cpython"}

# A fresh interpreter's RSS after each cumulative stage: ["import", modules] imports them,
# ["model code", ckpt] imports the checkpoint's transformers architecture class (transformers
# loads model code lazily), ["weights", ckpt, critic] loads the warm start (and the critic).
_BASELINE_SCRIPT = r"""
import importlib, json, os, sys
def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
out = [["interpreter", rss()]]
for name, kind, *args in json.loads(sys.argv[1]):
    if kind == "import":
        for m in args[0]:
            importlib.import_module(m)
    elif kind == "reverb client":
        from sao_actor_learner.replay.client import pybind
        pybind()
    elif kind == "model code":
        import transformers
        with open(os.path.join(args[0], "config.json")) as f:
            for arch in json.load(f).get("architectures", []):
                getattr(transformers, arch)
    elif kind == "weights":
        from sao_actor_learner.models import checkpoint as ckpt
        policy, _ = ckpt.load_policy(args[0])
        if args[1]:
            from sao_actor_learner.models.value import ValueModel
            critic = ValueModel.from_policy(policy)
    out.append([name, rss()])
print(json.dumps(out))
"""


def read_status(pid: int) -> Optional[Dict[str, int]]:
    """VmRSS and VmHWM in bytes, or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "State"):
            out[key] = int(value.split()[0]) * 1024 if key != "State" else value.split()[0]
    if out.get("State") == "Z" or "VmRSS" not in out:   # a zombie has no memory left to read
        return None
    return out


def read_smaps_rollup(pid: int) -> Dict[str, int]:
    """Rss, Pss, Anonymous, Pss_Anon, Pss_File (bytes) of a live process ({} if gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    return out


def mapped_frameworks(pid: int) -> List[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []
    return sorted(name for name, lib in FRAMEWORK_LIBS.items() if lib in maps)


class Sampler:
    """Per-pid peak tracking: last VmHWM, and the smaps split at the highest VmRSS seen."""

    def __init__(self):
        self.procs: Dict[int, Dict] = {}

    def sample(self, pid: int, name: str, node_type: str) -> None:
        status = read_status(pid)
        p = self.procs.setdefault(pid, {"pid": pid, "name": name, "type": node_type,
                                        "hwm": 0, "max_rss": 0, "at_peak": {},
                                        "frameworks": [], "samples": 0})
        if status is None:
            return
        p["hwm"] = max(p["hwm"], status["VmHWM"])
        p["samples"] += 1
        if status["VmRSS"] > p["max_rss"]:
            p["max_rss"] = status["VmRSS"]
            p["at_peak"] = read_smaps_rollup(pid)
            p["frameworks"] = mapped_frameworks(pid) or p["frameworks"]


def node_pids(run_dir: str) -> List[tuple]:
    """(pid, name, label) of the nodes listed in run_dir/nodes.json (none before it exists)."""
    try:
        with open(os.path.join(run_dir, "nodes.json")) as f:
            nodes = json.load(f)["nodes"]
    except (OSError, ValueError, KeyError):
        return []
    return [(n["pid"], n["name"], n["label"]) for n in nodes if n.get("pid")]


def run_program_and_sample(run_dir: str) -> Dict:
    """Runs programs/sao.py as `make run` does and samples its processes until it ends."""
    nodes_json = os.path.join(run_dir, "nodes.json")
    if os.path.exists(nodes_json):
        os.remove(nodes_json)   # a previous run's pids must not be sampled
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, os.path.join(REPO, "programs", "sao.py"), "--task=arithmetic",
           f"--init_checkpoint={FLAGS.init_checkpoint}", f"--run_dir={run_dir}",
           "--noprogress"] + [f"--{a}" for a in FLAGS.program_args]
    log_path = os.path.join(run_dir, "memory_benchmark_program.log")
    os.makedirs(run_dir, exist_ok=True)
    sampler = Sampler()
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                if time.time() - t0 > FLAGS.timeout_s:
                    raise TimeoutError(f"the program ran past --timeout_s={FLAGS.timeout_s}")
                sampler.sample(proc.pid, "launcher", "launcher")
                for pid, name, label in node_pids(run_dir):
                    sampler.sample(pid, name, label)
                time.sleep(FLAGS.interval_s)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"programs/sao.py exited with {proc.returncode}:\n{tail}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    return {"procs": list(sampler.procs.values()), "wall_s": time.time() - t0,
            "summary": summary, "cmd": cmd}


def baseline_stages(node_type: str, frameworks: List[str], checkpoint: str) -> List[list]:
    """The stages a fresh interpreter goes through to match what `node_type`'s process does
    before it runs (module docstring): interpreter, program, torch and TensorFlow when the node
    maps them, its modules, and for nodes with a model the transformers model code and the
    warm-start weights."""
    stages = [["program", "import", PROGRAM_MODULES]]
    if "torch" in frameworks:
        stages.append(["torch", "import", ["torch"]])
    if "reverb" in frameworks and "tensorflow python" in frameworks:
        stages.append(["tensorflow", "import", ["reverb"]])   # reverb imports TensorFlow
    elif "reverb" in frameworks:   # Reverb's C++ client alone (replay/client.py)
        stages.append(["reverb client", "reverb client"])
    elif "tensorflow python" in frameworks:   # e.g. through torch.utils.tensorboard
        stages.append(["tensorflow", "import", ["tensorflow"]])
    stages.append(["node modules", "import", NODE_MODULES[node_type]])
    if node_type in MODEL_NODES:
        stages.append(["model code", "model code", checkpoint])
        stages.append(["weights", "weights", checkpoint, MODEL_NODES[node_type]])
    return stages


def run_baselines(stages_by_type: Dict[str, List[list]]) -> Dict[str, List[list]]:
    """{node type: [[stage, cumulative RSS bytes], ...]}, one fresh interpreter per node type,
    all at once (each measures only itself)."""
    from sao_actor_learner.replay.client import lite_env

    # As run.py starts the nodes (a process that imports reverb still gets the package).
    env = {**os.environ, **lite_env(), "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    procs = {t: subprocess.Popen([sys.executable, "-c", _BASELINE_SCRIPT, json.dumps(stages)],
                                 cwd=REPO, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
             for t, stages in stages_by_type.items()}
    out = {}
    for t, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"baseline of {t} failed:\n{stderr[-2000:]}")
        out[t] = json.loads(stdout.strip().splitlines()[-1])
    return out


def checkpoint_bytes(path: str) -> int:
    total = 0
    for name in os.listdir(path):
        if name.endswith((".safetensors", ".bin")):
            total += os.path.getsize(os.path.join(path, name))
    return total


def analyse(procs: List[Dict], checkpoint: str) -> Dict[str, Dict]:
    """Per node type: the peak of its processes, the baseline split and what dominates."""
    mine_by_type = {t: [p for p in procs if p["type"] == t and p["hwm"] > 0] for t in NODE_TYPES}
    mine_by_type = {t: m for t, m in mine_by_type.items() if m}
    frameworks_by_type = {t: sorted({f for p in m for f in p["frameworks"]})
                          for t, m in mine_by_type.items()}
    baselines = run_baselines({t: baseline_stages(t, frameworks_by_type[t], checkpoint)
                               for t in mine_by_type})
    out = {}
    for node_type, mine in mine_by_type.items():
        top = max(mine, key=lambda p: p["hwm"])
        frameworks = frameworks_by_type[node_type]
        stages = baselines[node_type]
        parts = {}
        prev = 0
        for name, rss in stages[1:]:   # the interpreter counts with programs/sao.py's modules
            parts["python+program" if name == "program" else name] = rss - prev
            prev = rss
        baseline = stages[-1][1]
        parts["run-time"] = top["hwm"] - baseline
        dominant = max(parts, key=parts.get)
        at_peak = top["at_peak"]
        out[node_type] = {
            "processes": len(mine), "pids": [p["pid"] for p in mine],
            "peak_rss_mib": top["hwm"] / MIB,
            "peak_rss_mib_each": [round(p["hwm"] / MIB, 1) for p in mine],
            "baseline_mib": baseline / MIB,   # imports (+ the warm start, for model nodes)
            "parts_mib": {k: v / MIB for k, v in parts.items()},
            "dominated_by": dominant,
            "dominant_share": parts[dominant] / top["hwm"],
            "at_peak_anon_mib": at_peak.get("Anonymous", 0) / MIB,
            "at_peak_file_mib": (at_peak.get("Rss", 0) - at_peak.get("Anonymous", 0)) / MIB,
            "at_peak_pss_mib": at_peak.get("Pss", 0) / MIB,
            "frameworks_mapped": frameworks,
            "samples": top["samples"],
        }
    return out


def main(argv):
    del argv
    load_before = os.getloadavg()
    run = run_program_and_sample(FLAGS.run_dir)
    by_type = analyse(run["procs"], FLAGS.init_checkpoint)
    model_bytes = checkpoint_bytes(FLAGS.init_checkpoint)
    total_rss = sum(p["hwm"] for p in run["procs"]) / MIB
    total_pss = sum(p["at_peak"].get("Pss", 0) for p in run["procs"]) / MIB

    print(f"program: {' '.join(os.path.relpath(c, REPO) if c.startswith(REPO) else c for c in run['cmd'])}")
    print(f"ran {run['wall_s']:.0f}s, {run['summary'].get('steps')} steps; policy checkpoint "
          f"{model_bytes / MIB:.2f} MiB")
    columns = [("python+program", "py+prog"), ("torch", "torch"), ("tensorflow", "TF(+Reverb)"),
               ("reverb client", "Reverb C++"),
               ("node modules", "node mods"), ("model code", "HF model"), ("weights", "weights"),
               ("run-time", "run-time")]
    header = (f"{'node':>9} {'n':>2} {'peak RSS':>8} {'baseline':>8} "
              + " ".join(f"{label:>9}" for _, label in columns)
              + f" {'anon@pk':>7} {'file@pk':>7}  dominated by")
    print(header + "\n" + "-" * len(header))
    for t, r in by_type.items():
        p = r["parts_mib"]
        print(f"{t:>9} {r['processes']:>2} {r['peak_rss_mib']:>8.0f} {r['baseline_mib']:>8.0f} "
              + " ".join(f"{p[key]:>9.0f}" if key in p else f"{'-':>9}" for key, _ in columns)
              + f" {r['at_peak_anon_mib']:>7.0f} {r['at_peak_file_mib']:>7.0f}  "
              f"{r['dominated_by']} ({r['dominant_share']:.0%})")
    print("(MiB. peak RSS: VmHWM of the largest process of the type. baseline: a fresh interpreter "
          "doing the same imports (+ loading the warm start), split into the stages that follow; "
          "run-time = peak - baseline: buffers, optimizer, clients, threads. anon/file@pk: "
          f"anonymous vs file-backed RSS at the highest sample.)\nall processes: RSS sum "
          f"{total_rss:.0f} MiB; PSS sum at the peaks {total_pss:.0f} MiB (pages shared between "
          "processes, mostly libraries, counted once)")
    print(json.dumps({"benchmark": "memory", "node_types": by_type,
                      "total_peak_rss_mib": total_rss, "total_pss_mib": total_pss,
                      "policy_checkpoint_mib": model_bytes / MIB, "wall_s": run["wall_s"],
                      "steps": run["summary"].get("steps"),
                      "final_eval_accuracy": run["summary"].get("final_eval_accuracy"),
                      "program_args": FLAGS.program_args, "load_avg_before": list(load_before),
                      "load_avg_after": list(os.getloadavg())}, sort_keys=True))


if __name__ == "__main__":
    app.run(main)
