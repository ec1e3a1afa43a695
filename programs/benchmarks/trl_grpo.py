r"""TRL's GRPOTrainer on this project's tasks: the peer side of benchmark 1 (vs_trl.py).

Runs in the TRL environment (`make trl-env`), not in the main venv:

  OMP_NUM_THREADS=1 .venv-trl/bin/python programs/benchmarks/trl_grpo.py \
      --init_checkpoint=checkpoints/warm_start --rollouts_per_step=32 --num_generations=2 \
      --learning_rate=1e-4 --threshold=0.9 --eval_every=5 --max_steps=400 --time_budget_s=150
  OMP_NUM_THREADS=1 .venv-trl/bin/python programs/benchmarks/trl_grpo.py --workload=dataset \
      --init_checkpoint=checkpoints/warm_start_dataset --max_new_tokens=96 --num_generations=4 \
      --learning_rate=2e-4 --threshold=0.5 --eval_every=10 --max_steps=150 --time_budget_s=600

It imports trl / transformers / torch and, from this project, only pure-python task and reward
code (no Reverb, TensorFlow or gRPC, which is checked), so both sides pose the same problems:

  arithmetic  ArithmeticTask and its char tokenizer: prompts from the task's sampler, 1.0 for
              the exact sum (ArithmeticTask.is_correct), 8-token completions.
  dataset     DatasetTask over the model directory's tokenizer (HFTokenizer): the training
              stream of the SAO program (seeded permutation, position k = prompt k), the same
              reward (--reward, e.g. gsm8k), the same held-out prompts (the first --eval_size of
              --eval_files) and is_correct (score >= 1). TRL gets the prompts as chat messages
              and renders them with the same chat template (prompt 0's ids are checked equal).

Same warm-start checkpoint (AutoModelForCausalLM / AutoTokenizer, offline), same greedy
held-out evaluation (max_new_tokens, the tokenizer's stop ids) as SAO's evaluator.

Training: GRPOTrainer, one optimizer step per generation batch (steps_per_generation=1,
num_iterations=1: on-policy, as TRL's default), rollouts_per_step completions a step =
rollouts_per_step / num_generations prompts x num_generations, temperature 1, top_p 1, top_k off,
max_completion_length = max_new_tokens, fp32 (bf16 off), no gradient checkpointing (both would
only slow a small model on CPU), --lr_scheduler (constant by default; cosine over
--max_steps as SAO's --lr_schedule=cosine), AdamW (0.9, 0.999), no weight
decay, grad-norm clip 1.0 (as the SAO learner), beta=0 (no reference model). The reward
function scores each completion's token ids with the task (the workload's reward) and counts the
rollouts and generated tokens.

Clocks: `train_clock_s` starts when trainer.train() begins (on_train_begin) and stops while the
held-out evaluation runs (every eval_every steps, in a callback, and at step 0): it is training
time with evaluation excluded. `since_start_s` is time since this process started (imports and
model loading included, evaluation included). Training stops at the first evaluation at or above
--threshold (unless --no-stop_at_threshold), after --max_steps, or once train_clock_s passes
--time_budget_s.

Ends with one JSON line: the eval curve [{step, accuracy, train_clock_s, since_start_s}], the
step/time the threshold was first reached (null if not), rollouts, generated tokens, rates.
"""
from __future__ import annotations

import time

