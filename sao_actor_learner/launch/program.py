"""A launchpad-style program: labelled groups of nodes, wired together by handles.

A `Program` is a set of groups; each group (a label such as "actor") holds nodes. `add_node`
returns a `Handle`; passing that handle in another node's arguments wires the two nodes: the
launcher dereferences it inside the consuming node's own process (or thread), just before that
node builds its worker.

    program = Program("sao")
    with program.group("replay"):
        replay = program.add_node(ServiceNode(make_replay_server, 64, client_factory=make_client))
    with program.group("actor"):
        program.add_node(PyNode(make_actor, config, replay))

Node kinds:
  ServiceNode  a server: the launcher picks a free port on 127.0.0.1 and calls
               `factory(*args, port=port, **kwargs)` in the node, which returns a Worker that
               serves on that port until stopped. Its handle dereferences to
               `client_factory("127.0.0.1:PORT")` (or the address string).
  PyNode       any other Worker: `fn(*args, **kwargs)` builds it in the node, then `run()`.
               Its handle dereferences to the built worker under the threaded launcher only.

Pure standard library: nothing here may import torch, TensorFlow or Reverb.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

__all__ = ["Program", "Node", "PyNode", "ServiceNode", "Handle", "ServiceHandle",
           "PyNodeHandle", "map_handles", "find_handles"]

# How a program can be launched (launch(..., launch_type=...)).
LAUNCH_TYPES = ("local_mt", "local_mp", "ray")


class Handle:
    """A reference to a node of a program, to pass in other nodes' arguments.

    `dereference()` turns it into what the consuming node uses (a client, an address, a worker).
    Handles are small and picklable: the process launcher ships them to each node's process.
    """

    def __init__(self, label: str, index: int) -> None:
        self.label = label
        self.index = index

    @property
    def name(self) -> str:
        """The node's name, `<label>_<index>` (also its log file's stem)."""
        return f"{self.label}_{self.index}"

    @property
    def address(self) -> Optional[str]:
        """The node's "127.0.0.1:PORT" once launched (service nodes), else None."""
        return None

    def dereference(self) -> Any:
        """What the consuming node sees in place of this handle."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class ServiceHandle(Handle):
    """Handle of a `ServiceNode`: dereferences to `client_factory(address)` (or the address)."""

    def __init__(self, label: str, index: int,
                 client_factory: Optional[Callable[[str], Any]]) -> None:
        super().__init__(label, index)
        self.client_factory = client_factory
        self._address: Optional[str] = None

    @property
    def address(self) -> Optional[str]:
        return self._address

    def bind_address(self, address: str) -> None:
        """Launcher side: the "host:port" this service serves on (kept across its restarts)."""
        self._address = address

    def dereference(self) -> Any:
        """A client built from the node's address (the address string without a client_factory)."""
        if self._address is None:
            raise RuntimeError(
                f"service node {self.name!r} has no address yet: handles can be dereferenced "
                "only after `launch(program)` has allocated its port")
        if self.client_factory is None:
            return self._address
        return self.client_factory(self._address)


class PyNodeHandle(Handle):
    """Handle of a `PyNode`: dereferences to the built worker, under the threaded launcher only.

    That lets a test launch a program with `launch_type="local_mt"` and step a worker by hand.
    Under the process launcher the worker lives in another process and dereferencing raises.
    """

    def __init__(self, label: str, index: int) -> None:
        super().__init__(label, index)
        self._launch_type: Optional[str] = None
        self._ready = threading.Event()
        self._worker: Any = None
        self._error: Optional[str] = None

    def dereference(self, timeout: Optional[float] = 60.0) -> Any:
        """The worker object built by this node (local_mt), waiting up to `timeout` s for it."""
        if self._launch_type is None:
            raise RuntimeError(f"PyNode {self.name!r} has not been launched: there is no worker "
                               "to dereference yet")
        if self._launch_type != "local_mt":
            raise RuntimeError(
                f"PyNode handle {self.name!r} dereferences to its worker object only under "
                f"launch_type='local_mt'; under {self._launch_type!r} the worker lives in another "
                "process. Launch with local_mt to step it by hand, or pass a ServiceNode's handle "
                "to talk to it over the network.")
        if not self._ready.wait(timeout):
            raise TimeoutError(f"PyNode {self.name!r} built no worker within {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"PyNode {self.name!r} failed before building its worker:\n"
                               f"{self._error}")
        return self._worker

    # Launcher side.
    @property
    def launch_type(self) -> Optional[str]:
        """The launch type its program runs under (None before launch)."""
        return self._launch_type

    def bind_launch_type(self, launch_type: str) -> None:
        """Launcher side: the program was launched with `launch_type`."""
        self._launch_type = launch_type

    def set_worker(self, worker: Any) -> None:
        """Launcher side (local_mt): the node built `worker`; dereference() returns it."""
        self._worker = worker
        self._ready.set()

    def set_error(self, error: str) -> None:
        """Launcher side (local_mt): the node ended without building a worker, for `error`."""
        if not self._ready.is_set():
            self._error = error
            self._ready.set()

    def reset(self) -> None:
        """Launcher side (local_mt): the node restarts; dereference() waits for its new worker."""
        self._ready.clear()
        self._worker, self._error = None, None

    def __getstate__(self) -> dict:
        # A copy in another process cannot reach this process's worker.
        return {"label": self.label, "index": self.index,
                "_launch_type": "another process" if self._launch_type else None}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["label"], state["index"])
        self._launch_type = state["_launch_type"]


