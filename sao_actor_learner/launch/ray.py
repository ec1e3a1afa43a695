"""launch_type="ray": every node of a `Program` a Ray actor, on one machine or a cluster.

    launched = launch(program, launch_type="ray", run_dir="runs/x",
                      ray_address=None,                  # None: a local Ray instance
                      resources={"learner": {"num_cpus": 1, "num_gpus": 1}},
                      restart={"actor": RestartPolicy(max_restarts=3)})

The same program, handles and `Launched` API as the local launchers; only where the nodes run
differs. Guarantees:

- Cluster: `ray_address=None` joins the Ray instance this process already started with
  `ray.init()`, else starts a local one (and shuts it down on stop); "auto" or
  "ray://head:10001" joins an existing cluster, which must have this package (and whatever
  module the node functions live in) importable on every machine. The driver's own import
  paths are prepended to each actor's PYTHONPATH (one machine, or shared filesystems).
- Resources: each node is an actor reserving its group's `resources` ({"num_cpus": .,
  "num_gpus": ., "memory": bytes, "resources": {custom: amount}}); groups not listed reserve
  nothing. A request the cluster can never satisfy fails before anything starts.
- Addresses: a service actor picks a free port on its own machine. Bound to a loopback host
  (the default) its handle resolves to 127.0.0.1:PORT, so a cluster of several machines is
  refused; with a wildcard bind it resolves to the machine's IP. Reverb (the replay node)
  always listens on all interfaces.
- Restarts: a restarted node is a new actor; a restarted service is pinned to the machine it
  ran on and reuses its port. nodes.json records each node's Ray actor id, Ray node id, host,
  worker pid and assigned resources.
- Logs: each actor's output goes to run_dir/logs/<node>.log when run_dir is writable from its
  machine, else it stays in Ray's own logs.
- Stop: cooperative (the worker's stop(), `notice_s`, then `ray.kill`); every actor this
  launcher made is killed by the end of stop(), and Ray kills a driver's actors when the
  driver dies. Exit codes: 0 (run() returned), 1 (it raised), -9 (its process died or was
  killed: Ray does not report the signal).
"""
from __future__ import annotations

import os
import pickle
import secrets
import signal
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Mapping, Optional

try:
    import ray
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("launch_type='ray' needs Ray: `pip install '.[ray]'` (`make venv` installs "
                      "it), or pick launch_type='local_mp'") from e

from sao_actor_learner.launch.addresses import (advertised_host, free_ports, is_loopback,
                                                join_address, local_service_host, port_of,
                                                port_open)
from sao_actor_learner.launch.logs import (LOG_TAIL_LINES, flush_std_streams, redirect_output,
                                           start_log, tail)
from sao_actor_learner.launch.node_runtime import WorkerControl, build_and_run
from sao_actor_learner.launch.program import Node
from sao_actor_learner.launch.records import NodeRecord
from sao_actor_learner.launch.runner import Runner, pickle_nodes

__all__ = ["RayRunner", "RESOURCE_KEYS", "check_resources"]

RESOURCE_KEYS = ("num_cpus", "num_gpus", "memory", "resources")
_ACTOR_CONCURRENCY = 4      # run() blocks one thread; stop(), info() and port checks use others


