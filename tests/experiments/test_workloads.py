"""The gsm_tiny workload: word problems, dataset files, the tiny Qwen3 checkpoint, chat SFT."""
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from experiments.workloads import chat_sft, tiny_bpe, word_problems as wp  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def run_program(name, *args):
    subprocess.run([sys.executable, os.path.join(REPO, "programs", name), *args], check=True,
                   cwd=REPO, env=ENV, capture_output=True)


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def splits():
    return wp.make_splits(0, 3000, 300)


def test_generator_is_deterministic_and_splits_are_disjoint(splits):
    train, test = splits
    again = wp.make_splits(0, 3000, 300)
    assert [p.solution for p in train] == [p.solution for p in again[0]]
    assert [p.question for p in test] == [p.question for p in again[1]]
    assert len(train) == 3000 and len(test) == 300
    train_q, test_q = {p.question for p in train}, {p.question for p in test}
    assert len(train_q) == 3000 and len(test_q) == 300 and not train_q & test_q
    # The split is a property of the question, not of the counts asked for.
    bigger_train, bigger_test = wp.make_splits(0, 6000, 600)
    assert not {p.question for p in bigger_train} & test_q
    assert not {p.question for p in bigger_test} & train_q
    assert wp.make_splits(1, 50, 5)[0][0].question != train[0].question


def test_solutions_are_correct(splits):
    lengths = set()
    for p in splits[0] + splits[1]:
        eqs = wp.parse_equations(p.solution)
        assert len(eqs) == len(p.steps) and len(eqs) in (2, 3)
        lengths.add(len(eqs))
        total = None
        for (a, op, b, c), step in zip(eqs, p.steps):
            assert {"+": a + b, "-": a - b, "*": a * b}[op] == c >= 0
            assert total is None or a == total            # each step continues the count
            assert str(b) in p.question                   # operands come from the question
            assert (op == "-") == (step.kind in ("give", "take"))
            total = c
        assert p.solution.endswith(f"\n#### {p.answer}") and total == p.answer
        assert chat_sft.extract_answer(p.solution) == str(p.answer)
    assert lengths == {2, 3}
    gives = [p.gives for p in splits[0]]
    assert 0.4 < sum(gives) / len(gives) < 0.6


def masked(text):
    return re.sub(r"\d+", "N", text)


def test_demonstrations_carry_exactly_the_designed_flaw(splits):
    train = splits[0]
    flawed = triggered = 0
    for p in train:
        demo = wp.demonstration(p, "add_for_give", 0.6, seed=0)
        if not p.gives:
            assert demo == p.solution
            continue
        triggered += 1
        if demo == p.solution:
            continue
        flawed += 1
        # The same sentences, with "+" instead of "-" exactly at the give steps, the same
        # operands from the question, right arithmetic for the operation written, counts
        # carried forward, and the answer of that chain.
        eqs, total = wp.parse_equations(demo), None
        assert len(eqs) == len(p.steps)
        for (a, op, b, c), step in zip(eqs, p.steps):
            assert b == step.right and op == ("+" if step.kind == "give" else step.op)
            assert {"+": a + b, "-": a - b, "*": a * b}[op] == c and (total is None or a == total)
            total = c
        assert masked(demo) == masked(wp.render(p, [
            dataclasses.replace(s, op="+") if s.kind == "give" else s for s in p.steps], 0))
        assert demo.endswith(f"\n#### {total}") and total != p.answer
    # Exact counts for this seed; the draws are hashes of the questions, so nothing can flake.
    assert triggered > 1000 and abs(flawed / triggered - 0.6) < 0.03
    assert all(wp.demonstration(p, "none") == p.solution for p in train)
    subtract = [wp.demonstration(p, "add_for_subtract", 1.0) for p in train]
    assert not any(" - " in d for d in subtract) and sum(d != p.solution for d, p in zip(
        subtract, train)) == sum(" - " in p.solution for p in train)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_make_dataset_writes_verl_schema(tmp_path):
    import pyarrow.parquet as pq
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for out in (a, b):
        run_program("make_dataset.py", f"--out_dir={out}", "--num_train=300", "--num_test=40")
    for name in ("train", "test", "sft"):
        assert sha256(os.path.join(a, name + ".jsonl")) == sha256(os.path.join(b, name + ".jsonl"))
        rows = read_jsonl(os.path.join(a, name + ".jsonl"))
        assert pq.read_table(os.path.join(a, name + ".parquet")).to_pylist() == rows
    train, test = (read_jsonl(os.path.join(a, n + ".jsonl")) for n in ("train", "test"))
    assert len(train) == 300 and len(test) == 40
    for split, rows in (("train", train), ("test", test)):
        for i, row in enumerate(rows):
            assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
            assert row["data_source"] == "gsm_tiny" and row["ability"] == "math"
            info = row["extra_info"]
            assert info["split"] == split and info["index"] == i
            assert row["prompt"] == [{"role": "user",
                                      "content": f"{info['question']} {wp.INSTRUCTION}"}]
            assert row["reward_model"] == {"style": "rule", "ground_truth":
                                           chat_sft.extract_answer(info["answer"])}
    assert not {r["extra_info"]["question"] for r in train} & {
        r["extra_info"]["question"] for r in test}
    sft = read_jsonl(os.path.join(a, "sft.jsonl"))
    assert [r["prompt"] for r in sft] == [r["prompt"] for r in train]
    assert all(set(r) == {"prompt", "response"} and re.search(r"\n#### \d+$", r["response"])
               for r in sft)
    assert any(r["response"] != t["extra_info"]["answer"] for r, t in zip(sft, train))


