"""The multi-turn episode loop (actors/rollout.py): alignment across turns, limits, concurrency
under tool latency, and clear errors for environments that return bad data."""
import threading
import time

import numpy as np
import pytest
import torch

from sao_actor_learner import core
from sao_actor_learner.actors.rollout import EnvironmentError_, run_episodes
from sao_actor_learner.engines import TorchEngine
from sao_actor_learner.models import CharTokenizer, make_tiny_model

TOK = CharTokenizer()
STOP = TOK.token_id("]")


class ScriptedEngine(core.Engine):
    """Emits a scripted turn per call; log-prob of the i-th token of a call is -(i+1)/100 - the
    call index, and every call bumps the version (an in-flight weight update between turns)."""

    def __init__(self, turn_text="ab]"):
        self._version = 0
        self.turn_text = turn_text
        self.calls = []   # per call: the prompt_ids' lengths... and which episodes (by prompt)
        self.lock = threading.Lock()

    @property
    def version(self):
        return self._version

    def load_weights(self, state_dict, version):
        self._version = version

    def generate(self, prompts, params):
        with self.lock:
            call = len(self.calls)
            self.calls.append([tuple(p) for p in prompts])
            out = []
            for p in prompts:
                toks = []
                for ch in self.turn_text:
                    toks.append(TOK.token_id(ch) if ch != "$" else TOK.eos_id)
                    if toks[-1] in params.stop_token_ids or toks[-1] == TOK.eos_id:
                        break
                toks = toks[:params.max_new_tokens]
                out.append(core.Generation(
                    tokens=toks, logprobs=[-(i + 1) / 100 - call for i in range(len(toks))],
                    versions=[self._version] * len(toks), finish_reason="stop"))
            self._version += 1
            return out


class TurnsEnv(core.Environment):
    """Answers each turn with observation "=k\\n" (k = turn number) and reward 0.25; ends after
    `turns` turns with reward 1. `delays[k]` seconds of latency before turn k's answer."""

    def __init__(self, turns=3, delays=None):
        self.turns, self.k, self.delays = turns, 0, delays or {}

    def step(self, action_tokens):
        self.k += 1
        time.sleep(self.delays.get(self.k, 0.0))
        if self.k >= self.turns:
            return core.StepResult([], 1.0, True, {"counters": {"finished": 1}})
        return core.StepResult(TOK.encode(f"={self.k}\n", add_bos=False), 0.25, False,
                               {"counters": {"observations": 1}})


class FakeTask(core.Task):
    name = "fake"
    tokenizer = TOK
    turn_stop_token_ids = (STOP,)

    def __init__(self, env_factory):
        self.env_factory = env_factory

    def sample_prompt(self, rng):
        raise NotImplementedError

    def eval_prompts(self):
        return []

    def make_environment(self, prompt):
        return self.env_factory(prompt)

    def is_correct(self, prompt, completion_tokens):
        return False


def prompts(n, text="1+2="):
    return [core.Prompt(prompt_id=i, token_ids=tuple(TOK.encode(text)), text=text)
            for i in range(n)]


PARAMS = core.SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=(TOK.eos_id,))


@pytest.mark.parametrize("env_threads", [1, 3])
def test_tokens_logprobs_versions_masks_and_rewards_stay_aligned_across_turns(env_threads):
    engine = ScriptedEngine("ab]cd")  # the task's "]" must end each turn after "ab]"
    counters = {}
    rollouts = run_episodes(engine, FakeTask(lambda p: TurnsEnv(3)), prompts(3), PARAMS,
                            actor_id=7, max_turns=5, env_threads=env_threads, counters=counters)
    assert len(rollouts) == 3
    prompt_ids = TOK.encode("1+2=")
    action = TOK.encode("ab]", add_bos=False)
    for r in rollouts:
        assert r.actor_id == 7 and not r.truncated
        # prompt, then (action, observation) x 2, then the final action.
        expected, mask, rewards = list(prompt_ids), [0] * len(prompt_ids), [0.0] * len(prompt_ids)
        turn_starts = []
        for k in range(1, 4):
            turn_starts.append(len(expected))
            expected += action
            mask += [1] * len(action)
            rewards += [0.0] * (len(action) - 1) + [0.25 if k < 3 else 1.0]
            if k < 3:
                obs = TOK.encode(f"={k}\n", add_bos=False)
                expected += obs
                mask += [0] * len(obs)
                rewards += [0.0] * len(obs)
        assert r.tokens.tolist() == expected
        assert r.action_mask.tolist() == mask
        np.testing.assert_allclose(r.rewards, rewards)
        # Each turn came from its own engine call: versions and log-probs say which one.
        versions = r.versions.tolist()
        for k, start in enumerate(turn_starts):
            call_versions = set(versions[start:start + len(action)])
            assert len(call_versions) == 1
            v = call_versions.pop()
            assert v >= k  # turn k cannot come from an earlier call than turn k-1
            np.testing.assert_allclose(r.rollout_logp[start:start + len(action)],
                                       [-(i + 1) / 100 - v for i in range(len(action))], atol=1e-6)
        assert all(v == -1 for v, m in zip(versions, mask) if not m)
        assert all(lp == 0.0 for lp, m in zip(r.rollout_logp.tolist(), mask) if not m)
        vs = [v for v, m in zip(versions, mask) if m]
        assert vs == sorted(vs)
    assert counters["episodes"] == 3 and counters["turns"] == 9
    assert counters["observations"] == 6 and counters["finished"] == 3


