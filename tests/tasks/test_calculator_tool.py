"""The calculator-tool task: the calculator, tool-call parsing, latency, the four bad inputs as
error observations with counters, the task split and teacher, the learner on real tool
episodes (zero advantage and gradient off actions; skip-observation GAE == plain GAE on the
action-only subsequence), the config defaults, the SFT warm start and the whole program."""
import json
import os
import subprocess
import sys
import time

if "triton" not in sys.modules:  # the Triton interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch

from sao_actor_learner import core
from sao_actor_learner.actors.rollout import run_episodes
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.learner import advantages as adv_lib
from sao_actor_learner.learner import losses
from sao_actor_learner.builder import assemble_learner
from sao_actor_learner.models import CharTokenizer, make_tiny_model
from sao_actor_learner.models.value import ValueModel
from sao_actor_learner.tasks import make_task, tools
from sao_actor_learner.tasks.calculator_tool import CalculatorToolTask
from sao_actor_learner.types import collate

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOK = CharTokenizer()


# --- the calculator -----------------------------------------------------------------------------------
def test_calculator_matches_python_arithmetic_on_random_expressions():
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 5))
        parts = []
        for i in range(n):
            num = str(int(rng.integers(0, 10 ** int(rng.integers(1, 6)))))
            if rng.random() < 0.2:
                num = "-" + num
            parts.append(num)
            if i < n - 1:
                parts.append(str(rng.choice(["+", "-", "*"])))
        expr = "".join(parts)
        assert tools.calculator(expr) == str(eval(expr)), expr  # noqa: S307 - our own digits


@pytest.mark.parametrize("expr", ["", "12**3", "7+", "+", "1a", "3---4", "(1+2)", "1 + 2",
                                  "1" * 31])
def test_calculator_raises_tool_input_error_on_bad_expressions(expr):
    with pytest.raises(tools.ToolInputError):
        tools.calculator(expr)


def test_parse_tool_call():
    assert tools.parse_tool_call("[12*34]") == "12*34"
    assert tools.parse_tool_call("408") is None  # an answer, not a call
    for bad in ("[12*34", "[]", "[", "[1[2]", "[1]2]"):
        with pytest.raises(tools.MalformedToolCall):
            tools.parse_tool_call(bad)


# --- latency ------------------------------------------------------------------------------------------
def test_latency_distributions_have_their_stated_shape():
    rng = np.random.default_rng(0)
    n = 40_000

    def draw(spec):
        dist = tools.parse_latency(spec)
        return np.array([dist.sample(rng) for _ in range(n)]), dist

    x, d = draw("none")
    assert (x == 0).all() and d.mean == 0
    x, d = draw("constant:0.25")
    assert (x == 0.25).all()
    x, d = draw("uniform:0.1,0.3")
    assert x.min() >= 0.1 and x.max() <= 0.3 and abs(x.mean() - d.mean) < 0.005
    x, d = draw("exponential:0.05")
    assert abs(x.mean() - 0.05) < 0.002
    x, d = draw("lognormal:0.02,1.0")
    assert abs(np.median(x) - 0.02) < 0.001 and abs(x.mean() - d.mean) / d.mean < 0.05
    # Pareto with minimum SCALE and tail index ALPHA: P(X > x) = (SCALE / x) ** ALPHA.
    x, d = draw("pareto:0.01,1.5")
    assert x.min() >= 0.01
    for mult in (3, 10, 30):
        expected = mult ** -1.5
        assert abs((x > 0.01 * mult).mean() - expected) < 4 * np.sqrt(expected / n) + 1e-3
    # Heavier tail than a lognormal of the same median.
    ln, _ = draw(f"lognormal:{np.median(x)},1.0")
    assert (x > 30 * np.median(x)).mean() > 5 * (ln > 30 * np.median(x)).mean()


@pytest.mark.parametrize("spec, message", [
    ("gauss:1", "unknown kind 'gauss'"),
    ("pareto:1", "pareto takes 2 parameter(s), got 1"),
    ("uniform:2,1", "uniform needs LO <= HI"),
    ("lognormal:0,1", "lognormal needs a first parameter > 0"),
    ("exponential:x", "parameters must be numbers"),
    ("constant:-1", "finite and >= 0"),
    ("pareto:0.01,0", "ALPHA > 0"),
])
def test_bad_latency_specs_are_refused_with_the_forms_to_use(spec, message):
    with pytest.raises(ValueError) as e:
        tools.parse_latency(spec)
    assert message in str(e.value) and spec in str(e.value)