class _NodeActor:
    """One node inside a Ray actor: builds the worker from the pickled node and runs it."""

    def __init__(self, name: str, log_path: Optional[str], env: Mapping[str, str]) -> None:
        os.environ.update(env)
        self._name = name
        self._log_path = None
        if log_path:
            try:
                os.makedirs(os.path.dirname(log_path), exist_ok=True)
                redirect_output(log_path)
                self._log_path = log_path
            except OSError:   # run_dir not reachable from this machine: Ray keeps the logs
                pass
        print(f"[launch] {name}: pid {os.getpid()} (Ray actor)", flush=True)
        self._control = WorkerControl(name)

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "host": ray.util.get_node_ip_address(),
                "ray_node_id": ctx.get_node_id(), "ray_actor_id": ctx.get_actor_id(),
                "log": self._log_path,
                "resources": {k: v for k, v in ctx.get_assigned_resources().items()}}

    def free_port(self, host: str) -> int:
        """A free TCP port on `host` of this machine."""
        return free_ports(1, host)[0]

    def port_open(self, host: str, port: int) -> bool:
        """Whether `host:port` accepts TCP connections, seen from this machine."""
        return port_open(host, port)

    def run(self, payload: bytes, port: Optional[int]) -> None:
        try:
            fn, args, kwargs = pickle.loads(payload)
            build_and_run(self._name, fn, args, kwargs, port, self._control)
            print(f"[launch] {self._name}: run() returned", flush=True)
        except BaseException:
            traceback.print_exc()
            raise
        finally:
            flush_std_streams()

    def stop(self) -> None:
        print(f"[launch] {self._name}: stop requested", flush=True)
        self._control.request_stop()


_RemoteNodeActor = ray.remote(_NodeActor)


class _Instance:
    def __init__(self, actor: Any, generation: int) -> None:
        self.actor, self.generation = actor, generation
        self.ref: Any = None      # run()'s object ref once started