@pytest.fixture(scope="module")
def tiny_model_dirs(tmp_path_factory):
    """The same small checkpoint built twice: by the program, and in this process."""
    from programs.make_tiny_model import build
    dirs = [str(tmp_path_factory.mktemp(f"tiny{i}")) for i in range(2)]
    run_program("make_tiny_model.py", f"--out_dir={dirs[0]}", "--vocab_size=600",
                "--hidden_size=64", "--num_heads=2", "--num_kv_heads=1",
                "--intermediate_size=128", "--num_layers=2")
    build(dirs[1], vocab_size=600, hidden_size=64, num_heads=2, num_kv_heads=1,
          intermediate_size=128, num_layers=2)
    return dirs


def test_make_tiny_model_is_deterministic_and_reloads(tiny_model_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    a, b = tiny_model_dirs
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json",
                 "generation_config.json"):
        assert sha256(os.path.join(a, name)) == sha256(os.path.join(b, name)), name
    tok = AutoTokenizer.from_pretrained(a)
    model = AutoModelForCausalLM.from_pretrained(a)
    assert len(tok) == 600 == model.config.vocab_size
    assert tok.bos_token is None and model.config.bos_token_id is None
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert model.config.eos_token_id == im_end and model.config.pad_token_id == eot
    assert model.generation_config.eos_token_id == [im_end, eot]
    with open(os.path.join(a, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == [im_end, eot]
    with open(os.path.join(a, "tokenizer_config.json")) as f:
        config = json.load(f)
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "extra_special_tokens" not in config
    assert model.get_input_embeddings().weight.data_ptr() == \
        model.get_output_embeddings().weight.data_ptr()
    assert model.config.tie_word_embeddings and model.config.head_dim == 32
    assert [tok.decode([t]) for t in tok.encode("1234", add_special_tokens=False)] == list("1234")
    assert tok.encode("Tom has 12 apples.", add_special_tokens=False)[0] != tok.bos_token_id


def test_chat_template(tiny_model_dirs):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs[0])
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 12?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 12?<|im_end|>"
                    "\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs[1:], tokenize=False) == \
        "<|im_start|>user\nHi 12?<|im_end|>\n"
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    assert list(ids) == tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == \
        "system\nBe brief.\nuser\nHi 12?\nassistant\n"


@pytest.fixture(scope="module")
def tiny_lm():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    tok = tiny_bpe.train_tokenizer(600)
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=im_end, pad_token_id=eot))
    return tok, model


def test_loss_mask_covers_the_response_and_im_end(tiny_lm):
    tok, _ = tiny_lm
    p = wp.make_splits(0, 1, 1)[0][0]
    ids, mask = chat_sft.encode_example(tok, p.messages, p.solution)
    prompt = tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"]
    target = tok.encode(p.solution, add_special_tokens=False) + [tok.convert_tokens_to_ids(
        "<|im_end|>")]
    assert ids == list(prompt) + target and mask == [0] * len(prompt) + [1] * len(target)
    batch, batch_mask = chat_sft.collate([(ids, mask), (ids[:-3], mask[:-3])], pad_id=0)
    assert batch_mask.sum().item() == 2 * len(target) - 3
    assert batch[1, -3:].tolist() == [0, 0, 0]


def test_sft_steps_reduce_the_loss_and_evaluate_runs(tiny_lm):
    import torch
    tok, model = tiny_lm
    torch.manual_seed(0)
    train, test = wp.make_splits(0, 8, 4)
    examples = [(p.messages, p.solution) for p in train]
    losses = chat_sft.train(model, tok, examples, steps=30, batch_size=8, lr=3e-3,
                            warmup_steps=5, seed=0)
    assert len(losses) == 30 and losses[-1] < 0.7 * losses[0]
    result = chat_sft.evaluate(model, tok, [(p.messages, str(p.answer)) for p in test],
                               num_samples=2, max_new_tokens=6, batch_size=3)
    assert result["num_problems"] == 4 and 0 <= result["greedy_accuracy"] <= 1
    assert result["length_max"] <= 6
    assert chat_sft.extract_answer("so 3 + 4 = 7.\n#### 1,234 then #### -5") == "-5"
    assert chat_sft.extract_answer("no answer") is None


def test_sft_dataset_writes_a_model_directory_sao_can_start_from(tiny_model_dirs, tmp_path):
    """programs/sft_dataset.py end to end on tiny files: the written directory reloads with
    AutoModelForCausalLM/AutoTokenizer, its weights moved, and warm_start.json has the
    held-out numbers of the problems it evaluated."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    data, out = str(tmp_path / "data"), str(tmp_path / "warm")
    run_program("make_dataset.py", f"--out_dir={data}", "--num_train=40", "--num_test=10")
    run_program("sft_dataset.py", f"--model={tiny_model_dirs[0]}",
                f"--sft_files={data}/sft.jsonl", f"--eval_files={data}/test.parquet",
                f"--out_dir={out}", "--steps=3", "--batch_size=4", "--eval_size=4",
                "--max_new_tokens=8", "--threads=1")
    with open(os.path.join(out, "warm_start.json")) as f:
        report = json.load(f)
    assert report["num_problems"] == 4 and 0 <= report["greedy_accuracy"] <= 1
    assert report["settings"]["steps"] == 3 and report["length_max"] <= 8
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[0])
    after = AutoModelForCausalLM.from_pretrained(out)
    assert len(AutoTokenizer.from_pretrained(out)) == len(
        AutoTokenizer.from_pretrained(tiny_model_dirs[0]))
    assert not torch.equal(before.model.embed_tokens.weight, after.model.embed_tokens.weight)
