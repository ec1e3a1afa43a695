"""Run folders hold data, never code: the journal, the spools and the learner's checkpoint
state are read without unpickling (safe_records.py, torch.load(weights_only=True)). A file that
would run code when unpickled (a tampered or copied run folder, or one of an older version) is
refused, naming it, and nothing in it runs."""
import collections
import os
import pickle
import struct
import zlib

import numpy as np
import pytest
import torch

from sao_actor_learner import safe_records
from sao_actor_learner.actors.spool import RolloutSpool
from sao_actor_learner.learner import checkpointing
from sao_actor_learner.learner.baselines import PerPromptBaseline
from sao_actor_learner.learner.grpo import GroupAssembler
from sao_actor_learner.learner.journal import ReaderJournal, ResumePoint, journal_dir
from sao_actor_learner.learner.segments import OldJournalError, segment_path
from sao_actor_learner.types import Rollout


class Exploit:
    """Unpickling this runs os.system: it touches the file named by `path`."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def rollout(k):
    mask = np.array([0, 1, 1], np.int8)
    return Rollout(tokens=np.arange(k, k + 3), action_mask=mask,
                   rollout_logp=np.where(mask == 1, -0.5, 0.0), versions=np.where(mask, 1, -1),
                   rewards=[0, 0, float(k)], prompt_id=k, actor_id=1, seq=k)


@pytest.fixture()
def proof(tmp_path):
    path = str(tmp_path / "pwned")
    yield path
    assert not os.path.exists(path), "a run-folder file ran code when read"


def test_the_exploit_does_run_code_when_unpickled(tmp_path):
    """The fixture's payload is real: plain pickle.loads runs it."""
    path = str(tmp_path / "ran")
    pickle.loads(pickle.dumps(Exploit(path)))
    assert os.path.exists(path)


def test_round_trip_of_what_run_folders_hold():
    assembler = GroupAssembler(2)
    assembler.add([rollout(3)])
    baseline = PerPromptBaseline(0.9)
    value = {"r": [rollout(1), rollout(2)], (1, 2): {3, 4}, "od": collections.OrderedDict(a=1),
             "q": collections.deque([1, 2], 5), "rng": np.random.get_state(),
             "n": np.float32(1.5), "b": b"\x00\x01", "assembler": assembler, "base": baseline}
    back = safe_records.loads(safe_records.dumps(value))
    assert [r.key for r in back["r"]] == [(1, 1), (1, 2)]
    assert np.array_equal(back["r"][1].tokens, rollout(2).tokens)
    assert back["r"][1].tokens.dtype == np.int32 and back[(1, 2)] == {3, 4}
    assert back["q"] == collections.deque([1, 2], 5) and back["q"].maxlen == 5
    assert back["rng"][0] == "MT19937" and np.array_equal(back["rng"][1], value["rng"][1])
    assert isinstance(back["assembler"], GroupAssembler) and back["assembler"].num_buffered == 1
    assert isinstance(back["base"], PerPromptBaseline) and back["b"] == b"\x00\x01"


def test_an_unregistered_class_or_an_object_dtype_is_refused():
    with pytest.raises(TypeError):
        safe_records.dumps(Exploit("x"))
    tree = b'{"o":["os.system",{}]}'
    with pytest.raises(safe_records.UnsafeRecordError, match="os.system"):
        safe_records.loads(safe_records.MAGIC + len(tree).to_bytes(4, "little") + tree)
    tree = b'{"a":["|O",[1],0,8]}'
    with pytest.raises(safe_records.UnsafeRecordError, match="dtype"):
        safe_records.loads(safe_records.MAGIC + len(tree).to_bytes(4, "little") + tree +
                           b"\0" * 8)


def test_a_tampered_journal_segment_is_refused_without_running_it(tmp_path, proof):
    root = str(tmp_path / "checkpoints")
    journal = ReaderJournal(journal_dir(root), 0)
    journal.record([rollout(0)])
    journal.close()
    path = segment_path(journal_dir(root), 0)
    payload = pickle.dumps([Exploit(proof)])
    with open(path, "ab") as f:    # a well-framed record (its crc matches) holding a pickle
        f.write(struct.pack("<4sII", b"SAOJ", len(payload), zlib.crc32(payload)) + payload)
    with pytest.raises(OldJournalError, match=r"after_step_000000\.log.*fresh run"):
        ResumePoint(root)


def test_a_tampered_spool_file_is_not_run(tmp_path, proof):
    directory = str(tmp_path / "spool" / "actor_1")
    spool = RolloutSpool(directory)
    seq = spool.put(rollout(0))
    spool.close()
    with open(os.path.join(directory, f"{seq:012d}.rollout"), "wb") as f:
        pickle.dump(Exploit(proof), f)
    spool = RolloutSpool(directory)
    assert spool.load(seq) is None        # unreadable: kept, logged, not sent
    spool.close()


def test_an_old_pickled_spool_is_refused(tmp_path, proof):
    directory = str(tmp_path / "spool" / "actor_1")
    os.makedirs(directory)
    with open(os.path.join(directory, "000000000000.pkl"), "wb") as f:
        pickle.dump(Exploit(proof), f)
    with pytest.raises(RuntimeError, match=r"actor_1.*pickled by an earlier version.*fresh run"):
        RolloutSpool(directory)


def test_a_tampered_learner_state_is_refused_without_running_it(tmp_path, proof):
    path = str(tmp_path / "learner_state.pt")
    state = {"version": 3, "rng": {"numpy": np.random.get_state(), "torch": torch.zeros(2)},
             "samplers": [{"assembler": GroupAssembler(2)}]}
    checkpointing.write_learner_state(state, path)
    back = checkpointing.read_learner_state(path)
    assert back["version"] == 3 and isinstance(back["samplers"][0]["assembler"], GroupAssembler)
    torch.save({"format": checkpointing.STATE_FORMAT, "state": Exploit(proof)}, path)
    with pytest.raises(checkpointing.UnsafeLearnerStateError, match="learner_state.pt"):
        checkpointing.read_learner_state(path)
