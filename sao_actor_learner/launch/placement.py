"""Placement: which CPU cores and which GPUs each group of nodes may use (local_mp).

Asynchronous RL is deployed disaggregated: generation on its own accelerators, training on
others, both busy at once. `--placement=actor:cpu0,learner:cpu1` models that on one CPU machine;
`--placement=actor:gpu0-3,learner:gpu4-7` is the same flag on a GPU machine.

Spec: comma-separated entries `GROUP:KIND RANGE`, KIND `cpu` or `gpu`, RANGE `N` or `N-M`
(inclusive). A group may have one cpu and one gpu entry (`learner:cpu1,learner:gpu0`). Groups
not named run where the launcher's process may run (all its cores, every visible GPU).

What a placed node gets, before its interpreter starts (local_mp spawns a fresh interpreter):
- cpu: `SAO_CPU_SET` (the cores, e.g. "1" or "0,1") and `OMP_NUM_THREADS` = the number of cores;
  `apply_cpu_set()` (called first thing in the node's process) pins the process with
  `os.sched_setaffinity`, and `node_threads()` sizes torch's thread pool to the set.
- gpu: `CUDA_VISIBLE_DEVICES` (the listed devices, renumbered from 0 inside the node).

Checked against the machine before launch (`check_placement`): a core the launcher may not run
on, or a GPU index beyond the visible ones, is a config error naming the entry.

`critic` (IN_PROCESS_GROUPS) is no node: it places the concurrent critic inside the learner's
process (--critic_concurrent, learner/critic_worker.py). `critic:cpuN[-M]`: the critic's thread
and its torch threads are pinned to those cores (os.sched_setaffinity on the thread);
`critic:gpuN`: the critic lives on that one GPU, which is added to the learner's
CUDA_VISIBLE_DEVICES (`critic_placement` gives its index inside the learner's process).

Pure standard library.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
from typing import Dict, Mapping, Optional, Sequence, Tuple

__all__ = ["GroupPlacement", "parse_placement", "check_placement", "placement_env",
           "apply_cpu_set", "node_threads", "visible_gpu_count", "placement_launch_options",
           "CPU_SET_ENV", "IN_PROCESS_GROUPS", "critic_placement"]

CPU_SET_ENV = "SAO_CPU_SET"
IN_PROCESS_GROUPS = ("critic",)   # placed inside the learner's process, not a node


@dataclasses.dataclass(frozen=True)
class GroupPlacement:
    """The cores and GPUs of one group (empty: not restricted)."""
    cpus: Tuple[int, ...] = ()
    gpus: Tuple[int, ...] = ()


def _parse_range(text: str, entry: str) -> Tuple[int, ...]:
    lo, sep, hi = text.partition("-")
    try:
        first = int(lo)
        last = int(hi) if sep else first
    except ValueError:
        raise ValueError(f"placement entry {entry!r}: the range {text!r} must be N or N-M "
                         "(e.g. cpu0 or gpu0-3)") from None
    if first < 0 or last < first:
        raise ValueError(f"placement entry {entry!r}: the range {text!r} must be N or N-M with "
                         "0 <= N <= M")
    return tuple(range(first, last + 1))


def parse_placement(entries: Sequence[str],
                    groups: Sequence[str]) -> Dict[str, GroupPlacement]:
    """{group: GroupPlacement} from entries such as "actor:cpu0" or "learner:gpu4-7".

    groups: the groups a program may have (a name outside them is an error listing them).
    """
    cpus: Dict[str, Tuple[int, ...]] = {}
    gpus: Dict[str, Tuple[int, ...]] = {}
    for raw in entries:
        entry = str(raw).strip()
        if not entry:
            continue
        group, sep, spec = entry.partition(":")
        if not sep or group not in groups:
            raise ValueError(f"placement entry {entry!r}: must be GROUP:cpuN[-M] or "
                             f"GROUP:gpuN[-M] with GROUP one of {', '.join(groups)}")
        kind = spec[:3]
        if kind not in ("cpu", "gpu"):
            raise ValueError(f"placement entry {entry!r}: after the group comes cpu or gpu and "
                             "a range, e.g. actor:cpu0 or learner:gpu4-7")
        target = cpus if kind == "cpu" else gpus
        if group in target:
            raise ValueError(f"placement names {kind}s of group {group!r} twice; give one "
                             f"range (e.g. {group}:{kind}0-1)")
        target[group] = _parse_range(spec[3:], entry)
    return {g: GroupPlacement(cpus.get(g, ()), gpus.get(g, ()))
            for g in sorted(set(cpus) | set(gpus))}


def visible_gpu_count() -> int:
    """GPUs this process could hand out: $CUDA_VISIBLE_DEVICES when set, else nvidia-smi's
    list (0 without either). No torch import: this runs in config validation."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def check_placement(placement: Mapping[str, GroupPlacement],
                    allowed_cpus: Optional[Sequence[int]] = None,
                    gpu_count: Optional[int] = None) -> None:
    """Raises ValueError when a group is placed on a core or GPU this machine does not give.

    allowed_cpus: the cores this process may run on (default: its affinity);
    gpu_count: GPUs visible (default: `visible_gpu_count()`, only asked when a GPU is placed).
    """
    if allowed_cpus is None and os.environ.get(CPU_SET_ENV):
        # A placed node (pinned to its own cores) re-validating its config: the launcher
        # checked the cores against the whole machine already.
        allowed_cpus = [c for p in placement.values() for c in p.cpus]
    allowed = set(os.sched_getaffinity(0) if allowed_cpus is None else allowed_cpus)
    for group, p in placement.items():
        missing = [c for c in p.cpus if c not in allowed]
        if missing:
            raise ValueError(f"placement {group}:cpu{_text(p.cpus)}: core(s) {missing} are not "
                             f"available here (this process may use cores "
                             f"{_text(sorted(allowed))})")
        if p.gpus:
            count = visible_gpu_count() if gpu_count is None else gpu_count
            beyond = [g for g in p.gpus if g >= count]
            if beyond:
                raise ValueError(f"placement {group}:gpu{_text(p.gpus)}: GPU(s) {beyond} do not "
                                 f"exist here ({count} visible)")