PROCESS_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# This folder holds kernels.py, which would shadow the `kernels` package transformers probes for:
# keep the script's own folder off the import path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=("arithmetic", "dataset"), default="arithmetic")
    p.add_argument("--init_checkpoint", default="checkpoints/warm_start",
                   help="The warm start: a Hugging Face model directory (with its tokenizer).")
    p.add_argument("--train_files", nargs="+", default=["data/gsm_tiny/train.parquet"],
                   help="dataset workload: the training files (SAO's --train_files).")
    p.add_argument("--eval_files", nargs="+", default=["data/gsm_tiny/test.parquet"],
                   help="dataset workload: the held-out files (SAO's --eval_files).")
    p.add_argument("--reward", default="gsm8k", help="dataset workload: a builtin reward.")
    p.add_argument("--max_prompt_length", type=int, default=0,
                   help="dataset workload: longer prompts are left out (SAO's "
                        "max_sequence_length - max_new_tokens).")
    p.add_argument("--task_seed", type=int, default=0,
                   help="The task's split seed: must be the warm start's (SAO's --seed).")
    p.add_argument("--seed", type=int, default=0,
                   help="TRL's training seed: prompt order and sampling.")
    p.add_argument("--eval_size", type=int, default=200, help="Held-out prompts (SAO: eval_size).")
    p.add_argument("--max_new_tokens", type=int, default=8)
    p.add_argument("--rollouts_per_step", type=int, default=32,
                   help="Completions per optimizer step (prompts x num_generations).")
    p.add_argument("--num_generations", type=int, default=2, help="GRPO group size G (>= 2).")
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--lr_scheduler", choices=("constant", "cosine"), default="constant",
                   help="GRPOConfig.lr_scheduler_type (cosine: over --max_steps).")
    p.add_argument("--loss_type", default="dapo", help="GRPOConfig.loss_type (TRL default dapo).")
    p.add_argument("--max_steps", type=int, default=400)
    p.add_argument("--eval_every", type=int, default=5)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--stop_at_threshold", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--time_budget_s", type=float, default=150.0,
                   help="Stop once the training clock (evaluation excluded) passes this.")
    p.add_argument("--output_dir", default="/tmp/trl_grpo")
    args = p.parse_args(argv)
    if args.num_generations < 2:
        p.error(f"--num_generations={args.num_generations}: GRPO needs >= 2 (TRL refuses 1)")
    if args.rollouts_per_step % args.num_generations:
        p.error(f"--rollouts_per_step={args.rollouts_per_step} is not a multiple of "
                f"--num_generations={args.num_generations}: a step is prompts x G")
    if args.eval_every < 1 or args.max_steps < 1:
        p.error("--eval_every and --max_steps must be >= 1")
    return args


def greedy_accuracy(model, workload, max_new_tokens: int, batch_size: int = 64) -> float:
    """Held-out greedy accuracy: left-padded HF generate (stopping at the workload's stop ids),
    scored by the workload's `is_correct` (the task's), 64 prompts a batch as the SAO
    evaluator."""
    import torch

    was_training = model.training
    model.eval()
    correct = 0
    prompts = workload.eval_prompts
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i:i + batch_size]
            width = max(len(p.token_ids) for p in chunk)
            ids = torch.full((len(chunk), width), workload.pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, p in enumerate(chunk):
                ids[row, width - len(p.token_ids):] = torch.tensor(p.token_ids)
                mask[row, width - len(p.token_ids):] = 1
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max_new_tokens,
                                 eos_token_id=list(workload.stop_ids),
                                 pad_token_id=workload.pad_id)
            for p, row in zip(chunk, out[:, width:].tolist()):
                correct += workload.is_correct(p, row)
    if was_training:
        model.train()
    return correct / len(prompts)


class ArithmeticWorkload:
    """The arithmetic task (char tokenizer, 3-token answers): prompts from the task's own
    sampler (uniform pairs with replacement, held-out pairs rejected), reward 1.0 for the exact
    sum."""

    def __init__(self, args, tokenizer):
        from sao_actor_learner.tasks.arithmetic import ArithmeticTask

        self.task = ArithmeticTask(seed=args.task_seed, num_eval=args.eval_size)
        self.eval_prompts = self.task.eval_prompts()
        self.pad_id = self.task.tokenizer.pad_id
        self.stop_ids = (self.task.tokenizer.eos_id,)
        if tokenizer.pad_token_id != self.pad_id or tokenizer.eos_token_id != self.stop_ids[0]:
            raise RuntimeError(f"{args.init_checkpoint}: tokenizer pad/eos ids "
                               f"{tokenizer.pad_token_id}/{tokenizer.eos_token_id} differ from "
                               f"the task's {self.pad_id}/{self.stop_ids[0]}")
        self._seed = args.seed
        self._tokenizer = tokenizer

    def train_columns(self, n: int) -> dict:
        import numpy as np

        rng = np.random.default_rng([self._seed, 3])
        train = [self.task.sample_prompt(rng) for _ in range(n)]
        first = self._tokenizer(text=[train[0].text])["input_ids"][0]
        if list(first) != list(train[0].token_ids):
            raise RuntimeError(f"HF tokenizer ids {first} != task ids "
                               f"{list(train[0].token_ids)} for {train[0].text!r}")
        return {"prompt": [p.text for p in train], "answer": [p.answer for p in train]}

    def rewards(self, completion_ids, answer, **_) -> list:
        return [1.0 if self.task.completion_text(ids) == ans else 0.0
                for ids, ans in zip(completion_ids, answer)]

    def is_correct(self, prompt, ids) -> bool:
        return self.task.is_correct(prompt, ids)

    def close(self) -> None:
        pass