class RayRunner(Runner):
    """launch_type="ray": every node a Ray actor (see the module docstring)."""

    launch_type = "ray"
    terminate_grace_s = 10.0

    def __init__(self, ray_address: Optional[str] = None,
                 resources: Optional[Mapping[str, Mapping[str, Any]]] = None) -> None:
        self._ray_address = ray_address
        self._all_resources = check_resources(resources or {})
        self._resources: Dict[str, Dict[str, Any]] = {}
        self._launch_id = secrets.token_hex(3)
        self._owns_ray = False
        self._records: List[NodeRecord] = []
        self._node_ids: Dict[str, str] = {}        # node name -> the Ray node it first ran on
        self._payloads: Dict[str, bytes] = {}
        self._monitor: Optional[threading.Thread] = None
        self._monitor_stop = threading.Event()

    def attach(self, launched: Any) -> None:
        super().attach(launched)
        groups = launched.program.groups
        self._resources = {k: v for k, v in self._all_resources.items() if k in groups}

    def log_path(self, node: Node) -> Optional[str]:
        return os.path.join(self.launched.run_dir, "logs", f"{node.name}.log")

    # ----------------------------------------------------------------------------- starting
    def setup(self, records: List[NodeRecord]) -> None:
        self._records = list(records)
        if ray.is_initialized():
            if self._ray_address is not None:
                raise ValueError(f"ray_address={self._ray_address!r}, but this process is "
                                 "already connected to Ray (ray.init() was called): pass "
                                 "ray_address=None to use that connection")
        else:
            kwargs = dict(include_dashboard=False, log_to_driver=False)
            if self._ray_address:
                ray.init(address=self._ray_address, **kwargs)
            else:
                ray.init(**kwargs)
            self._owns_ray = True
        self._check_cluster(records)
        os.makedirs(os.path.join(self.launched.run_dir, "logs"), exist_ok=True)

    def _check_cluster(self, records: List[NodeRecord]) -> None:
        """Refuses programs the cluster cannot place or whose addresses would not resolve."""
        bind_host = self.launched.bind_host
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if len(alive) > 1 and is_loopback(bind_host) and any(r.kind == "service"
                                                             for r in records):
            raise ValueError(
                f"bind_host={bind_host!r} with a Ray cluster of {len(alive)} machines: "
                "services bound to a loopback address are unreachable from the other "
                "machines; bind a wildcard (bind_host='0.0.0.0') or an interface, with an auth "
                "token (--auth_token or SAO_AUTH_TOKEN)")
        total = ray.cluster_resources()
        wanted: Dict[str, float] = {}
        for r in records:
            res = self._resources.get(r.label, {})
            for key, ray_key in (("num_cpus", "CPU"), ("num_gpus", "GPU"), ("memory", "memory")):
                wanted[ray_key] = wanted.get(ray_key, 0.0) + float(res.get(key, 0) or 0)
            for key, amount in (res.get("resources") or {}).items():
                wanted[key] = wanted.get(key, 0.0) + float(amount)
        short = {k: (v, total.get(k, 0.0)) for k, v in wanted.items()
                 if v > total.get(k, 0.0) + 1e-9}
        if short:
            asks = ", ".join(f"{k}: {v:g} asked, {have:g} in the cluster"
                             for k, (v, have) in short.items())
            raise ValueError(f"the program's Ray resources exceed the cluster's ({asks}); "
                             f"lower the per-group resources {dict(self._resources)} or add "
                             "machines")

    def service_addresses(self, services: List[NodeRecord]) -> List[str]:
        """Places each service's actor first: its address depends on its machine."""
        bind_host, addresses = self.launched.bind_host, []
        for r in services:
            self._create_actor(r)
            host = advertised_host(bind_host, r.extra["host"])
            probe = local_service_host(bind_host) if host == "127.0.0.1" else host
            addresses.append(join_address(host, ray.get(r.instance.actor.free_port.remote(probe))))
        return addresses

    def prepare(self, records: List[NodeRecord]) -> None:
        self._payloads = pickle_nodes(records, "launch_type='ray'")   # every address is known
        self._monitor = threading.Thread(target=self._monitor_main, daemon=True,
                                         name=f"{self.launched.program.name}/ray-monitor")
        self._monitor.start()

    def _actor_options(self, r: NodeRecord) -> dict:
        res = self._resources.get(r.label, {})
        env = dict(self.launched.env)
        paths = [p for p in sys.path if p and os.path.isdir(p)
                 and not p.startswith((sys.prefix, sys.base_prefix))]
        env["PYTHONPATH"] = os.pathsep.join(paths + ["${PYTHONPATH}"])
        options = dict(
            name=f"{self.launched.program.name}-{self._launch_id}/{r.name}#{r.generation}",
            max_concurrency=_ACTOR_CONCURRENCY, max_restarts=0,
            num_cpus=float(res.get("num_cpus", 0) or 0),
            num_gpus=float(res.get("num_gpus", 0) or 0), runtime_env={"env_vars": env})
        if res.get("memory"):
            options["memory"] = float(res["memory"])
        if res.get("resources"):
            options["resources"] = dict(res["resources"])
        if r.kind == "service" and r.name in self._node_ids:
            # A restarted service goes back to its machine, to keep its address.
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                node_id=self._node_ids[r.name], soft=False)
        return options

    def _create_actor(self, r: NodeRecord) -> None:
        if r.log_path:   # as local_mp: a fresh log per launch, restarts append to it
            try:
                start_log(r.log_path, self.launched.program.name, r.name, r.generation,
                          len(r.history), where=" as a Ray actor")
            except OSError:
                pass
        actor = _RemoteNodeActor.options(**self._actor_options(r)).remote(
            r.name, r.log_path, self.launched.env)
        timeout = self.launched.service_timeout_s
        try:
            info = ray.get(actor.info.remote(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            _kill_quietly(actor)
            raise RuntimeError(
                f"node {r.name}: Ray placed no actor within {timeout:g} s (resources "
                f"{self._resources.get(r.label, {})}); the cluster may lack them or be busy, "
                "or its machine is gone") from None
        r.instance = _Instance(actor, r.generation)
        self._node_ids.setdefault(r.name, info["ray_node_id"])
        r.pid = info["pid"]
        r.extra = {"host": info["host"], "ray_actor_id": info["ray_actor_id"],
                   "ray_node_id": info["ray_node_id"], "resources": info["resources"]}
        if info["log"] is None:
            r.log_path = None

    def start(self, r: NodeRecord) -> None:
        """(Re)starts node r: its actor (made already for a first-time service), then run()."""
        if r.instance is None or r.instance.generation != r.generation:
            self._create_actor(r)
        port = port_of(r.node.handle.address) if r.kind == "service" else None
        r.instance.ref = r.instance.actor.run.remote(self._payloads[r.name], port)

    def port_open(self, r: NodeRecord, host: str, port: int) -> bool:
        if r.instance is None:
            return False
        try:
            return bool(ray.get(r.instance.actor.port_open.remote(host, port), timeout=10))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    # ---------------------------------------------------------------------------- watching
    def _monitor_main(self) -> None:
        """Notices actors whose run() returned, raised or died."""
        while not self._monitor_stop.is_set():
            live = {}
            for r in self._records:
                inst = r.instance
                if r.status == "running" and inst is not None and inst.ref is not None:
                    live[inst.ref] = (r, inst)
            if not live:
                time.sleep(0.1)
                continue
            ready, _ = ray.wait(list(live), num_returns=len(live), timeout=0.2)
            for ref in ready:
                self._collect(*live[ref])

    def _collect(self, r: NodeRecord, inst: _Instance) -> None:
        error = None
        try:
            ray.get(inst.ref)
            code = 0
        except ray.exceptions.RayActorError as e:    # its process died or was killed
            code, error = -signal.SIGKILL, str(e)
        except ray.exceptions.RayTaskError as e:     # run() raised
            code, error = 1, str(e)
        except Exception as e:  # noqa: BLE001
            code, error = 1, f"{type(e).__name__}: {e}"
        if code == 0:
            _kill_quietly(inst.actor)   # its run() returned: free its process and resources
        self.launched.node_exited(r, code, error, inst.generation)

    # ----------------------------------------------------------------------------- stopping
    def request_stop(self, r: NodeRecord) -> None:
        if r.instance is not None:
            r.instance.actor.stop.remote()

    def terminate(self, r: NodeRecord) -> bool:
        if r.instance is not None:
            _kill_quietly(r.instance.actor)
        return True

    def release(self, r: NodeRecord) -> None:
        inst, r.instance = r.instance, None
        if inst is not None:
            _kill_quietly(inst.actor)

    def finish(self, records: List[NodeRecord]) -> None:
        self._monitor_stop.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=5.0)
        for r in records:
            if r.instance is not None:
                _kill_quietly(r.instance.actor)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def details(self, r: NodeRecord) -> str:
        where = r.extra.get("host", "?")
        details = f"Ray actor {r.extra.get('ray_actor_id')} (pid {r.pid} on {where})"
        if r.log_path:
            details += f"; last {LOG_TAIL_LINES} lines of {r.log_path}:\n" + \
                tail(r.log_path, LOG_TAIL_LINES)
        if r.error:
            details += "\n" + r.error[-4000:]
        return details


def check_resources(resources: Mapping[str, Mapping[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """label -> a copy of its Ray resources; raises for unknown keys and negative amounts."""
    out: Dict[str, Dict[str, Any]] = {}
    for label, res in resources.items():
        if not isinstance(res, Mapping):
            raise TypeError(f"resources[{label!r}]={res!r}: expected a dict such as "
                            "{'num_cpus': 1, 'num_gpus': 0}")
        unknown = set(res) - set(RESOURCE_KEYS)
        if unknown:
            raise ValueError(f"resources[{label!r}] has unknown keys {sorted(unknown)}; use "
                             f"{', '.join(RESOURCE_KEYS)}")
        for key in ("num_cpus", "num_gpus", "memory"):
            value = res.get(key, 0) or 0
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"resources[{label!r}][{key!r}]={value!r}: must be a number >= 0")
        for key, amount in (res.get("resources") or {}).items():
            if not isinstance(amount, (int, float)) or amount < 0:
                raise ValueError(f"resources[{label!r}]['resources'][{key!r}]={amount!r}: must "
                                 "be a number >= 0")
        out[label] = dict(res)
    return out


def _kill_quietly(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already dead
        pass