class Node:
    """One unit of a program; the launcher runs each node in its own process or thread."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        if not callable(fn):
            raise TypeError(f"{type(self).__name__} needs a callable that builds a worker, "
                            f"got {fn!r}")
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.label: Optional[str] = None
        self.index: Optional[int] = None
        self.handle: Optional[Handle] = None

    @property
    def name(self) -> str:
        """`<label>_<index>` once added to a program."""
        return f"{self.label}_{self.index}"

    def default_label(self) -> str:
        """The label of a node added outside any group: its function's name without `make_`."""
        name = getattr(self.fn, "__name__", type(self).__name__).lower()
        if name.startswith("make_") and len(name) > 5:
            name = name[5:]
        return name

    def _make_handle(self, label: str, index: int) -> Handle:
        raise NotImplementedError

    def _bind(self, label: str, index: int) -> Handle:
        self.label, self.index = label, index
        self.handle = self._make_handle(label, index)
        return self.handle

    def __repr__(self) -> str:
        fn = getattr(self.fn, "__qualname__", repr(self.fn))
        where = self.name if self.label is not None else "unbound"
        return f"{type(self).__name__}({fn}, {where})"


class PyNode(Node):
    """A node that builds a Worker with `fn(*args, **kwargs)` (handles dereferenced) and runs it."""

    def _make_handle(self, label: str, index: int) -> Handle:
        return PyNodeHandle(label, index)


class ServiceNode(Node):
    """A server node: `factory(*args, port=port, **kwargs)` returns a Worker serving on `port`.

    The launcher allocates the port on 127.0.0.1 and waits until it accepts TCP connections
    before starting any PyNode. `client_factory(address)` is what the handle dereferences to;
    without one the handle dereferences to the address string "127.0.0.1:PORT".
    """

    def __init__(self, factory: Callable[..., Any], *args: Any,
                 client_factory: Optional[Callable[[str], Any]] = None, **kwargs: Any) -> None:
        super().__init__(factory, *args, **kwargs)
        if "port" in kwargs:
            raise ValueError(f"ServiceNode({getattr(factory, '__name__', factory)!r}) got "
                             "port=...: the launcher picks the port and passes it itself")
        if client_factory is not None and not callable(client_factory):
            raise TypeError(f"client_factory={client_factory!r}: must be callable(address)")
        self.client_factory = client_factory

    def _make_handle(self, label: str, index: int) -> Handle:
        return ServiceHandle(label, index, self.client_factory)