# --- the four bad inputs --------------------------------------------------------------------------------
def _raising_tool(argument):
    raise RuntimeError("the tool broke")


def _hanging_tool(argument):
    time.sleep(5.0)
    return "1"


def test_each_bad_tool_call_becomes_an_error_observation():
    slept = []
    runner = tools.ToolRunner(tools.calculator, tools.parse_latency("none"), timeout_s=1.0,
                              max_result_chars=12, sleep=slept.append)
    rng = np.random.default_rng(0)
    ok = runner.run("[12*34]", rng)
    assert (ok.observation, ok.error, ok.result) == ("=408\n", None, "408")
    assert ok.counters()["tool_ok"] == 1
    cases = {
        "malformed": (runner, "[12*34"),
        "raised": (tools.ToolRunner(_raising_tool, tools.parse_latency("none")), "[1+1]"),
        "too_large": (runner, "[99999999*99999999]"),
        "timeout": (tools.ToolRunner(tools.calculator, tools.parse_latency("constant:2.0"),
                                     timeout_s=1.0, sleep=slept.append), "[1+1]"),
    }
    for error, (r, text) in cases.items():
        out = r.run(text, rng)
        assert out.error == error
        assert out.observation == f"=error:{tools.ERROR_REASONS[error]}\n"
        assert out.counters() == {"tool_calls": 1, f"tool_errors_{error}": 1,
                                  "tool_latency_s": out.latency_s}
        TOK.encode(out.observation, add_bos=False)  # the model can read every error
    assert slept[-1] == 1.0  # a 2 s delay past a 1 s timeout waits 1 s, not 2


def test_a_hanging_tool_times_out_in_time():
    runner = tools.ToolRunner(_hanging_tool, tools.parse_latency("none"), timeout_s=0.2)
    t0 = time.monotonic()
    out = runner.run("[1+1]", np.random.default_rng(0))
    assert out.error == "timeout" and time.monotonic() - t0 < 1.5


def _step(env, text):
    ids = TOK.encode(text.replace("$", ""), add_bos=False) + ([TOK.eos_id] if "$" in text else [])
    return env.step(ids)


@pytest.mark.parametrize("kwargs, call, error", [
    ({}, "[4821+", "malformed"),                       # cut off before "]"
    ({}, "[48$", "malformed"),                         # <eos> inside the call
    ({}, "[4821++3967]", "raised"),                    # the calculator raises
    ({"tool": _raising_tool}, "[4821+3967]", "raised"),
    ({"tool": lambda a: "résumé"}, "[4821+3967]", "raised"),  # characters the model can't read
    ({"max_result_chars": 3}, "[4821+3967]", "too_large"),
    ({"tool_latency": "constant:0.3", "tool_timeout_s": 0.1}, "[4821+3967]", "timeout"),
    ({"tool": _hanging_tool, "tool_timeout_s": 0.1}, "[4821+3967]", "timeout"),
])
def test_environment_turns_bad_calls_into_observations_and_counters(kwargs, call, error):
    task = CalculatorToolTask(seed=0, num_eval=4, **kwargs)
    prompt = task.make_prompt("sum", 4821, 3967, 5)
    env = task.make_environment(prompt)
    result = _step(env, call)
    assert not result.done and result.reward == 0.0
    assert TOK.decode(result.observation_tokens) == f"=error:{tools.ERROR_REASONS[error]}\n"
    assert result.info["counters"][f"tool_errors_{error}"] == 1
    # The episode goes on: (with the plain calculator) a good call, then the right answer.
    if not kwargs:
        assert TOK.decode(_step(env, "[4821+3967]").observation_tokens) == "=8788\n"
    final = _step(env, "8788$")
    assert final.done and final.reward == 1.0


def test_environment_scores_final_answers():
    task = CalculatorToolTask(seed=0, num_eval=4)
    p = task.make_prompt("product", 37, 48, 1)
    env = task.make_environment(p)
    assert TOK.decode(_step(env, "[37*48]").observation_tokens) == "=1776\n"
    assert _step(env, "1776$").reward == 1.0
    for wrong in ("1766$", "177", "1776]"):  # wrong digits, no <eos> and cut short, stray "]"
        r = _step(task.make_environment(p), wrong)
        assert r.done and r.reward == 0.0
    assert _step(task.make_environment(p), "1776$").reward == 1.0  # right in its head: fine
    with pytest.raises(RuntimeError, match="episode is over"):
        _step(env, "1$")


