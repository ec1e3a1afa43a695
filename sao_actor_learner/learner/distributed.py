"""The learner group: N ranks in one torch.distributed process group, or a single process.

`Collective` is what the learner's parts need from the group: sums of numbers and tensors
across ranks (exact batch statistics, global loss normalisers, gradient all-reduce), the ranks'
objects (rewards for a shared baseline tracker), and a barrier. `SINGLE` is the one-process
group (every operation is the identity). `ProcessGroup` runs them on an initialised
torch.distributed group (gloo on CPU, NCCL on GPU) with a timeout: a collective that does not
complete within it raises `CollectiveTimeout` naming this rank, instead of hanging.

Strategies (`prepare_module`):
  ddp    every rank holds the whole model; after a step's micro-batches each rank's gradients
         are summed across ranks (`all_reduce_gradients`, bucketed by dtype). This is DDP's
         arithmetic without the DistributedDataParallel wrapper, whose hooks need every forward
         to go through the wrapper (the learner calls the model's body and LM head directly).
  fsdp2  the decoder layers are sharded with torch.distributed.fsdp.fully_shard (parameters,
         gradients and optimizer state split across ranks; reduce-scatter in the backward); the
         rest (embeddings, final norm, LM head, value head) stays replicated and its gradients
         are all-reduced as under ddp.
Gradients are SUMS over ranks: each rank's loss is already divided by the global denominator
(`Collective.sum` of the token counts), so the sum over ranks is the whole-batch gradient.

No reverb, tensorflow or grpc here.
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Callable, Iterable, List, Sequence

import torch

from sao_actor_learner.models.checkpoint import sync_state_dict
from sao_actor_learner.models.lora import merged_state_dict


class CollectiveTimeout(RuntimeError):
    """A learner-group collective did not complete in time (a rank died or hangs)."""


class Collective:
    """The one-process learner group; `ProcessGroup` is the distributed one."""
    rank = 0
    world_size = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: it publishes versions and writes checkpoints."""
        return self.rank == 0

    def sum(self, values: Sequence[float]) -> List[float]:
        """Element-wise sums of `values` over the ranks (float64)."""
        return [float(v) for v in values]

    def max(self, values: Sequence[float]) -> List[float]:
        return [float(v) for v in values]

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks in place; returns it."""
        return tensor

    def gather_objects(self, obj: Any) -> List[Any]:
        """Every rank's `obj`, in rank order."""
        return [obj]

    def barrier(self) -> None:
        """Returns once every rank has called it."""

    def counter_total(self, name: str, add: int = 0) -> int:
        """Adds `add` to the group-wide counter `name` and returns its total. Not a collective:
        any rank may call it at any time (the group keeps it in its TCP store). A single
        process has no group-wide counters: its parts count for themselves."""
        raise NotImplementedError("counter_total is for learner groups (ProcessGroup)")


SINGLE = Collective()


class ProcessGroup(Collective):
    """The ranks of an initialised default torch.distributed process group."""

    def __init__(self, timeout_s: float = 300.0, store=None):
        import torch.distributed as dist
        if not dist.is_initialized():
            raise RuntimeError("ProcessGroup needs torch.distributed.init_process_group first "
                               "(init_process_group below does it)")
        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout_s = timeout_s
        self._store = store
        self._device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")

    def _wait(self, work, what: str) -> None:
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:   # gloo raises on timeout and when a peer is gone
            raise CollectiveTimeout(
                f"learner rank {self.rank} of {self.world_size}: {what} failed or did not "
                f"complete within {self.timeout_s:g} s ({e}); another rank probably died") from e
        if ok is False:
            raise CollectiveTimeout(f"learner rank {self.rank} of {self.world_size}: {what} did "
                                    f"not complete within {self.timeout_s:g} s")

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        work = self._dist.all_reduce(tensor, op=self._dist.ReduceOp.SUM, async_op=True)
        self._wait(work, f"all_reduce of {tuple(tensor.shape)}")
        return tensor

    def sum(self, values: Sequence[float]) -> List[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._device)
        return self.all_reduce_(t).cpu().tolist()

    def max(self, values: Sequence[float]) -> List[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._device)
        work = self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, async_op=True)
        self._wait(work, "all_reduce(max)")
        return t.cpu().tolist()

    def gather_objects(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj)   # has no async form; bounded by the pg timeout
        return out

    def barrier(self) -> None:
        self._wait(self._dist.barrier(async_op=True), "barrier")

    def counter_total(self, name: str, add: int = 0) -> int:
        if self._store is None:
            raise RuntimeError("ProcessGroup(store=None) has no group-wide counters")
        return int(self._store.add(f"counter/{name}", int(add)))


def serve_store(host: str, port: int, timeout_s: float = 300.0):
    """The learner group's TCP store, listening on host:port (the rendezvous node keeps it)."""
    import torch.distributed as dist
    return dist.TCPStore(host, int(port), is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s), use_libuv=False)


def gloo_interface(store_host: str, environ) -> str:
    """The network interface gloo's ranks should listen on: the loopback interface when the
    group's store is on loopback (a one-host group), so that no rank listens on the address the
    host name resolves to (gloo's default, a LAN address on many machines); "" to leave gloo's
    choice (a multi-host group, or GLOO_SOCKET_IFNAME already set by the user)."""
    loopback = store_host in ("localhost", "::1") or store_host.startswith("127.")
    if environ.get("GLOO_SOCKET_IFNAME") or not loopback:
        return ""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n == "lo"), next((n for n in names if n.startswith("lo")), ""))