class Program:
    """A named set of labelled groups of nodes, launched with `launch(program, ...)`."""

    def __init__(self, name: str) -> None:
        if not name or not isinstance(name, str):
            raise ValueError(f"Program name {name!r}: must be a non-empty string")
        self.name = name
        self._groups: Dict[str, List[Node]] = {}
        self._current_group: Optional[str] = None
        self._launched = False

    @contextlib.contextmanager
    def group(self, label: str) -> Iterator[None]:
        """Nodes added inside `with program.group(label):` belong to group `label`."""
        _check_label(label)
        if self._current_group is not None:
            raise ValueError(f"group({label!r}) inside group({self._current_group!r}): groups "
                             "do not nest")
        self._current_group = label
        try:
            yield
        finally:
            self._current_group = None

    def add_node(self, node: Node, label: Optional[str] = None) -> Handle:
        """Adds `node` to the current group (or `label`, or its own label) and returns its handle."""
        if not isinstance(node, Node):
            raise TypeError(f"add_node({node!r}): expected a PyNode or ServiceNode")
        if node.handle is not None:
            raise ValueError(f"{node!r} was already added to a program; make a new node")
        if self._launched:
            raise RuntimeError(f"program {self.name!r} was already launched; nodes can no "
                               "longer be added")
        if label is not None and self._current_group is not None and label != self._current_group:
            raise ValueError(f"add_node(label={label!r}) inside group({self._current_group!r})")
        label = label or self._current_group or node.default_label()
        _check_label(label)
        nodes = self._groups.setdefault(label, [])
        handle = node._bind(label, len(nodes))
        nodes.append(node)
        return handle

    @property
    def launched(self) -> bool:
        """Whether the program was launched (a program is launched at most once)."""
        return self._launched

    def mark_launched(self) -> None:
        """Launcher side: no node can be added, and the program cannot be launched again."""
        self._launched = True

    @property
    def groups(self) -> Dict[str, List[Node]]:
        """label -> the group's nodes, in the order they were added."""
        return {label: list(nodes) for label, nodes in self._groups.items()}

    @property
    def nodes(self) -> List[Node]:
        """Every node, group by group."""
        return [n for nodes in self._groups.values() for n in nodes]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}×{len(v)}" for k, v in self._groups.items())
        return f"Program({self.name!r}: {sizes})"


def _check_label(label: str) -> None:
    if not isinstance(label, str) or not label or any(c in label for c in "/\\ \t\n"):
        raise ValueError(f"group label {label!r}: must be a non-empty string without spaces or "
                         "slashes (it names log files)")


def map_handles(value: Any, fn: Callable[[Handle], Any], _memo: Optional[dict] = None) -> Any:
    """`value` with every Handle inside replaced by `fn(handle)`.

    Looks inside lists, tuples (named tuples too), dicts, sets and dataclass instances; any
    container without a handle is returned as is (the same object). The same handle met twice
    maps to the same result.
    """
    memo: dict = {} if _memo is None else _memo

    def visit(v: Any) -> Any:
        if isinstance(v, Handle):
            if id(v) not in memo:
                memo[id(v)] = (v, fn(v))      # keep v alive so its id stays unique
            return memo[id(v)][1]
        if isinstance(v, (str, bytes, bytearray, int, float, bool, type(None))):
            return v
        if isinstance(v, dict):
            items = [(k, visit(x)) for k, x in v.items()]
            if all(x is v[k] for k, x in items):
                return v
            if type(v) is dict:
                return dict(items)
            new = copy.copy(v)
            new.update(items)
            return new
        if isinstance(v, (list, tuple, set, frozenset)):
            items = [visit(x) for x in v]
            if all(a is b for a, b in zip(items, v)):
                return v
            if type(v) in (list, tuple, set, frozenset):
                return type(v)(items)
            if isinstance(v, tuple) and hasattr(v, "_fields"):
                return type(v)._make(items)
            if isinstance(v, list):
                new = copy.copy(v)
                new[:] = items
                return new
            raise TypeError(f"a handle inside a {type(v).__name__} can't be dereferenced; use a "
                            "list, tuple, dict or dataclass")
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            changes = {}
            for f in dataclasses.fields(v):
                old = getattr(v, f.name)
                new = visit(old)
                if new is not old:
                    if not f.init:
                        raise TypeError(f"a handle in {type(v).__name__}.{f.name} (an init=False "
                                        "field) can't be dereferenced")
                    changes[f.name] = new
            return dataclasses.replace(v, **changes) if changes else v
        return v

    return visit(value)


def find_handles(value: Any) -> List[Handle]:
    """Every Handle inside `value` (where `map_handles` looks), each once, in order met."""
    found: Dict[int, Handle] = {}

    def visit(v: Any) -> None:
        if isinstance(v, Handle):
            found.setdefault(id(v), v)
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)
        elif isinstance(v, (list, tuple, set, frozenset)):
            for x in v:
                visit(x)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            for f in dataclasses.fields(v):
                visit(getattr(v, f.name))

    visit(value)
    return list(found.values())
