"""The real pretrained instruct model: SmolLM2-135M-Instruct converted from its GGUF file by
`make real-model` (programs/real_model.py, models/gguf_convert.py) into
checkpoints/smollm2-135m-instruct.

It goes through the same paths as any --model: the dataset task renders its prompts with the
real 49,152-token vocabulary and its chat template (which opens with <|im_start|>, the
tokenizer's BOS, and adds a default system message), <|im_end|> ends a turn, the gsm8k reward
reads the response up to it; then 2 SAO steps of the whole program (local_mp: replay, variable
server, an actor with the torch engine, the learner) on tiny batches.

`make test` builds the directory first (it depends on `make real-model`); under make a missing
directory fails, a bare pytest without it skips, naming the command.
"""
import json
import math
import os

import pytest

import hf_fixtures as fx
from sao_actor_learner.builder import make_dataset_task, make_program
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.models import load_policy, load_tokenizer
from sao_actor_learner.models.model_dir import check_model_dir
from sao_actor_learner.observers import read_metrics
from sao_actor_learner.run import run_program

REAL_MODEL = os.path.join(fx.REPO, "checkpoints", "smollm2-135m-instruct")
IM_START, IM_END, ENDOFTEXT = 1, 2, 0      # SmolLM2's specials (checked below by name)


@pytest.fixture(scope="module")
def real_model():
    if not os.path.exists(os.path.join(REAL_MODEL, "gguf_source.json")):
        reason = f"{REAL_MODEL} is missing: run `make real-model-dir` (converts SmolLM2's GGUF)"
        if os.environ.get("MAKELEVEL"):
            pytest.fail(reason)
        pytest.skip(reason)
    return REAL_MODEL


def dataset_config(tmp_path, model, **overrides):
    train = fx.write_parquet(str(tmp_path / "train.parquet"), fx.gsm_rows(16))
    test = fx.write_jsonl(str(tmp_path / "test.jsonl"), fx.gsm_rows(4, start=500))
    fields = dict(task="dataset", model=model, train_files=(train,), eval_files=(test,),
                  reward="gsm8k", run_dir=str(tmp_path / "run"), eval_size=2)
    return SAOConfig(**{**fields, **overrides})


def test_the_converted_directory_and_its_records(real_model):
    check_model_dir(real_model)                # config, intact safetensors, tokenizer
    with open(os.path.join(real_model, "gguf_source.json")) as f:
        source = json.load(f)
    assert source["architecture"] == "llama" and source["parameters"] == 134_515_008
    assert source["vocab_size"] == 49_152 and source["has_chat_template"]
    assert source["probe_max_abs_logit_difference"] <= 1e-4
    with open(os.path.join(real_model, "config.json")) as f:
        config = json.load(f)
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    report_path = os.path.join(real_model, "real_model.json")   # `make real-model` only
    if os.path.exists(report_path):
        with open(report_path) as f:
            report = json.load(f)
        assert report["eval_size"] >= 1 and 0.0 <= report["greedy_accuracy"] <= 1.0
        assert report["settings"]["reward"] == "gsm8k"


def test_prompts_bos_stop_ids_and_reward_on_the_real_vocabulary(real_model, tmp_path):
    tok = load_tokenizer(real_model)
    assert tok.vocab_size == 49_152
    assert tok.hf.convert_ids_to_tokens([ENDOFTEXT, IM_START, IM_END]) == \
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    # <|im_start|> is the BOS but the tokenizer prepends nothing: the template opens with it.
    assert tok.hf.bos_token_id == IM_START and tok.bos_id is None
    assert tok.stop_ids == (IM_END,) and tok.eos_id == IM_END and tok.pad_id == IM_END
    config = dataset_config(tmp_path, real_model)
    task = make_dataset_task(config, tok)        # what every actor builds
    try:
        prompt = task.eval_prompts()[0]
        ids = list(prompt.token_ids)
        text = tok.decode(ids, skip_special=False)
        # One BOS, first; one <|im_start|> per turn: the template's system message, the user's
        # question, the assistant header that the response follows.
        assert ids[0] == IM_START and ids[1] != IM_START and ids.count(IM_START) == 3
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        a, b = 500 % 17 + 1, 500 % 5 + 2           # hf_fixtures.gsm_rows(4, start=500)[0]
        assert f"<|im_start|>user\nWhat is {a} plus {b}? Answer after ####.<|im_end|>\n" in text
        assert text.endswith("<|im_start|>assistant\n") and ids.count(IM_END) == 2
        # The response is read up to the first <|im_end|>, specials skipped.
        right = tok.encode(f"{a} + {b} = {a + b}.\n#### {a + b}", add_bos=False)
        wrong = tok.encode(f"#### {a + b + 1}", add_bos=False)
        assert task.score(prompt, right + [IM_END])[0] == 1.0
        assert task.score(prompt, right + [IM_END] + wrong)[0] == 1.0   # after the stop: unread
        assert task.score(prompt, right + wrong + [IM_END])[0] == 0.0   # the last #### counts
        score, counters = task.score(prompt, tok.encode("It is 3.", add_bos=False) + [IM_END])
        assert score == 0.0 and counters["reward_no_answer"] == 1.0
    finally:
        task.close()


@pytest.mark.timeout(900)
def test_two_sao_steps_on_the_real_model(real_model, tmp_path):
    # The lean settings (one actor, the value head on the policy's trunk) without evaluation:
    # a 135M-parameter step on 2 cores is the cost here (~1-4 min for the test, by load).
    config = dataset_config(tmp_path, real_model, max_steps=2, batch_size=2, actor_batch=2,
                            num_actors=1, max_new_tokens=16, max_sequence_length=96,
                            critic="shared_trunk", evaluator="off", threads_per_process=2,
                            policy_lr=1e-6, launch="local_mp")
    summary = run_program(config, make_program, progress=False)
    assert summary["steps"] == 2 and summary["rollouts_trained"] == 4
    assert summary["env_counters"]["reward_calls"] >= 4
    train = read_metrics(config.run_dir, "train")
    assert [r["policy_version"] for r in train][-1] == 2
    for row in train:
        assert row["reward_mean"] in (0.0, 0.5, 1.0) and math.isfinite(row["value_loss"])
        # The actor's log-probs are the learner's (same weights, same vocabulary): near 0 KL.
        assert abs(row["kl_rollout"]) < 1e-3 and row["dis_masked_frac"] == 0.0
    # The final checkpoint is a model directory like the one it started from.
    ckpt = os.path.join(config.run_dir, "checkpoints", "step_000002")
    model, tok = load_policy(ckpt)
    assert tok.stop_ids == (IM_END,) and tok.has_chat_template and tok.vocab_size == 49_152
    assert model.config.tie_word_embeddings and model.num_parameters() == 134_515_008