def init_process_group(rank: int, world_size: int, address: str, timeout_s: float = 300.0,
                       backend: str = "") -> ProcessGroup:
    """Joins the learner group whose TCP store (`serve_store`) listens at `address`
    ("host:port") and returns its Collective. backend "": NCCL when CUDA is available, else gloo.

    Generations: the ranks of a group are (re)started together, so each rank's own join count
    in the store is the group's generation; the group runs under that prefix, and a restarted
    group never meets keys of the one before it.
    """
    import torch.distributed as dist
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    host, port = address.rsplit(":", 1)
    if backend == "gloo":
        interface = gloo_interface(host, os.environ)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    root = dist.TCPStore(host, int(port), is_master=False, timeout=timeout, use_libuv=False)
    generation = root.add(f"joins/rank_{rank}", 1)
    store = dist.PrefixStore(f"generation_{generation}/", root)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    return ProcessGroup(timeout_s, store=store)


def prepare_module(module: torch.nn.Module, strategy: str, collective: Collective,
                   layers: Iterable[torch.nn.Module] = ()) -> torch.nn.Module:
    """Readies `module` for `strategy` in this group (see the module docstring): identical
    initial parameters on every rank (broadcast from rank 0), and with fsdp2 the `layers`
    sharded. Returns the module."""
    if collective.world_size == 1:
        return module
    import torch.distributed as dist
    with torch.no_grad():
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        for b in module.buffers():
            dist.broadcast(b.data, src=0)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in layers:
            fully_shard(layer, reshard_after_forward=True)
    elif strategy != "ddp":
        raise ValueError(f"learner_strategy={strategy!r}: must be ddp or fsdp2")
    return module


def is_sharded(t: torch.Tensor) -> bool:
    """Whether `t` is an FSDP2 shard (a DTensor)."""
    return type(t).__name__ == "DTensor"


def all_reduce_gradients(params: Sequence[torch.nn.Parameter], collective: Collective) -> None:
    """Sums the gradients of `params` over the ranks: the replicated ones are all-reduced, one
    flat bucket per dtype; FSDP2 shards were reduce-scattered in the backward as a mean (its
    custom divide factors need NCCL's PREMUL_SUM, which gloo lacks), so they are scaled by the
    world size."""
    if collective.world_size == 1:
        return
    by_dtype = {}
    for p in params:
        if p.grad is None:
            continue
        if is_sharded(p):
            p.grad.mul_(collective.world_size)
        else:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        collective.all_reduce_(flat)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n


def clip_grad_norm(params: Sequence[torch.nn.Parameter], max_norm: float,
                   collective: Collective) -> float:
    """Clips the gradients of `params` (replicated tensors and FSDP2 shards alike) to a total
    norm of `max_norm`; returns the norm before clipping (inf/nan when a gradient is not
    finite; then nothing is scaled)."""
    sharded_sq = torch.zeros((), dtype=torch.float64)
    replicated_sq = torch.zeros((), dtype=torch.float64)
    grads = []
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        local = g.to_local() if is_sharded(g) else g
        sq = local.detach().double().pow(2).sum().cpu()
        if is_sharded(g):
            sharded_sq += sq
        else:
            replicated_sq += sq
        grads.append(local)
    if collective.world_size > 1:
        sharded_sq = torch.tensor(collective.sum([float(sharded_sq)])[0], dtype=torch.float64)
    total = float((sharded_sq + replicated_sq).sqrt())
    if grads and total == total and total != float("inf") and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for g in grads:
            g.mul_(scale)
    return total


def full_state_dict(module: torch.nn.Module) -> dict:
    """The module's whole state dict on CPU (FSDP2 shards gathered; every rank must call it;
    LoRA adapters merged into their base weights, models/lora.merged_state_dict)."""
    out = {}
    for name, t in merged_state_dict(module).items():
        if is_sharded(t):
            t = t.full_tensor()
        out[name] = t.detach().to("cpu")
    return out


def sync_weights(module: torch.nn.Module) -> Callable[[], dict]:
    """What publishing a version sends, as a call rank 0 makes when it publishes: the module's
    sync state dict (models/checkpoint.sync_state_dict: tied duplicates left out, LoRA merged).
    Under FSDP2 the shards are gathered here, on CPU (a collective: every rank must call it);
    otherwise nothing is computed until the call."""
    if not any(is_sharded(p) for p in module.parameters()):
        return lambda: sync_state_dict(module)
    seen, tied = set(), set()
    for name, t in module.state_dict(keep_vars=True).items():   # tied: the same parameter
        if id(t) in seen:
            tied.add(name)
        seen.add(id(t))
    gathered = {k: v for k, v in full_state_dict(module).items() if k not in tied}
    return lambda: gathered


def optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's whole state (FSDP2 shards gathered into full tensors on every rank, a
    collective then); what `load_optimizer_state` takes back, on any number of ranks."""
    if not any(is_sharded(p) for p in module.parameters()):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict)
    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))


def load_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         state: dict) -> None:
    """Loads `optimizer_state` output (each rank keeps its shards under FSDP2)."""
    if not any(is_sharded(p) for p in module.parameters()):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         set_optimizer_state_dict)
    set_optimizer_state_dict(module, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))