# --- the task --------------------------------------------------------------------------------------------
def test_split_prompts_and_answers():
    task = make_task("calculator_tool", seed=3, num_eval=40)
    evals = task.eval_prompts()
    assert len(evals) == 40 and len({p.text for p in evals}) == 40
    assert sum(task.kind_of(p) == "sum" for p in evals) == 20
    rng = np.random.default_rng(0)
    eval_texts = {p.text for p in evals}
    for _ in range(3000):
        kind, a, b = task.sample_problem(rng)
        assert not task.is_held_out(kind, a, b)
        assert task.expression(kind, a, b) + "=" not in eval_texts
    for p in evals:
        kind = task.kind_of(p)
        a, b = map(int, p.text[:-1].replace("*", "+").split("+"))
        assert task.is_held_out(kind, a, b)
        assert p.answer == str(a + b if kind == "sum" else a * b)
        assert list(p.token_ids) == TOK.encode(p.text)
    ids = [task.sample_prompt(rng).prompt_id for _ in range(5)]
    assert ids == sorted(set(ids))
    assert task.turn_stop_token_ids == (TOK.token_id("]"),)


def test_demonstrations_train_only_on_actions_and_are_imperfect():
    task = CalculatorToolTask(seed=0, num_eval=4)
    rng = np.random.default_rng(1)
    tool_use = {"sum": [], "product": []}
    slips = 0
    for _ in range(600):
        ids, mask = task.demonstration(rng)
        text = TOK.decode(ids, skip_special=False)
        prompt_len = text.index("=") + 1 - len("<bos>") + 1
        assert mask[:prompt_len] == [0] * prompt_len
        assert ids[-1] == TOK.eos_id and mask[-1] == 1
        kind = "product" if "*" in text.split("=")[0] else "sum"
        tool_use[kind].append("[" in text)
        # Observations (mask 0) are exactly the tool's answers to the calls before them.
        segments, cur, cur_mask = [], [], None
        for t, m in zip(ids[prompt_len:], mask[prompt_len:]):
            if m != cur_mask and cur:
                segments.append((TOK.decode(cur, skip_special=False), cur_mask))
                cur = []
            cur.append(t)
            cur_mask = m
        segments.append((TOK.decode(cur, skip_special=False), cur_mask))
        for (call, m1), (obs, m0) in zip(segments, segments[1:]):
            if m1 == 1 and m0 == 0:
                assert call.startswith("[") and call.endswith("]")
                expected = task.tool_runner.run(call, np.random.default_rng(0)).observation
                assert obs == expected
        if "[" in text:
            final = segments[-1][0][:-len("<eos>")]
            answer = str(eval(text.split("=")[0][len("<bos>"):]))  # noqa: S307
            slips += final != answer
    assert 0.2 < np.mean(tool_use["sum"]) < 0.4
    assert 0.7 < np.mean(tool_use["product"]) < 0.9
    assert slips > 0


# --- the learner on real tool episodes -----------------------------------------------------------------
class OracleEngine(core.Engine):
    """A scripted agent: calls the calculator (first with a broken call "[EXPR+]" when the
    expression ends in an odd digit), copies the result and ends with <eos>; retries a call
    that got an error. Log-probs are placeholders."""

    def __init__(self):
        self._version = 0

    @property
    def version(self):
        return self._version

    def load_weights(self, state_dict, version):
        self._version = version

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = TOK.decode(p)
            expr, _, rest = text.partition("=")
            if not rest:
                turn = f"[{expr}+]" if int(expr[-1]) % 2 else f"[{expr}]"
            else:
                obs = rest.rsplit("]", 1)[1].strip("=\n")
                turn = f"[{expr}]" if obs.startswith("error") else obs + "$"
            ids = TOK.encode(turn.replace("$", ""), add_bos=False) + \
                ([TOK.eos_id] if turn.endswith("$") else [])
            out.append(core.Generation(ids, [-0.5] * len(ids), [self._version] * len(ids),
                                       "stop"))
        self._version += 1
        return out


def tool_rollouts(task, n=6):
    rng = np.random.default_rng(0)
    prompts = [task.sample_prompt(rng) for _ in range(n)]
    counters = {}
    params = core.SamplingParams(max_new_tokens=16, stop_token_ids=(TOK.eos_id,))
    rollouts = run_episodes(OracleEngine(), task, prompts, params, max_turns=4,
                            max_total_tokens=96, env_threads=3, counters=counters)
    return rollouts, counters, prompts