def _text(ids: Sequence[int]) -> str:
    ids = list(ids)
    if ids and ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 1:
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(str(i) for i in ids)


def placement_env(placement: Mapping[str, GroupPlacement]) -> Dict[str, Dict[str, str]]:
    """{group: environment variables} that put each group's processes where it is placed (a
    critic GPU joins the learner's visible devices; `critic` gets no environment of its own)."""
    out: Dict[str, Dict[str, str]] = {}
    for group, p in placement.items():
        if group in IN_PROCESS_GROUPS:
            continue
        env: Dict[str, str] = {}
        if p.cpus:
            env[CPU_SET_ENV] = ",".join(str(c) for c in p.cpus)
            env["OMP_NUM_THREADS"] = str(len(p.cpus))
        gpus = _learner_gpus(placement) if group == "learner" else p.gpus
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        out[group] = env
    return out


def _learner_gpus(placement: Mapping[str, GroupPlacement]) -> Tuple[int, ...]:
    """The learner's GPUs, then the critic's when the learner is placed on GPUs."""
    learner, critic = (placement.get(g, GroupPlacement()) for g in ("learner", "critic"))
    if not learner.gpus:
        return ()
    return learner.gpus + tuple(g for g in critic.gpus if g not in learner.gpus)


def critic_placement(entries: Sequence[str],
                     groups: Sequence[str]) -> Tuple[Tuple[int, ...], Optional[int]]:
    """(the critic's cores, its GPU's index inside the learner's process or None) of a
    --placement; ((), None) without a critic entry. A critic entry names one GPU at most."""
    placement = parse_placement(entries, tuple(groups) + IN_PROCESS_GROUPS)
    critic = placement.get("critic")
    if critic is None:
        return (), None
    if len(critic.gpus) > 1:
        raise ValueError(f"placement critic:gpu{_text(critic.gpus)}: the critic runs on one "
                         "GPU; name one (e.g. critic:gpu1)")
    if not critic.gpus:
        return critic.cpus, None
    learner_gpus = _learner_gpus(placement)
    gpu = critic.gpus[0]
    return critic.cpus, learner_gpus.index(gpu) if learner_gpus else gpu


def apply_cpu_set() -> Optional[Tuple[int, ...]]:
    """Pins this process to $SAO_CPU_SET (if set); returns the cores, or None."""
    spec = os.environ.get(CPU_SET_ENV)
    if not spec:
        return None
    cores = tuple(int(c) for c in spec.split(","))
    os.sched_setaffinity(0, cores)
    return cores


def node_threads(default: int) -> int:
    """torch threads for this process: the size of its CPU set when placed, else `default`."""
    spec = os.environ.get(CPU_SET_ENV)
    return len(spec.split(",")) if spec else default


def placement_launch_options(entries: Sequence[str], launch_type: str,
                             groups: Sequence[str]) -> Dict[str, Dict[str, Dict[str, str]]]:
    """The `launch()` arguments of a --placement: {"group_env": ...} under local_mp; nothing
    (with a warning saying so) under the other launchers."""
    if not entries:
        return {}
    if launch_type == "local_mp":
        placement = parse_placement(entries, tuple(groups) + IN_PROCESS_GROUPS)
        return {"group_env": placement_env(placement)}
    logging.warning("--placement=%s is ignored under launch=%s (it places local_mp processes; "
                    "on Ray give --ray_resources)", ",".join(entries), launch_type)
    return {}
