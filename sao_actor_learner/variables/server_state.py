"""The persisted state of the variable server (`state_path`): the admission counters, the
newest version ever published and the latest progress report, as text and back, and its writes
through state_file.py.

The server writes it whenever it changes, before the call that changed them answers, and reads
it back when a server starts on the same path. Weights are not persisted: a restarted server
holds none until the learner publishes again, but admission continues from the same counters
and capacity (which uses the newest version ever published; Admit's policy_version is the newest
version held).
"""
from __future__ import annotations

import json
from typing import Optional, Tuple

import grpc
from absl import logging

from sao_actor_learner.variables.admission import Admission
from sao_actor_learner.variables.progress import Progress
from sao_actor_learner.variables.rpc import Abort
from sao_actor_learner.variables.state_file import StateFile

STATE_FORMAT = "sao-variable-server-state/1"


def state_text(published_version: int, admission: Admission, progress_json: str) -> str:
    """The state as one JSON object; `progress_json` is the progress report's JSON, kept ready
    by the caller (it changes only with ReportProgress and may hold many seqs)."""
    head = json.dumps({"format": STATE_FORMAT, "published_version": published_version,
                       "admission": admission.state()})
    return f'{head[:-1]}, "progress": {progress_json}}}'


def parse_state(state: dict, admission: Admission,
                path: str) -> Tuple[Admission, int, Optional[Progress]]:
    """(the admission, the newest published version, the progress report or None) of a state
    read back from `path`; the admission keeps `admission`'s settings. ValueError when it is
    not a variable-server state."""
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"state file {path} has format {state.get('format')!r}, not "
                         f"{STATE_FORMAT!r}; move it away to start from zero counters")
    try:
        restored = Admission.from_state(state["admission"], admission.batch_size,
                                        admission.max_staleness, admission.enabled)
        published_version = int(state["published_version"])
        progress = None
        if state["progress"] is not None:
            progress = Progress.from_state(state["progress"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"state file {path} is not a variable-server state ({e!r}); move "
                         "it away to start from zero counters") from None
    return restored, published_version, progress


def load_state(state_file: StateFile,
               admission: Admission) -> Optional[Tuple[Admission, int, Optional[Progress]]]:
    """`parse_state` of what `state_file` holds; None when it holds nothing yet."""
    state = state_file.load()
    if state is None:
        return None
    return parse_state(state, admission, state_file.path)


def save_state(state_file: StateFile, snapshot: Tuple[int, str], method: str) -> None:
    """Writes `snapshot` (sequence number, text) before call `method` answers; Abort (INTERNAL)
    when it cannot be written (the change is kept in memory)."""
    try:
        state_file.save(*snapshot)
    except OSError as e:
        logging.error("VariableServer: could not write %s: %s", state_file.path, e)
        raise Abort(grpc.StatusCode.INTERNAL,
                    f"{method}: the server could not persist its admission state to "
                    f"{state_file.path} ({e}); the change is kept in memory") from None