def test_oracle_agent_solves_tool_episodes_and_errors_are_counted():
    task = CalculatorToolTask(seed=0, num_eval=4, tool_latency="exponential:0.01")
    rollouts, counters, prompts = tool_rollouts(task, n=8)
    assert all(r.total_reward == 1.0 and not r.truncated for r in rollouts)
    broken = sum(int(p.text[-2]) % 2 for p in prompts)
    assert 0 < broken < 8
    assert counters["tool_errors_raised"] == broken
    assert counters["tool_calls"] == counters["tool_ok"] + broken == 8 + broken
    for r, p in zip(rollouts, prompts):  # 2 or 3 turns, each observation masked out
        text = TOK.decode(r.tokens)
        assert text.endswith(p.answer) and text.count("[") == 2 + int(p.text[-2]) % 2 - 1
        obs_text = TOK.decode(r.tokens[(r.action_mask == 0) & (np.arange(r.length) >= len(p.token_ids))])
        assert obs_text.endswith(f"={p.answer}\n")
    assert counters["answers_correct"] == 8


def _learner(policy, gae="skip_observation"):
    config = SAOConfig(task="calculator_tool", batch_size=6, actor_batch=6, max_steps=5,
                       init_checkpoint="x", gae=gae)
    critic = ValueModel.from_policy(policy)
    critic.freeze(config.critic_frozen_patterns)
    return assemble_learner(config, policy, critic, pad_id=TOK.pad_id)


def test_skip_observation_gae_equals_plain_gae_on_the_action_only_subsequence():
    task = CalculatorToolTask(seed=0, num_eval=4)
    rollouts, _, _ = tool_rollouts(task)
    batch = collate(rollouts, TOK.pad_id)
    assert ((batch.action_mask == 0) & (batch.attention_mask == 1)).sum() > 0
    learner = _learner(make_tiny_model("llama", vocab_size=TOK.vocab_size, seed=1))
    with torch.no_grad():
        values = learner.estimator.critic.values_for_tokens(batch.tokens,
                                                            batch.attention_mask).double()
    mask = batch.action_mask.bool()
    lam = adv_lib.length_adaptive_lambda(mask.sum(1), 1.5).double()
    A, R = adv_lib.skip_observation_gae(batch.rewards.double(), values, mask, 1.0, lam)
    A_std, _ = adv_lib.token_level_gae(batch.rewards.double(), values, mask, 1.0, lam)
    for b in range(batch.size):
        idx = torch.nonzero(mask[b])[:, 0]
        sub = torch.ones(1, len(idx), dtype=torch.bool)
        A_sub, R_sub = adv_lib.token_level_gae(batch.rewards[b, idx][None].double(),
                                               values[b, idx][None], sub, 1.0, lam[b:b + 1])
        torch.testing.assert_close(A[b, idx], A_sub[0])
        torch.testing.assert_close(R[b, idx], R_sub[0])
    # The ablation is a different estimator on these trajectories (it bootstraps through the
    # values the critic gives observation tokens).
    assert not torch.allclose(A, A_std)