def test_real_engine_logprobs_match_a_teacher_forced_forward_across_turns():
    """Log-probs saved turn by turn equal the model's own log-probs of the whole trajectory
    (observation tokens in between), so the learner's ratios start at exactly 1."""
    torch.manual_seed(0)
    model = make_tiny_model("llama", vocab_size=TOK.vocab_size, seed=3)
    engine = TorchEngine(model, eos_token_id=TOK.eos_id, pad_token_id=TOK.pad_id)
    params = core.SamplingParams(max_new_tokens=6, temperature=1.0, seed=0,
                                 stop_token_ids=(TOK.eos_id,))
    rollouts = run_episodes(engine, FakeTask(lambda p: TurnsEnv(3)), prompts(4, "12*34="),
                            params, max_turns=3, env_threads=2)
    for r in rollouts:
        assert (r.action_mask == 0).sum() > len("12*34=") + 1  # observations were appended
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(r.tokens[None], dtype=torch.long)).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        idx = np.flatnonzero(r.action_mask)
        expected = logp[idx - 1, torch.tensor(r.tokens[idx], dtype=torch.long)].numpy()
        np.testing.assert_allclose(r.rollout_logp[idx], expected, atol=1e-4)
        assert set(r.versions[idx].tolist()) == {0}


def test_turn_limit_truncates_and_marks_the_rollout():
    counters = {}
    rollouts = run_episodes(ScriptedEngine("ab]"), FakeTask(lambda p: TurnsEnv(100)), prompts(2),
                            PARAMS, max_turns=4, counters=counters)
    for r in rollouts:
        assert r.truncated == 1
        assert r.num_action_tokens == 4 * 3
        # The last turn's observation was not appended: the rollout ends on an action token.
        assert r.action_mask[-1] == 1
    assert counters["truncated_turns"] == 2


def test_token_limit_cuts_the_turn_and_truncates():
    counters = {}
    limit = len(TOK.encode("1+2=")) + 3 + 3 + 2  # prompt, a turn, its observation, 2 tokens
    rollouts = run_episodes(ScriptedEngine("ab]"), FakeTask(lambda p: TurnsEnv(100)), prompts(2),
                            PARAMS, max_turns=50, max_total_tokens=limit, counters=counters)
    for r in rollouts:
        assert r.truncated == 1 and r.length <= limit
        assert len(r.rollout_logp) == len(r.versions) == r.length
    assert counters["truncated_tokens"] == 2


def test_slow_tool_calls_do_not_serialise_the_batch():
    """One episode's tool call takes 0.6 s; with a thread pool the other episodes finish all
    their turns meanwhile, and the batch takes about one slow call, not the sum of all calls."""
    slow = 0.6

    def env_for(prompt):
        return TurnsEnv(3, delays={1: slow} if prompt.prompt_id == 0 else {1: 0.05, 2: 0.05})

    engine = ScriptedEngine("ab]")
    counters = {}
    t0 = time.monotonic()
    rollouts = run_episodes(engine, FakeTask(env_for), prompts(4), PARAMS, max_turns=3,
                            env_threads=4, counters=counters)
    threaded = time.monotonic() - t0
    fast_done = max(r.end_time for r in rollouts[1:])
    assert fast_done < rollouts[0].end_time - 0.3  # the fast episodes did not wait for it
    # Some engine calls ran without the slow episode (it was still waiting for its tool).
    assert any(len(c) < 4 for c in engine.calls)
    assert counters["env_wait_s"] > 0

    t0 = time.monotonic()
    run_episodes(ScriptedEngine("ab]"), FakeTask(env_for), prompts(4), PARAMS, max_turns=3,
                 env_threads=1)
    inline = time.monotonic() - t0
    assert inline >= slow + 6 * 0.05
    assert threaded < slow + 0.4 and threaded < inline - 0.2


class _BadEnv(core.Environment):
    def __init__(self, result):
        self.result = result

    def step(self, action_tokens):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.mark.parametrize("result, message", [
    ({"observation": [3]}, "_BadEnv.step returned dict"),
    (core.StepResult("=12\n", 0.0, False), "_BadEnv returned observation_tokens that are not"),
    (core.StepResult([3.5], 0.0, False), "_BadEnv returned observation_tokens that are not"),
    (core.StepResult([True], 0.0, False), "_BadEnv returned observation_tokens that are not"),
    (core.StepResult([10_000], 0.0, False), "_BadEnv returned observation token ids [10000]"),
    (core.StepResult([3], float("nan"), False), "_BadEnv returned reward=nan"),
    (core.StepResult([3], 0.0, False, {"counters": {"x": "many"}}), "_BadEnv returned info"),
])
@pytest.mark.parametrize("env_threads", [1, 2])
def test_an_environment_returning_non_token_data_gets_an_error_naming_it(result, message,
                                                                         env_threads):
    with pytest.raises(EnvironmentError_) as e:
        run_episodes(ScriptedEngine(), FakeTask(lambda p: _BadEnv(result)), prompts(2), PARAMS,
                     max_turns=3, env_threads=env_threads)
    assert message in str(e.value)


def test_an_environment_that_raises_is_named():
    with pytest.raises(RuntimeError, match=r"environment _BadEnv.step raised on prompt 0"):
        run_episodes(ScriptedEngine(), FakeTask(lambda p: _BadEnv(KeyError("boom"))), prompts(1),
                     PARAMS, max_turns=3, env_threads=2)


def test_bad_limits_are_rejected():
    with pytest.raises(ValueError, match="max_turns=0"):
        run_episodes(ScriptedEngine(), FakeTask(lambda p: TurnsEnv()), prompts(1), PARAMS,
                     max_turns=0)
    with pytest.raises(ValueError, match="env_threads=0"):
        run_episodes(ScriptedEngine(), FakeTask(lambda p: TurnsEnv()), prompts(1), PARAMS,
                     env_threads=0)
