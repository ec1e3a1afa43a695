"""Dataset files, prompt rendering and the dataset task (tasks/dataset*.py), offline."""
import json
import os

import numpy as np
import pytest

import hf_fixtures as fx
from sao_actor_learner.models import CharTokenizer, HFTokenizer
from sao_actor_learner.rewards import RewardResult, make_reward
from sao_actor_learner.tasks.dataset import DatasetTask, PromptRenderer
from sao_actor_learner.tasks.dataset_files import DatasetError, read_dataset, read_rows

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return fx.tiny_qwen3(str(tmp_path_factory.mktemp("tiny_qwen3")))


@pytest.fixture(scope="module")
def tok(model_dir):
    return HFTokenizer.from_pretrained(model_dir)


@pytest.fixture
def files(tmp_path):
    train = fx.write_parquet(str(tmp_path / "train.parquet"), fx.gsm_rows(40))
    test = fx.write_jsonl(str(tmp_path / "test.jsonl"), fx.gsm_rows(10, start=1000))
    return train, test


def make_task(tok, files, **kw):
    return DatasetTask(tok, [files[0]], [files[1]], make_reward("gsm8k"), **kw)


# --- files ------------------------------------------------------------------------------------
def test_parquet_and_jsonl_give_the_same_rows(tmp_path):
    rows = fx.gsm_rows(7)
    a = read_dataset([fx.write_parquet(str(tmp_path / "a.parquet"), rows)])
    b = read_dataset([fx.write_jsonl(str(tmp_path / "a.jsonl"), rows)])
    strip = lambda rs: [(r.prompt, r.ground_truth, r.data_source, r.extra_info, r.index)
                        for r in rs]
    assert strip(a) == strip(b)
    assert a[3].ground_truth == "9" and a[3].prompt[0]["role"] == "user"
    assert a[3].extra_info == {"index": 3} and a[3].data_source == "test/gsm"