class DatasetWorkload:
    """A dataset task (the GSM8K-style files of `make run-dataset`): the project's DatasetTask
    over the model directory's tokenizer, with the same reward (--reward, a builtin), prompt
    rendering (the tokenizer's chat template), held-out prompts (the first --eval_size of
    --eval_files) and training stream (the task's seeded permutation, position k = prompt k) as
    the SAO program. TRL gets the prompts as chat messages and renders them with the same
    template; the first prompt's ids are checked against the task's."""

    def __init__(self, args, tokenizer):
        from sao_actor_learner.models.hf_tokenizer import HFTokenizer, generation_eos_ids
        from sao_actor_learner.rewards import make_reward
        from sao_actor_learner.tasks.dataset import DatasetTask

        self.tokenizer = HFTokenizer(tokenizer,
                                     extra_stop_ids=generation_eos_ids(args.init_checkpoint))
        self.task = DatasetTask(self.tokenizer, args.train_files, args.eval_files,
                                make_reward(args.reward), num_eval=args.eval_size,
                                max_prompt_length=args.max_prompt_length, seed=args.task_seed)
        self.eval_prompts = self.task.eval_prompts()
        self.pad_id = self.tokenizer.pad_id
        self.stop_ids = self.tokenizer.stop_ids
        self._hf = tokenizer

    def train_columns(self, n: int) -> dict:
        renderer = self.task.renderer
        prompts = [self.task.prompt_at(k) for k in range(n)]
        messages = [renderer.messages(p.answer.prompt) for p in prompts]
        ids = self._hf.apply_chat_template(messages[0], tokenize=True, return_dict=True,
                                           add_generation_prompt=True)["input_ids"]
        if list(ids) != list(prompts[0].token_ids):
            raise RuntimeError(f"TRL's rendering of prompt 0 ({len(ids)} ids) differs from the "
                               f"task's ({len(prompts[0].token_ids)} ids)")
        return {"prompt": messages, "position": list(range(n))}

    def rewards(self, completion_ids, position, **_) -> list:
        return [self.task.score(self.task.prompt_at(int(k)), ids)[0]
                for ids, k in zip(completion_ids, position)]

    def is_correct(self, prompt, ids) -> bool:
        return self.task.is_correct(prompt, ids)

    def close(self) -> None:
        self.task.close()


WORKLOADS = {"arithmetic": ArithmeticWorkload, "dataset": DatasetWorkload}


