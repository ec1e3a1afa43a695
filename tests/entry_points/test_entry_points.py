"""The entry points: `python -m sao_actor_learner` (= `sao-train` = programs/sao.py) answers
--help with its flags and exit 0, and refuses an invalid value before launching anything; the
one study entry point (programs/study.py) refuses flags its preset would ignore."""
import os
import re
import subprocess
import sys

import pytest

from experiments import sweep_presets
from sao_actor_learner.__main__ import asks_for_help

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def python(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO,
                          env=ENV, timeout=120)


def test_module_help_exits_0_and_names_the_flags():
    proc = python("-m", "sao_actor_learner", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--max_staleness", "--run_dir", "--num_actors", "--[no]progress", "--auth_token"):
        assert flag in proc.stdout


def test_help_lists_the_key_flags_by_section_and_helpfull_all():
    from sao_actor_learner.flags import KEY_FLAGS
    proc = python(os.path.join("programs", "sao.py"), "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    headers = [out.index(f"\n{section}:\n") for section, _ in KEY_FLAGS]
    assert [s for s, _ in KEY_FLAGS] == ["run", "task", "algorithm", "staleness", "engine",
                                         "launch"]
    assert headers == sorted(headers)   # in that order
    for (section, names), start, end in zip(KEY_FLAGS, headers, headers[1:] + [len(out)]):
        for name in names:   # each under its section, with its default
            assert re.search(rf"--(\[no\])?{name} \(default: ", out[start:end]), name
    assert "--helpfull" in out and "--vllm_kv_cache_gb" not in out   # not a key flag
    full = python(os.path.join("programs", "sao.py"), "--helpfull")
    assert full.returncode == 0 and "--vllm_kv_cache_gb" in full.stdout


@pytest.mark.parametrize("args, cause, not_said", [
    (["--algorithm=grpo", "--group_size=4", "--batch_size=2"],
     "batch_size=2 is not a multiple of group_size=4", "queue capacity"),
    (["--model=models/does-not-exist"],
     "--model='models/does-not-exist': no such directory", "looks like a hub id"),
])
def test_errors_report_their_root_cause_first(tmp_path, args, cause, not_said):
    proc = python("-m", "sao_actor_learner", f"--run_dir={tmp_path / 'run'}", *args)
    assert proc.returncode == 1
    assert f"invalid configuration: {cause}" in proc.stderr, proc.stderr[-2000:]
    assert not_said not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_invalid_value_fails_before_launch_with_a_clear_message(tmp_path):
    run_dir = tmp_path / "run"
    proc = python("-m", "sao_actor_learner", "--num_actors=0", f"--run_dir={run_dir}")
    assert proc.returncode == 1
    assert "invalid configuration: num_actors=0: must be >= 1" in proc.stderr
    assert not run_dir.exists()   # nothing launched, no run folder prepared


def test_asks_for_help():
    assert asks_for_help(["--help"]) and asks_for_help(["-h"]) and asks_for_help(["--helpfull"])
    assert asks_for_help(["--task=arithmetic", "-helpshort"])
    assert not asks_for_help(["--task=arithmetic"])
    assert not asks_for_help(["--", "--help"])       # after "--": the program's arguments
    assert not asks_for_help(["--helpers=3"])


def test_refused_flags_per_preset():
    staleness = sweep_presets.SWEEPS["staleness_sweep"]
    shift = sweep_presets.SWEEPS["online_shift_sweep"]
    vp = sweep_presets.SWEEPS["value_pretrain_sweep"]
    assert sweep_presets.refused_flags(staleness, ["methods", "size", "seeds", "lr"]) == []
    assert sweep_presets.refused_flags(staleness, ["workers", "window", "max_staleness"]) == [
        "max_staleness", "window", "workers"]
    assert sweep_presets.refused_flags(shift, ["task", "window", "max_staleness"]) == ["task"]
    assert sweep_presets.refused_flags(vp, ["value_pretrain_rollouts", "shape"]) == [
        "value_pretrain_rollouts"]
    assert sweep_presets.refused_flags(None, ["size", "max_staleness", "workers", "seeds"]) == [
        "max_staleness", "size"]


@pytest.mark.parametrize("args, message", [
    (["--preset=staleness_sweep", "--workers=2"], "the staleness_sweep preset does not take "
                                                  "--workers"),
    (["--preset=asynchrony", "--methods=sao"], "a study does not take --methods"),
    (["--preset=staleness_sweep,asynchrony"], "preset='staleness_sweep' is a sweep: it runs "
                                              "alone"),
])
def test_study_refuses_what_its_preset_would_ignore(tmp_path, args, message):
    proc = python(os.path.join("programs", "study.py"), f"--out_dir={tmp_path}", *args)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("preset", ["smoke", "staleness_sweep"])
@pytest.mark.parametrize("same", ["equal", "another_spelling"])
def test_study_refuses_results_dir_equal_to_out_dir_before_running(tmp_path, preset, same):
    out = tmp_path / "study"
    results = out if same == "equal" else tmp_path / "x" / ".." / "study"
    proc = python(os.path.join("programs", "study.py"), f"--preset={preset}", f"--out_dir={out}",
                  f"--results_dir={results}", "--noprogress")
    assert proc.returncode == 1
    assert "is the same folder as --out_dir" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()   # nothing ran
