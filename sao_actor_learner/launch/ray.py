"""The Ray launcher: every node of a `Program` a Ray actor, on one machine or a cluster.

    launched = launch(program, launch_type="ray", run_dir="runs/x",
                      ray_address=None,                  # None: a local Ray instance
                      resources={"learner": {"num_cpus": 1, "num_gpus": 1}},
                      restart={"actor": RestartPolicy(max_restarts=3)})
    launched.wait()

The same program, handles and `Launched` API as the local launchers (wait, stop, restart_node,
nodes.json, restarts); only where the nodes run differs:

- Cluster: `ray_address=None` joins the Ray instance this process already started with
  `ray.init()`, else starts a local one (and shuts it down on stop); "auto" or
  "ray://head:10001" joins an existing cluster, which must have this package (and whatever
  module the node functions live in) importable on every machine. The driver's own import paths
  are prepended to each actor's PYTHONPATH, which covers one machine and shared filesystems.
- Resources: each node is an actor reserving its group's `resources` ({"num_cpus": .,
  "num_gpus": ., "memory": bytes, "resources": {custom: amount}}); groups not listed reserve
  nothing (Ray's default of 1 CPU per actor would otherwise cap a 2-CPU machine at 2 nodes).
  A request the cluster can never satisfy fails before anything starts.
- Addresses: a service actor picks a free port on its own machine. With services bound to a
  loopback address (the default, `bind_host="127.0.0.1"`) its handle resolves to
  127.0.0.1:PORT, reachable only on that machine, so a cluster of several machines is refused
  (bind a wildcard or an interface, and set an auth token: see variables/security.py); with a
  wildcard bind it resolves to the machine's IP, so nodes anywhere in the cluster reach it.
  Reverb (the replay node) always listens on all interfaces.
- Restarts: a crashed node (an exception, or its worker process killed) is a new actor; a
  restarted service is pinned to the machine it ran on and reuses its port, so its address
  and the handles other nodes hold stay valid. nodes.json records each node's Ray actor id,
  Ray node id, host, worker pid and assigned resources, rewritten on every restart.
- Logs: each actor's stdout and stderr go to run_dir/logs/<node>.log when run_dir is writable
  from its machine (one machine or a shared filesystem), else they stay in Ray's own logs.
- Stop: cooperative as in local_mp (the worker's stop(), `notice_s`, then `ray.kill`); every
  actor this launcher made is killed by the end of stop(), and Ray kills a driver's actors when
  the driver dies. An actor's "exit code" is 0 (run() returned), 1 (it raised) or -9 (its
  process died or was killed: Ray does not report the signal).
"""
from __future__ import annotations

import os
import pickle
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Mapping, Optional, Tuple

try:
    import ray
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("launch_type='ray' needs Ray: `pip install '.[ray]'` (`make venv` installs "
                      "it), or pick launch_type='local_mp'") from e

from sao_actor_learner.launch.local import (_LIVE, _LIVE_LOCK, LOG_TAIL_LINES, Launched,
                                            _bracket, _build_and_run, _flush, _redirect_output,
                                            _Record, _tail, _WorkerControl, is_loopback,
                                            local_service_host)
from sao_actor_learner.launch.program import PyNodeHandle, ServiceNode, find_handles