def main(argv=None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, REPO_ROOT)
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tokenizer = AutoTokenizer.from_pretrained(args.init_checkpoint, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.init_checkpoint, dtype=torch.float32,
                                                 local_files_only=True)
    workload = WORKLOADS[args.workload](args, tokenizer)
    heavy = sorted(m for m in ("reverb", "tensorflow", "grpc") if m in sys.modules)
    if heavy:
        raise RuntimeError(f"the TRL side imported {heavy}: it must use only the task's "
                           "pure-python code from this project")

    # Training prompts: up to 256 steps' worth (the trainer starts another epoch after that, so
    # start-up does not grow with max_steps); each appears num_generations times in a step.
    prompts_per_step = args.rollouts_per_step // args.num_generations
    dataset = Dataset.from_dict(workload.train_columns(min(args.max_steps, 256)
                                                       * prompts_per_step))

    counts = {"rollouts": 0, "completion_tokens": 0, "reward_sum": 0.0}

    def task_reward(prompts, completions, completion_ids, **columns):
        """The task's score of each completion (token ids, decoded by the task)."""
        rewards = workload.rewards(completion_ids, **columns)
        counts["completion_tokens"] += sum(len(ids) for ids in completion_ids)
        counts["rollouts"] += len(rewards)
        counts["reward_sum"] += sum(rewards)
        return rewards

    clock = {"train_begin": None, "eval_s": 0.0, "stopped_by": "max_steps"}
    curve = []
    reached = {}

    def train_clock() -> float:
        return time.time() - clock["train_begin"] - clock["eval_s"]

    def evaluate(step: int) -> float:
        t_clock, t0 = train_clock(), time.time()   # t0: when this policy existed
        acc = greedy_accuracy(model, workload, args.max_new_tokens)
        clock["eval_s"] += time.time() - t0
        curve.append({"step": step, "accuracy": acc, "train_clock_s": round(t_clock, 3),
                      "since_start_s": round(t0 - PROCESS_START, 3), "time": t0,
                      "rollouts": counts["rollouts"],
                      "completion_tokens": counts["completion_tokens"]})
        print(f"[trl] step {step} accuracy {acc:.3f} train_clock {t_clock:.1f}s "
              f"eval {time.time() - t0:.2f}s", file=sys.stderr, flush=True)
        if acc >= args.threshold and not reached:
            reached.update(curve[-1])
        return acc

    class EvalAndStop(TrainerCallback):
        def on_train_begin(self, targs, state, control, **kwargs):
            clock["train_begin"] = time.time()
            evaluate(0)

        def on_step_end(self, targs, state, control, **kwargs):
            step = state.global_step
            if step % args.eval_every == 0 or step >= args.max_steps:
                evaluate(step)
                if reached and args.stop_at_threshold:
                    clock["stopped_by"] = "threshold"
                    control.should_training_stop = True
            if train_clock() > args.time_budget_s and not control.should_training_stop:
                if curve[-1]["step"] != step:
                    evaluate(step)
                clock["stopped_by"] = "reached" if reached else "time_budget"
                if reached and args.stop_at_threshold:
                    clock["stopped_by"] = "threshold"
                control.should_training_stop = True
            return control

    config = GRPOConfig(
        output_dir=args.output_dir, seed=args.seed, data_seed=args.seed,
        max_steps=args.max_steps, learning_rate=args.learning_rate,
        lr_scheduler_type=args.lr_scheduler, warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
        per_device_train_batch_size=args.rollouts_per_step, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, num_generations=args.num_generations,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, loss_type=args.loss_type, bf16=False, fp16=False, use_cpu=True,
        gradient_checkpointing=False, disable_dropout=True, report_to="none",
        logging_steps=10 ** 9, save_strategy="no", dataloader_num_workers=0,
        disable_tqdm=True, log_completions=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[EvalAndStop()])
    try:
        trainer.train()
    finally:
        workload.close()
    train_s = train_clock()
    steps = trainer.state.global_step
    if not curve or curve[-1]["step"] != steps:
        evaluate(steps)
    result = {
        "side": "trl_grpo",
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__},
        "settings": {**vars(args), "prompts_per_step": prompts_per_step},
        "threads": torch.get_num_threads(),
        "process_start_time": PROCESS_START,
        "train_begin_time": clock["train_begin"],
        "train_begin_since_start_s": round(clock["train_begin"] - PROCESS_START, 3),
        "eval_curve": curve,
        "initial_accuracy": curve[0]["accuracy"],
        "final_accuracy": curve[-1]["accuracy"],
        "best_accuracy": max(c["accuracy"] for c in curve),
        "threshold": args.threshold,
        "threshold_step": reached.get("step"),
        "threshold_train_clock_s": reached.get("train_clock_s"),
        "threshold_since_start_s": reached.get("since_start_s"),
        "stopped_by": clock["stopped_by"],
        "steps": steps,
        "train_clock_s": round(train_s, 3),
        "eval_s": round(clock["eval_s"], 3),
        "rollouts": counts["rollouts"],
        "completion_tokens": counts["completion_tokens"],
        "reward_mean": counts["reward_sum"] / max(counts["rollouts"], 1),
        "rollouts_per_s": counts["rollouts"] / max(train_s, 1e-9),
        "tokens_per_s": counts["completion_tokens"] / max(train_s, 1e-9),
        "total_s": round(time.time() - PROCESS_START, 3),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