def test_simple_schema_with_key_mapping_and_gsm8k_answers(tmp_path):
    path = fx.write_jsonl(str(tmp_path / "gsm.jsonl"), [
        {"question": "Tom has 3 and gets 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "Pay 1,200 twice?", "answer": 2400}])
    rows = read_dataset([path], prompt_key="question", answer_key="answer")
    assert rows[0].prompt == "Tom has 3 and gets 4. How many?" and rows[1].ground_truth == "2400"
    reward = make_reward("gsm8k")
    assert reward("", "so 3 + 4 = 7.\n#### 7", rows[0].ground_truth, {}).score == 1.0
    assert reward("", "#### 8", rows[0].ground_truth, {}).score == 0.0
    assert reward("", "#### 2,400", rows[1].ground_truth, {}).score == 1.0


@pytest.mark.parametrize("row,field,words", [
    ({"reward_model": {"ground_truth": "1"}}, "prompt", "--prompt_key"),
    ({"prompt": "", "reward_model": {"ground_truth": "1"}}, "prompt", "empty string"),
    ({"prompt": [], "reward_model": {"ground_truth": "1"}}, "prompt", "empty list"),
    ({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}}, "prompt", "'content'"),
    ({"prompt": [{"role": "robot", "content": "x"}], "reward_model": {"ground_truth": "1"}},
     "prompt", "roles are"),
    ({"prompt": 3, "reward_model": {"ground_truth": "1"}}, "prompt", "string or a list"),
    ({"prompt": "x"}, "reward_model.ground_truth", "--answer_key"),
    ({"prompt": "x", "reward_model": {"ground_truth": None}}, "reward_model.ground_truth",
     "string or a number"),
    ({"prompt": "x", "reward_model": {"ground_truth": [1]}}, "reward_model.ground_truth",
     "string or a number"),
    ({"prompt": "x", "reward_model": {"ground_truth": "1"}, "extra_info": "s"}, "extra_info",
     "a dict"),
])
def test_bad_rows_fail_naming_file_row_and_field(tmp_path, row, field, words):
    path = fx.write_jsonl(str(tmp_path / "bad.jsonl"), fx.gsm_rows(2) + [row])
    with pytest.raises(DatasetError) as e:
        read_dataset([path])
    msg = str(e.value)
    assert path in msg and "row 2" in msg and field in msg and words in msg


def test_unreadable_files_fail_clearly(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        read_rows(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match=".jsonl or .parquet"):
        read_rows(str(tmp_path / "x.csv"))
    (tmp_path / "x.jsonl").write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(DatasetError, match="line 2 is not JSON"):
        read_rows(str(tmp_path / "x.jsonl"))
    (tmp_path / "x.parquet").write_bytes(b"PAR1 broken")
    with pytest.raises(DatasetError, match="not a readable parquet"):
        read_rows(str(tmp_path / "x.parquet"))


# --- rendering ----------------------------------------------------------------------------------
def test_chat_template_rendering_with_system_prompt_and_suffix(tok):
    prompt = ({"role": "user", "content": "What is 2 plus 3?"},)
    plain = PromptRenderer(tok).render(prompt)
    assert plain == tok.apply_chat_template(list(prompt))
    assert tok.decode(plain, skip_special=False) == \
        "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    r = PromptRenderer(tok, system_prompt="Be brief.", instruction_suffix=" Think.")
    assert tok.decode(r.render(prompt), skip_special=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 plus 3? "
        "Think.<|im_end|>\n<|im_start|>assistant\n")
    assert r.render("What is 2 plus 3?") == r.render(prompt)   # a string is one user message
    text = PromptRenderer(tok, apply_chat_template=False).render(prompt)
    assert text == tok.encode("What is 2 plus 3?") and not set(text) & tok.special_ids


@pytest.mark.parametrize("kw", [{}, {"system_prompt": "Be brief.", "instruction_suffix": " T."},
                                {"apply_chat_template": False}], ids=["chat", "system", "plain"])
def test_render_many_gives_the_ids_of_render_one_by_one(tok, kw):
    prompts = [r["prompt"] for r in fx.gsm_rows(40)] + [
        "a string prompt", [{"role": "user", "content": "literal <|im_end|> text"}]]
    r = PromptRenderer(tok, **kw)
    assert r.render_many(prompts) == [r.render(p) for p in prompts]
    char = PromptRenderer(CharTokenizer())   # the interface's one-by-one default
    assert char.render_many(["1+2=", "3+4="]) == [char.render("1+2="), char.render("3+4=")]


def test_a_row_that_does_not_render_is_named(tok, tmp_path):
    rows = fx.gsm_rows(5)
    rows[3]["prompt"] = [{"role": "system", "content": "no user message"}]
    train = fx.write_jsonl(str(tmp_path / "train.jsonl"), rows)
    with pytest.raises(DatasetError, match=r"train\.jsonl: row 3: the prompt does not render"):
        DatasetTask(tok, [train], [train], make_reward("gsm8k"),
                    renderer=PromptRenderer(tok, instruction_suffix=" Think."))


def test_chat_template_on_a_tokenizer_without_one_is_an_error():
    char = CharTokenizer()
    assert PromptRenderer(char).render("1+2=") == char.encode("1+2=")   # auto: plain text
    with pytest.raises(ValueError, match="no chat template"):
        PromptRenderer(char, apply_chat_template=True)


# --- the task ---------------------------------------------------------------------------------------
def test_training_stream_is_seeded_epoch_shuffled_and_disjoint_across_actors(tok, files):
    a = make_task(tok, files, seed=3)
    first = [a.sample_prompt() for _ in range(80)]     # two epochs of 40
    assert [p.prompt_id for p in first] == list(range(80))
    epoch0 = [p.answer.index for p in first[:40]]
    epoch1 = [p.answer.index for p in first[40:]]
    assert sorted(epoch0) == sorted(epoch1) == list(range(40))   # every row once per epoch
    assert epoch0 != epoch1 and epoch0 != list(range(40))       # reshuffled each epoch
    same_seed = make_task(tok, files, seed=3)
    assert [same_seed.sample_prompt().answer.index for _ in range(40)] == epoch0
    other = make_task(tok, files, seed=4)
    assert [other.sample_prompt().answer.index for _ in range(40)] != epoch0
    unshuffled = make_task(tok, files, shuffle=False)
    assert [unshuffled.sample_prompt().answer.index for _ in range(5)] == [0, 1, 2, 3, 4]
    actors = [make_task(tok, files, seed=3, prompt_id_offset=i, prompt_id_stride=2)
              for i in range(2)]
    ids = [[t.sample_prompt().prompt_id for _ in range(30)] for t in actors]
    assert not set(ids[0]) & set(ids[1]) and sorted(ids[0] + ids[1]) == list(range(60))
    # Each actor's prompt k is the stream's prompt at position k*2+i: same rows as one actor.
    assert [p.answer.index for p in first[:6:2]] == \
        [make_task(tok, files, seed=3).prompt_at(k).answer.index for k in (0, 2, 4)]


def test_a_restarted_actor_continues_mid_epoch(tok, files):
    whole = make_task(tok, files, seed=1, prompt_id_offset=1, prompt_id_stride=2)
    stream = [whole.sample_prompt() for _ in range(30)]
    restarted = make_task(tok, files, seed=1, prompt_id_offset=1, prompt_id_stride=2)
    for _ in range(23):      # what the actor's spool says it completed before the crash
        restarted.sample_prompt()
    rest = [restarted.sample_prompt() for _ in range(7)]
    assert [(p.prompt_id, p.token_ids) for p in rest] == \
        [(p.prompt_id, p.token_ids) for p in stream[23:]]


def test_over_long_prompts_are_left_out_and_counted(tok, tmp_path):
    rows = fx.gsm_rows(6)
    rows[2]["prompt"][0]["content"] += " and many more words" * 20
    rows[4]["prompt"] = "long " * 200
    train = fx.write_jsonl(str(tmp_path / "t.jsonl"), rows)
    limit = max(len(PromptRenderer(tok).render(r["prompt"])) for i, r in enumerate(rows)
                if i not in (2, 4))
    task = DatasetTask(tok, [train], [train], make_reward("gsm8k"), max_prompt_length=limit)
    assert task.stats == {"train_rows": 6, "train_filtered_long": 2, "eval_rows": 6,
                          "eval_filtered_long": 2}
    seen = {task.sample_prompt().answer.index for _ in range(8)}
    assert seen == {0, 1, 3, 5}
    with pytest.raises(DatasetError, match="raise --max_prompt_length"):
        DatasetTask(tok, [train], [train], make_reward("gsm8k"), max_prompt_length=3)


def test_eval_prompts_are_the_first_of_the_eval_files(tok, files):
    task = make_task(tok, files, num_eval=4)
    evals = task.eval_prompts()
    assert [p.answer.index for p in evals] == [0, 1, 2, 3]
    assert len({p.prompt_id for p in evals}) == 4 and min(p.prompt_id for p in evals) >= 1 << 40
    with pytest.raises(DatasetError, match="lower --eval_size"):
        make_task(tok, files, num_eval=11)


def test_scoring_decodes_the_response_and_counts_reward_failures(tok, files):
    task = make_task(tok, files)
    p = task.eval_prompts()[0]
    truth = p.answer.ground_truth
    right = tok.encode(f"so it is {truth}.\n#### {truth}", add_bos=False) + [tok.eos_id] + \
        tok.encode("#### 0", add_bos=False)        # text after the stop id is not the response
    wrong = tok.encode("#### 999", add_bos=False) + [tok.stop_ids[1]]
    assert task.score(p, right) == (1.0, {"reward_calls": 1, "reward_no_answer": 0.0})
    assert task.is_correct(p, right) and not task.is_correct(p, wrong)
    assert task.score(p, [tok.vocab_size + 3]) == \
        (0.0, {"reward_calls": 1, "reward_failed_undecodable": 1})
    env = task.make_environment(p)
    step = env.step(right)
    assert step.done and step.reward == 1.0 and step.info["counters"]["reward_calls"] == 1
    with pytest.raises(RuntimeError, match="single-turn"):
        env.step(right)

    class Raising:
        def __call__(self, *args):
            return RewardResult(0.0, "raised", {})

        def close(self):
            pass
    failing = DatasetTask(tok, [files[0]], [files[1]], Raising())
    assert failing.score(p, right) == (0.0, {"reward_calls": 1, "reward_failed_raised": 1})


def test_a_raising_custom_reward_is_a_counted_zero_through_the_task(tok, files, tmp_path):
    (tmp_path / "rw.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if '1' in solution_str:\n        raise RuntimeError('boom')\n"
        "    return {'score': 1.0, 'length': len(solution_str)}\n")
    reward = make_reward(f"{tmp_path}/rw.py:compute_score", timeout_s=10.0, workers=1)
    task = DatasetTask(tok, [files[0]], [files[1]], reward)
    try:
        p = task.eval_prompts()[0]
        assert task.score(p, tok.encode("1", add_bos=False)) == \
            (0.0, {"reward_calls": 1, "reward_failed_raised": 1})
        assert task.score(p, tok.encode("ab", add_bos=False)) == \
            (1.0, {"reward_calls": 1, "reward_length": 2.0})
    finally:
        task.close()
