"""Tiny Hugging Face model directories built at test time in seconds (no hub, no training).

`tiny_qwen3(dir)`: the workload's byte-level BPE tokenizer (Qwen-style chat template, no BOS,
eos <|im_end|>, generation_config eos [<|im_end|>, <|endoftext|>]) with a small random Qwen3
with tied embeddings (programs/make_tiny_model.py at small sizes).
`gsm_rows(n)`: verl-schema rows of GSM8K-style problems.
"""
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

TINY = dict(vocab_size=600, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
            head_dim=32, intermediate_size=128, max_position_embeddings=512)


def tiny_qwen3(out_dir: str, **overrides) -> str:
    """Writes the tiny Qwen3 model directory to `out_dir` (once) and returns it."""
    if not os.path.exists(os.path.join(out_dir, "config.json")):
        from programs.make_tiny_model import build
        build(out_dir, **{**TINY, **overrides})
    return out_dir


def gsm_rows(n: int, start: int = 0):
    """n verl-schema rows "What is a plus b?" with ground truth a + b."""
    rows = []
    for i in range(start, start + n):
        a, b = i % 17 + 1, i % 5 + 2
        rows.append({
            "data_source": "test/gsm", "ability": "math",
            "prompt": [{"role": "user", "content": f"What is {a} plus {b}? Answer after ####."}],
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"index": i}})
    return rows


def write_jsonl(path: str, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def write_parquet(path: str, rows) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(list(rows)), path)
    return path
