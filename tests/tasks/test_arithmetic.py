"""ArithmeticTask: prompts, rewards, the held-out split and the imperfect teacher."""
import os
import subprocess
import sys

import numpy as np
import pytest

from sao_actor_learner import core
from sao_actor_learner.models import CharTokenizer
from sao_actor_learner.tasks import ArithmeticTask, make_task
from sao_actor_learner.tasks.arithmetic import EVAL_ID_BASE, has_carry, no_carry_sum

TOK = CharTokenizer()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def answer_tokens(text, eos=True):
    return TOK.encode(text, add_bos=False) + ([TOK.eos_id] if eos else [])


def test_prompt_format_and_ids():
    task = make_task("arithmetic", seed=0)
    assert isinstance(task, core.Task) and task.name == "arithmetic"
    rng = np.random.default_rng(0)
    ps = [task.sample_prompt(rng) for _ in range(50)]
    assert [p.prompt_id for p in ps] == list(range(50))
    for p in ps:
        a, b = map(int, p.text[:-1].split("+"))
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert p.text == f"{a}+{b}=" and p.answer == str(a + b)
        assert list(p.token_ids) == TOK.encode(p.text) and p.token_ids[0] == TOK.bos_id
    strided = ArithmeticTask(seed=0, prompt_id_offset=1, prompt_id_stride=3)
    assert [strided.sample_prompt(rng).prompt_id for _ in range(3)] == [1, 4, 7]
    with pytest.raises(ValueError, match="task='nope'"):
        make_task("nope", 0)


def test_rewards():
    task = ArithmeticTask(seed=0)
    prompt = task.make_prompt(37, 45, prompt_id=0)
    cases = [
        (answer_tokens("82"), 1.0),
        (answer_tokens("82") + answer_tokens("999"), 1.0),  # everything after <eos> is ignored
        (answer_tokens("82", eos=False), 1.0),             # truncated before <eos>: judged as is
        (answer_tokens("72"), 0.0),
        (answer_tokens("820"), 0.0),
        (answer_tokens(" 82"), 0.0),
        ([TOK.eos_id], 0.0),
        ([], 0.0),
    ]
    for tokens, reward in cases:
        env = task.make_environment(prompt)
        result = env.step(tokens)
        assert (result.reward, result.done, result.observation_tokens) == (reward, True, []), tokens
        assert result.info["correct"] == (reward == 1.0)
        assert task.is_correct(prompt, tokens) == (reward == 1.0)
        with pytest.raises(RuntimeError, match="single-turn"):
            env.step(tokens)


def test_eval_prompts_are_fixed_and_disjoint_from_training():
    task = ArithmeticTask(seed=3, num_eval=200)
    evals = task.eval_prompts()
    assert len(evals) == 200
    assert [p.text for p in evals] == [p.text for p in ArithmeticTask(seed=3).eval_prompts()]
    assert [p.text for p in evals] != [p.text for p in ArithmeticTask(seed=4).eval_prompts()]
    assert len({p.text for p in evals}) == 200
    assert all(p.prompt_id >= EVAL_ID_BASE for p in evals)
    eval_texts = {p.text for p in evals}
    rng = np.random.default_rng(0)
    train_texts = {task.sample_prompt(rng).text for _ in range(5000)}
    assert not train_texts & eval_texts
    assert len(train_texts) > 2500  # the training split is large (90% of 8100 pairs)
    # The split is a property of the pair: every eval pair is held out, training pairs are not.
    assert all(task.is_held_out(*map(int, t[:-1].split("+"))) for t in eval_texts)
    assert not any(task.is_held_out(*map(int, t[:-1].split("+"))) for t in train_texts)
    with pytest.raises(ValueError, match="num_eval=5000"):
        ArithmeticTask(num_eval=5000)


def test_no_carry_sum():
    assert no_carry_sum(37, 45) == 72
    assert no_carry_sum(95, 17) == 2
    assert no_carry_sum(12, 34) == 46
    assert no_carry_sum(5, 7) == 2
    assert has_carry(37, 45) and has_carry(95, 14) and not has_carry(12, 34)


def test_demonstration_noise_rate():
    task = ArithmeticTask(seed=0, carry_noise=0.3)
    rng = np.random.default_rng(1)
    wrong_carry = wrong_plain = n_carry = n_plain = 0
    for _ in range(4000):
        a, b = task.sample_operands(rng)
        demo = task.demonstration(a, b, rng)
        assert demo in (str(a + b), str(no_carry_sum(a, b)))
        if has_carry(a, b):
            n_carry += 1
            wrong_carry += demo != str(a + b)
        else:
            n_plain += 1
            wrong_plain += demo != str(a + b)
    assert wrong_plain == 0                      # problems without carries are always right
    assert abs(wrong_carry / n_carry - 0.3) < 0.03
    prompt, answer = task.demonstration_tokens(12, 34, rng)
    assert prompt == TOK.encode("12+34=") and answer == answer_tokens("46")
    assert ArithmeticTask(carry_noise=0.0).demonstration(37, 45, rng) == "82"
    assert ArithmeticTask(carry_noise=1.0).demonstration(37, 45, rng) == "72"
    with pytest.raises(ValueError, match="carry_noise=1.5"):
        ArithmeticTask(carry_noise=1.5)


def test_sft_smoke(tmp_path):
    """A few steps of programs/sft.py write a loadable checkpoint and warm_start.json."""
    out = tmp_path / "ws"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, os.path.join(ROOT, "programs", "sft.py"), f"--out_dir={out}",
                    "--steps=3", "--batch_size=8", "--num_eval=8", "--eval_samples=2"],
                   check=True, cwd=ROOT, env=env, capture_output=True, timeout=120)
    import json
    record = json.loads((out / "warm_start.json").read_text())
    for key in ("greedy_accuracy", "sampled_accuracy", "sampled_accuracy_on_greedy_wrong",
                "settings"):
        assert key in record
    from sao_actor_learner.engines import TorchEngine
    engine = TorchEngine.from_checkpoint(str(out))
    assert engine.generate([TOK.encode("1+2=")], core.SamplingParams(max_new_tokens=2))