@pytest.mark.parametrize("gae", ["skip_observation", "standard"])
def test_observation_and_prompt_tokens_get_zero_advantage_and_zero_gradient(gae):
    task = CalculatorToolTask(seed=0, num_eval=4)
    rollouts, _, _ = tool_rollouts(task)
    policy = make_tiny_model("llama", vocab_size=TOK.vocab_size, seed=2)
    learner = _learner(policy, gae)
    batch = collate(rollouts, TOK.pad_id)
    with torch.no_grad():  # on-policy log-probs, so every action token is inside the DIS band
        batch.rollout_logp = learner.policy_trainer.logprobs(batch) * batch.action_mask
    est = learner.estimator.estimate(batch)
    off = batch.action_mask == 0
    assert (est.advantages[off] == 0).all() and (est.returns[off] == 0).all()
    assert (est.advantages[~off] != 0).any()
    logp = learner.policy_trainer.logprobs(batch)
    logp.retain_grad()
    loss, stats = losses.dis_policy_loss(logp, batch.rollout_logp, est.advantages,
                                         batch.action_mask, 0.3, 5.0)
    loss.backward()
    assert stats["masked_frac"] == 0.0
    assert (logp.grad[off] == 0).all()          # no gradient through prompt/observation tokens
    assert (logp.grad[~off] != 0).float().mean() > 0.9
    # Nor through the logits that predict them: perturbing an observation token's logit row
    # leaves the loss unchanged.
    logits = policy(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits
    logits.retain_grad()
    lp = losses.token_logprobs(logits, batch.tokens, 1.0)
    loss2, _ = losses.dis_policy_loss(lp, batch.rollout_logp, est.advantages,
                                      batch.action_mask, 0.3, 5.0)
    loss2.backward()
    predicts_off = off[:, 1:]  # logits[:, t-1] predict token t
    assert (logits.grad[:, :-1][predicts_off] == 0).all()


# --- config and programs ---------------------------------------------------------------------------------
def test_config_defaults_per_task():
    arith = SAOConfig()
    assert (arith.init_checkpoint, arith.max_sequence_length, arith.max_new_tokens,
            arith.max_turns, arith.env_threads) == ("checkpoints/warm_start", 64, 8, 1, 1)
    calc = SAOConfig(task="calculator_tool", actor_batch=6)
    assert (calc.init_checkpoint, calc.max_sequence_length, calc.max_new_tokens,
            calc.max_turns, calc.env_threads) == ("checkpoints/warm_start_calculator_tool", 96,
                                                  16, 4, 6)
    explicit = SAOConfig(task="calculator_tool", max_turns=2, max_sequence_length=120)
    assert (explicit.max_turns, explicit.max_sequence_length) == (2, 120)
    assert SAOConfig.from_json(calc.to_json()) == calc
    for kwargs, message in [({"tool_latency": "pareto:1"}, "tool_latency='pareto:1'"),
                            ({"tool_timeout_s": 0.0}, "tool_timeout_s=0.0"),
                            ({"max_turns": -2}, "max_turns=-2"),
                            ({"max_new_tokens": 96}, "max_new_tokens=96 >= max_sequence_length")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
            SAOConfig(task="calculator_tool", **kwargs)


def test_sao_without_the_calculator_warm_start_names_the_sft_command(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "programs", "sao.py"), "--task=calculator_tool",
         f"--init_checkpoint={tmp_path / 'missing'}", f"--run_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0
    assert "programs/sft.py --task=calculator_tool" in proc.stderr + proc.stdout
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def quick_calculator_warm_start(tmp_path_factory):
    """A short programs/sft.py --task=calculator_tool run (100 steps of 32: it has learned the
    call format, not yet to copy digits); the real warm start trains 2000 steps of 64."""
    out = tmp_path_factory.mktemp("calc_warm_start")
    subprocess.run([sys.executable, os.path.join(REPO, "programs", "sft.py"),
                    "--task=calculator_tool", f"--out_dir={out}", "--steps=100",
                    "--batch_size=32", "--num_eval=6",
                    "--eval_samples=2", "--log_every=60"], check=True, cwd=REPO,
                   capture_output=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out


def test_sft_warm_start_for_the_calculator_task(quick_calculator_warm_start):
    out = quick_calculator_warm_start
    record = json.loads((out / "warm_start.json").read_text())
    for key in ("greedy_accuracy", "greedy_tool_use_sum", "sampled_accuracy_product",
                "pass_at_2_on_greedy_wrong"):
        assert key in record
    assert record["settings"]["task"] == "calculator_tool"
    assert record["settings"]["guess_prob"] == {"sum": 0.7, "product": 0.2}
    assert (out / "config.json").exists()


def test_the_whole_program_trains_on_tool_episodes(quick_calculator_warm_start, tmp_path):
    """Real Reverb, real gRPC, threads in one process (local_mt keeps the test short)."""
    from sao_actor_learner.builder import make_program
    from sao_actor_learner.observers import read_metrics
    from sao_actor_learner.run import run_program

    config = SAOConfig(task="calculator_tool", init_checkpoint=str(quick_calculator_warm_start),
                       run_dir=str(tmp_path / "run"), max_steps=3, batch_size=8, num_actors=2,
                       actor_batch=4, max_staleness=2, eval_every=0, eval_size=10,
                       tool_latency="pareto:0.005,1.2", tool_timeout_s=0.2, launch="local_mt")
    summary = run_program(config, make_program, progress=False)
    assert summary["steps"] == 3 and summary["rollouts_trained"] == 24
    assert summary["initial_eval_accuracy"] is not None
    assert summary["final_eval_accuracy"] is not None
    env = summary["env_counters"]
    assert env["tool_calls"] > 0 and env["episodes"] >= 24
    assert env["turns"] > env["episodes"]  # multi-turn episodes happened
    assert env["tool_calls"] == sum(v for k, v in env.items()
                                    if k == "tool_ok" or k.startswith("tool_errors_"))
    with open(os.path.join(config.run_dir, "actor_0_stats.json")) as f:
        assert json.load(f)["env_counters"]["episodes"] > 0
    train = read_metrics(config.run_dir, "train")
    # Trained rollouts are longer than one turn: prompt + call + observation + answer.
    assert max(r["response_length_mean"] for r in train) > 8
