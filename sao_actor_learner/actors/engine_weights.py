"""An actor's weight following: keeps its engine on the weights it should generate with.

The actor's VariableFollower (the variable client) fetches new versions in the background;
`EngineWeights.update` moves the engine to the version it holds, between batches. With an
engine whose weight_sync_mode is keep or abort, a weight thread (`start`) also hands every new
version to the engine (`offer_weights`) as soon as the follower holds it, while a batch is being
generated, so it reaches the generations in flight (docs/DESIGN.md "Weight sync modes"); one
lock makes the thread's offers and the loop's loads one sequence, so the engine's version never
goes back. Before rollouts admitted at version P start, `catch_up(P)` makes sure the engine
runs P (admission counts them as started there), or, with forced staleness k (a drift
experiment), version P - k (no weight thread then); with a lag distribution (actors/lags.py)
each admitted batch draws its own lag, version P - lag.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional

from sao_actor_learner import core
from sao_actor_learner.variables.channel import VariableClientError


class EngineWeights:
    """Moves `engine` to the versions `variables` holds (see the module docstring).

    Args:
      engine: the actor's Engine.
      variables: where versions come from (the actor's core.ActorCoordination).
      decode: variables' params -> the state dict the engine loads.
      forced_staleness: k >= 0 runs version P - k for rollouts admitted at P; -1: off.
      lags: with forced staleness, a lag sampler (actors/lags.LagSampler: `draw()`,
        `max_lag`) whose draw replaces k for each admitted batch; None: k every time.
      poll_s: how often the weight thread looks for a new version.
      stop: the actor's stop event (the thread returns soon after it is set; it sets it when
        it fails).
      thread_name: the weight thread's name.
    """

    def __init__(self, engine: core.Engine, variables: core.VariableFollower,
                 decode: Callable, forced_staleness: int, poll_s: float,
                 stop: threading.Event, thread_name: str = "actor-weights", lags=None):
        self._engine, self._variables, self._decode = engine, variables, decode
        self._forced_staleness = forced_staleness
        self._lags = lags if forced_staleness >= 0 else None
        max_lag = lags.max_lag if self._lags is not None else max(forced_staleness, 0)
        # Forced staleness: the weights of this many recent versions stay decoded (a drawn lag
        # further back fetches its version from the server again).
        self._keep_decoded = min(max_lag, 6) + 2
        self.lag_hist: List[int] = [0] * (max_lag + 1)   # lags drawn, by lag
        self._poll_s = float(poll_s)
        self._stop = stop
        self._thread_name = thread_name
        # Whether new versions reach generations in flight (a weight thread offers them).
        self.feeding = engine.weight_sync_mode != "off" and forced_staleness < 0
        self._weights_lock = threading.Lock()   # the thread's offers and the loop's loads
        self._lock = threading.Lock()           # counters
        self._offered = -1
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None   # what stopped the weight thread
        self._weights_by_version: Dict[int, dict] = {}   # forced staleness: recent versions
        self._counters: Dict[str, float] = {"weight_updates": 0, "weights_offered": 0,
                                            "weight_load_s": 0.0}

    @property
    def counters(self) -> Dict[str, float]:
        """weight_updates (versions loaded between batches), weight_load_s (seconds those
        loads took: decoding and putting the weights into the engine), weights_offered (by the
        thread)."""
        with self._lock:
            return dict(self._counters)

    def update(self, wait: bool = False) -> None:
        """Asks the follower for a newer version (`wait`: blocks until it holds the server's
        newest) and loads the version it holds into the engine when that is another (a newer
        one while the thread feeds); nothing with forced staleness once the engine has weights
        (`catch_up` picks the version then)."""
        if wait:
            self._variables.update_and_wait()
        else:
            self._variables.update()
        if self._forced_staleness >= 0 and self._engine.version >= 0:
            return  # the engine runs an older version on purpose; `catch_up` picks it
        v, params = self._variables.get_variables()  # one consistent (version, weights) pair
        with self._weights_lock:
            current = self._engine.version
            if v >= 0 and (v > current if self.feeding else v != current):
                self._put(lambda: self._decode(params), v)

    def catch_up(self, policy_version: int) -> None:
        """Before rollouts admitted at `policy_version` start: the engine runs that version (a
        newer one is fine), or version `policy_version - k` with forced staleness k."""
        if self._forced_staleness >= 0:
            lag = self._lags.draw() if self._lags is not None else self._forced_staleness
            with self._lock:
                self.lag_hist[lag] += 1
            self._variables.wait_for_version(policy_version)
            self._load_version(max(0, policy_version - lag))
        elif policy_version > self._engine.version:
            self._variables.wait_for_version(policy_version)
            self.update()

    def _load_version(self, version: int) -> None:
        """Forced staleness: puts the weights of `version` (an older one) into the engine."""
        if self._engine.version == version:
            return
        weights = self._weights_by_version.get(version)
        if weights is None:
            held, params = self._variables.get_variables()
            weights = self._decode(params) if held == version else \
                self._decode(self._variables.fetch_version(version))
            self._weights_by_version[version] = weights
            for old in sorted(self._weights_by_version)[:-self._keep_decoded]:
                del self._weights_by_version[old]
        self._put(lambda: weights, version)

    def _put(self, weights_fn: Callable[[], dict], version: int) -> None:
        """Loads `weights_fn()` (decoding, where it decodes) into the engine as `version`,
        counted in weight_updates and timed in weight_load_s."""
        t_load = time.monotonic()
        self._engine.load_weights(weights_fn(), version)
        with self._lock:
            self._counters["weight_updates"] += 1
            self._counters["weight_load_s"] += time.monotonic() - t_load

    def start(self) -> None:
        """Starts the weight thread when the engine takes weights in flight (`feeding`)."""
        if self.feeding:
            self._thread = threading.Thread(target=self._feed, daemon=True,
                                            name=self._thread_name)
            self._thread.start()

    def join(self, timeout_s: float = 60.0) -> None:
        """Waits for the weight thread (after the stop event was set)."""
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _feed(self) -> None:
        """The weight thread: offers the engine every version newer than its own as soon as
        the follower holds it, also mid-generation. A failure is kept in `error` and sets the
        stop event; the actor's run() raises it."""
        try:
            while not self._stop.wait(self._poll_s):
                try:
                    self._variables.update()      # a background fetch, when one is due
                except VariableClientError as e:
                    if not e.retryable:
                        raise
                    continue
                v, params = self._variables.get_variables()
                with self._weights_lock:
                    if v < 0 or v <= max(self._offered, self._engine.version):
                        continue
                    self._engine.offer_weights(self._decode(params), v)
                    self._offered = v
                with self._lock:
                    self._counters["weights_offered"] += 1
        except BaseException as e:  # noqa: BLE001 - re-raised by the actor's run()
            self.error = e
            self._stop.set()