__all__ = ["RayLaunched", "RESOURCE_KEYS"]

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
                _redirect_output(log_path)
                self._log_path = log_path
            except OSError:   # run_dir not reachable from this machine: Ray keeps the logs
                pass
        print(f"[launch] {name}: pid {os.getpid()} (Ray actor)", flush=True)
        self._control = _WorkerControl(name)

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "host": ray.util.get_node_ip_address(),
                "ray_node_id": ctx.get_node_id(), "ray_actor_id": ctx.get_actor_id(),
                "log": self._log_path,
                "resources": {k: v for k, v in ctx.get_assigned_resources().items()}}

    def free_port(self, host: str) -> int:
        """A free TCP port on `host` of this machine."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host.strip("[]"), 0))
            return s.getsockname()[1]

    def port_open(self, host: str, port: int) -> bool:
        """Whether `host:port` accepts TCP connections, seen from this machine."""
        try:
            with socket.create_connection((host.strip("[]"), port), timeout=1.0):
                return True
        except OSError:
            return False

    def run(self, payload: bytes, port: Optional[int]) -> None:
        try:
            fn, args, kwargs = pickle.loads(payload)
            _build_and_run(self._name, fn, args, kwargs, port, self._control)
            print(f"[launch] {self._name}: run() returned", flush=True)
        except BaseException:
            traceback.print_exc()
            raise
        finally:
            _flush()

    def stop(self) -> None:
        print(f"[launch] {self._name}: stop requested", flush=True)
        self._control.request_stop()


_RemoteNodeActor = ray.remote(_NodeActor)


class RayLaunched(Launched):
    """launch_type="ray": every node a Ray actor (see the module docstring)."""

    launch_type = "ray"

    def __init__(self, *args: Any, ray_address: Optional[str] = None,
                 resources: Optional[Mapping[str, Mapping[str, Any]]] = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ray_address = ray_address
        self._resources = _check_resources(resources or {}, self.program.groups)
        self._launch_id = secrets.token_hex(3)
        self._owns_ray = False
        self._actors: Dict[str, Any] = {}                 # node name -> actor handle
        self._refs: Dict[str, Tuple[Any, int]] = {}       # node name -> (run() ref, generation)
        self._ports: Dict[str, int] = {}
        self._node_ids: Dict[str, str] = {}
        self._payloads: Dict[str, bytes] = {}
        self._monitor: Optional[threading.Thread] = None
        self._monitor_stop = threading.Event()

    def _log_path(self, node) -> Optional[str]:
        return os.path.join(self.run_dir, "logs", f"{node.name}.log")

    # ----------------------------------------------------------------------------- starting
    def _start(self) -> None:
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._connect()
        self._check_cluster()
        os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
        services = [r for r in self._records if r.kind == "service"]
        for r in services:                       # place services first: their addresses
            self._create_actor(r)
            self._assign_address(r)
        for r in self._records:
            if r.kind == "py":
                r.node.handle._launch_type = self.launch_type
        self._pickle_payloads()                  # every address is known now
        self._monitor = threading.Thread(target=self._monitor_main, daemon=True,
                                         name=f"{self.program.name}/ray-monitor")
        self._monitor.start()
        for r in services:
            self._run(r)
        with self._cond:
            self._write_nodes_json()
        for r in services:
            self._wait_for_service(r)
        for r in self._records:
            if r.kind == "py":
                self._create_actor(r)
                self._run(r)
        with self._cond:
            self._write_nodes_json()

    def _connect(self) -> None:
        if ray.is_initialized():
            if self._ray_address is not None:
                raise ValueError(f"ray_address={self._ray_address!r}, but this process is "
                                 "already connected to Ray (ray.init() was called): pass "
                                 "ray_address=None to use that connection")
            return
        kwargs = dict(include_dashboard=False, log_to_driver=False)
        if self._ray_address:
            ray.init(address=self._ray_address, **kwargs)
        else:
            ray.init(**kwargs)
        self._owns_ray = True

    def _check_cluster(self) -> None:
        """Refuses programs the cluster cannot place or whose addresses would not resolve."""
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if len(alive) > 1 and is_loopback(self.bind_host) and \
                any(r.kind == "service" for r in self._records):
            raise ValueError(
                f"bind_host={self.bind_host!r} with a Ray cluster of {len(alive)} machines: "
                "services bound to a loopback address are unreachable from the other "
                "machines; bind a wildcard (bind_host='0.0.0.0') or an interface, with an auth "
                "token (--auth_token or SAO_AUTH_TOKEN)")
        total = ray.cluster_resources()
        wanted: Dict[str, float] = {}
        for r in self._records:
            res = self._resources.get(r.node.label, {})
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

    def _actor_options(self, r: _Record) -> dict:
        res = self._resources.get(r.node.label, {})
        env = dict(self._env)
        paths = [p for p in sys.path if p and os.path.isdir(p)
                 and not p.startswith((sys.prefix, sys.base_prefix))]
        env["PYTHONPATH"] = os.pathsep.join(paths + ["${PYTHONPATH}"])
        options = dict(name=f"{self.program.name}-{self._launch_id}/{r.name}#{r.generation}",
                       max_concurrency=_ACTOR_CONCURRENCY, max_restarts=0,
                       num_cpus=float(res.get("num_cpus", 0) or 0),
                       num_gpus=float(res.get("num_gpus", 0) or 0),
                       runtime_env={"env_vars": env})
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

    def _create_actor(self, r: _Record) -> None:
        if r.log_path:   # as local_mp: a fresh log per launch, restarts append to it
            try:
                with open(r.log_path, "a" if r.generation else "w") as f:
                    what = f"restarting (restart {len(r.history)})" if r.generation \
                        else "starting"
                    f.write(f"[launch] {self.program.name}/{r.name}: {what} as a Ray actor "
                            f"({time.ctime()})\n")
            except OSError:
                pass
        actor = _RemoteNodeActor.options(**self._actor_options(r)).remote(
            r.name, r.log_path, self._env)
        try:
            info = ray.get(actor.info.remote(), timeout=self.service_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor, no_restart=True)
            raise RuntimeError(
                f"node {r.name}: Ray placed no actor within {self.service_timeout_s:g} s "
                f"(resources {self._resources.get(r.node.label, {})}); the cluster may lack "
                "them or be busy, or its machine is gone") from None
        with self._cond:
            self._actors[r.name] = actor
            self._node_ids.setdefault(r.name, info["ray_node_id"])
            r.pid = info["pid"]
            r.extra = {"host": info["host"], "ray_actor_id": info["ray_actor_id"],
                       "ray_node_id": info["ray_node_id"], "resources": info["resources"]}
            if info["log"] is None:
                r.log_path = None

    def _assign_address(self, r: _Record) -> None:
        actor = self._actors[r.name]
        if is_loopback(self.bind_host):
            host = "127.0.0.1"
        elif self.bind_host in ("0.0.0.0", "::", "[::]", ""):
            host = r.extra["host"]
        else:
            host = self.bind_host
        port = ray.get(actor.free_port.remote(local_service_host(self.bind_host)
                                              if host == "127.0.0.1" else host))
        self._ports[r.name] = port
        r.node.handle._address = f"{_bracket(host)}:{port}"

    def _pickle_payloads(self) -> None:
        for r in self._records:
            node = r.node
            for h in find_handles((node.args, node.kwargs)):
                if isinstance(h, PyNodeHandle):
                    raise ValueError(
                        f"node {node.name} gets the handle of PyNode {h.name} in its arguments: "
                        "under launch_type='ray' a PyNode's worker lives in its own actor and "
                        "cannot be dereferenced elsewhere; pass a ServiceNode's handle instead")
            try:
                self._payloads[r.name] = pickle.dumps((node.fn, node.args, node.kwargs),
                                                      protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:
                raise TypeError(
                    f"node {node.name}: its function and arguments can't be pickled for Ray "
                    f"({type(e).__name__}: {e}); use module-level functions and picklable "
                    "arguments") from e

    def _run(self, r: _Record) -> None:
        port = self._ports.get(r.name) if isinstance(r.node, ServiceNode) else None
        ref = self._actors[r.name].run.remote(self._payloads[r.name], port)
        with self._cond:
            self._refs[r.name] = (ref, r.generation)
            r.status = "running"

    def _start_node(self, r: _Record) -> None:
        """(Re)starts node r: a new actor (a service on its old machine and port), then run()."""
        self._create_actor(r)
        self._run(r)

    def _wait_for_service(self, r: _Record) -> None:
        actor = self._actors[r.name]
        host = r.node.handle.address.rsplit(":", 1)[0]
        if host == "127.0.0.1" or self.bind_host in ("0.0.0.0", "::", "[::]", ""):
            host = "127.0.0.1"
        deadline = time.monotonic() + self.service_timeout_s
        while True:
            if r.done:
                raise self._failure_error(
                    r, f"service node {r.name} exited (code {r.exitcode}) before accepting "
                       f"connections on {r.node.handle.address}")
            try:
                if ray.get(actor.port_open.remote(host, self._ports[r.name]), timeout=10):
                    return
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            if time.monotonic() > deadline:
                raise self._failure_error(
                    r, f"service node {r.name} did not accept TCP connections on "
                       f"{r.node.handle.address} within {self.service_timeout_s:g} s")
            time.sleep(0.05)

    # ---------------------------------------------------------------------------- watching
    def _monitor_main(self) -> None:
        """Notices actors whose run() returned, raised or died."""
        while not self._monitor_stop.is_set():
            self._collect_ready(timeout=0.2)

    def _live_refs(self, records: Optional[List[_Record]] = None) -> Dict[Any, Tuple[_Record, int]]:
        with self._cond:
            chosen = self._records if records is None else records
            return {self._refs[r.name][0]: (r, self._refs[r.name][1]) for r in chosen
                    if r.status == "running" and r.name in self._refs}

    def _collect_ready(self, timeout: float, records: Optional[List[_Record]] = None) -> None:
        live = self._live_refs(records)
        if not live:
            time.sleep(min(timeout, 0.1))
            return
        ready, _ = ray.wait(list(live), num_returns=len(live), timeout=timeout)
        for ref in ready:
            r, generation = live[ref]
            self._collect(r, generation, ref)

    def _collect(self, r: _Record, generation: int, ref: Any) -> None:
        error = None
        try:
            ray.get(ref)
            code = 0
        except ray.exceptions.RayActorError as e:    # its process died or was killed
            code, error = -signal.SIGKILL, str(e)
        except ray.exceptions.RayTaskError as e:     # run() raised
            code, error = 1, str(e)
        except Exception as e:  # noqa: BLE001
            code, error = 1, f"{type(e).__name__}: {e}"
        actor = self._actors.get(r.name)
        if actor is not None and code == 0:
            _kill_quietly(actor)        # its run() returned: free its process and resources
        self._record_exit(r, code, error, generation)

    def _poll(self, r: _Record) -> None:
        """The monitor thread records exits; nothing to do here."""

    # ----------------------------------------------------------------------------- stopping
    def _request_node_stop(self, r: _Record) -> None:
        actor = self._actors.get(r.name)
        if actor is not None:
            actor.stop.remote()

    def _kill_node(self, r: _Record) -> None:
        actor = self._actors.get(r.name)
        if actor is not None:
            r.killed = True
            _kill_quietly(actor)

    def _release_instance(self, r: _Record) -> None:
        actor = self._actors.pop(r.name, None)
        self._refs.pop(r.name, None)
        if actor is not None:
            _kill_quietly(actor)

    def _stop_records(self, kind: str, records: List[_Record]) -> None:
        for r in records:
            if r.status == "running":
                self._request_node_stop(r)
        self._wait_exit(records, self.notice_s)
        left = [r for r in records if r.status == "running"]
        for r in left:
            print(f"[launch] node {r.name} (Ray actor) did not stop within notice_s="
                  f"{self.notice_s:g} s; killing it", file=sys.stderr, flush=True)
            self._kill_node(r)
        self._wait_exit(left, 10.0)
        with self._cond:
            for r in records:
                if r.status == "pending":
                    r.status = "not_started"

    def _wait_exit(self, records: List[_Record], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(r.status == "running" for r in records):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._collect_ready(min(remaining, 0.2), records)

    def _kill_all(self) -> None:
        for r in self._records:
            if r.status == "running":
                self._kill_node(r)
        self._wait_exit(self._records, 5.0)

    def _finish_stop(self) -> None:
        self._monitor_stop.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=5.0)
        for actor in list(self._actors.values()):
            _kill_quietly(actor)
        self._actors.clear()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def _details(self, r: _Record) -> str:
        where = r.extra.get("host", "?")
        details = f"Ray actor {r.extra.get('ray_actor_id')} (pid {r.pid} on {where})"
        if r.log_path:
            details += f"; last {LOG_TAIL_LINES} lines of {r.log_path}:\n" + \
                _tail(r.log_path, LOG_TAIL_LINES)
        if r.error:
            details += "\n" + r.error[-4000:]
        return details


def _check_resources(resources: Mapping[str, Mapping[str, Any]],
                     groups: Mapping[str, Any]) -> Dict[str, Dict[str, Any]]:
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
        if label in groups:
            out[label] = dict(res)
    return out


def _kill_quietly(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already dead
        pass
