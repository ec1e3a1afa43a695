"""A task made of dataset files: prompts from JSONL/parquet rows, scored by a reward function.

Prompts. Each row's prompt (a string, or chat messages) is rendered once into token ids by
`PromptRenderer`: with the model's chat template (`apply_chat_template`, default when the
tokenizer has one; `chat_template_kwargs` reach the template, e.g. {"enable_thinking": false}),
or as plain text preceded by BOS when the model has one. An optional system prompt is put first
and an optional instruction suffix is appended to the last user message (or to a string prompt).
Prompts longer than `max_prompt_length` tokens are left out and counted (`filtered_long`).
The rendered ids are kept in the start-up cache (disk_cache.py), keyed by the files, the
prompt column, the renderer's settings and the tokenizer's files: the pre-launch checks, each
actor and the evaluator would otherwise render every prompt again (~2.5 s per 20k rows).

Order. Training prompts come as one stream over epochs: epoch e is a permutation of the training
rows seeded by (seed, e) (or file order with shuffle=False). Stream position k is prompt k of the
run; actor i of N takes positions i, i+N, i+2N, ... (prompt_id_offset / prompt_id_stride), and
prompt_id = k, so ids never repeat across actors or epochs. The stream is a pure function of the
seed and the position, so an actor that skips the prompts it already completed (a restarted or
resumed actor does) continues where it was, mid-epoch.

Scoring. The episode is single-turn: the response (decoded up to the first stop id, special
tokens skipped) goes to the reward as verl calls it, reward(data_source, response,
ground_truth, extra_info). A reward that raises, hangs or returns a non-finite value gives 0 and
a counted reason (`rewards/`), reported in the episode's counters. Run episodes with
env_threads > 1 so a slow verifier holds up only its own episode. `is_correct` (evaluation)
means a score of at least 1.
"""
from __future__ import annotations

import itertools
import os
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from sao_actor_learner import core, disk_cache
from sao_actor_learner.models.hf_tokenizer import HFTokenizer
from sao_actor_learner.tasks.dataset_files import DatasetError, DatasetRow, read_dataset
from sao_actor_learner.tasks.registry import TaskSpec

EVAL_ID_BASE = 1 << 40   # held-out prompt i has prompt_id EVAL_ID_BASE + i; training ids below


class PromptRenderer:
    """Renders a dataset prompt into token ids (see the module docstring).

    Args:
      tokenizer: the model's tokenizer.
      apply_chat_template: None: when the tokenizer has a template; True: always (an error if
        it has none); False: plain text.
      chat_template_kwargs: keyword arguments for the template.
      system_prompt: a system message put before the prompt's messages ("" for none); with
        plain text it is put before the prompt, separated by a blank line.
      instruction_suffix: text appended to the last user message (or the string prompt).
    """

    def __init__(self, tokenizer: core.Tokenizer, apply_chat_template: Optional[bool] = None,
                 chat_template_kwargs: Optional[dict] = None, system_prompt: str = "",
                 instruction_suffix: str = ""):
        if apply_chat_template and not tokenizer.has_chat_template:
            raise ValueError("apply_chat_template=True but the model's tokenizer has no chat "
                             "template: drop --apply_chat_template (prompts are then plain text) "
                             "or use a model directory whose tokenizer_config.json has one")
        self.tokenizer = tokenizer
        self.chat = tokenizer.has_chat_template if apply_chat_template is None \
            else bool(apply_chat_template)
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.system_prompt = system_prompt
        self.instruction_suffix = instruction_suffix

    def messages(self, prompt) -> List[Dict[str, str]]:
        """The chat messages of a prompt, with the system prompt and suffix applied."""
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) \
            else [dict(m) for m in prompt]
        if self.instruction_suffix:
            users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
            if not users:
                raise ValueError("instruction_suffix is set but the prompt has no user message")
            msgs[users[-1]]["content"] += self.instruction_suffix
        if self.system_prompt and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def render(self, prompt) -> List[int]:
        """Token ids the model reads before its response."""
        msgs = self.messages(prompt)
        if self.chat:
            return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                      **self.template_kwargs)
        text = "\n\n".join(m["content"] for m in msgs)
        return self.tokenizer.encode(text, add_bos=True)

    def fingerprint(self) -> Optional[list]:
        """What the rendered ids depend on besides the prompts (for the start-up cache), or
        None when that cannot be told (a tokenizer not loaded from a directory)."""
        source = getattr(getattr(self.tokenizer, "hf", None), "name_or_path", "")
        if not isinstance(self.tokenizer, HFTokenizer) or not os.path.isdir(source):
            return None
        return [type(self.tokenizer.hf).__name__,
                disk_cache.directory_fingerprint(source, weights=False), self.chat,
                self.template_kwargs, self.system_prompt, self.instruction_suffix]

    def render_many(self, prompts: Sequence) -> List[List[int]]:
        """`render` of each prompt, tokenized together (one call into the tokenizer: 21k
        GSM8K prompts in ~1.5 s instead of ~2.5 s); raises when any prompt does not render,
        without saying which (`render` them one by one to find it)."""
        conversations = [self.messages(p) for p in prompts]
        if self.chat and isinstance(self.tokenizer, HFTokenizer):   # one batched call
            return self.tokenizer.apply_chat_template_batch(
                conversations, add_generation_prompt=True, **self.template_kwargs)
        if self.chat:
            return [self.tokenizer.apply_chat_template(m, add_generation_prompt=True,
                                                       **self.template_kwargs)
                    for m in conversations]
        return [self.tokenizer.encode("\n\n".join(m["content"] for m in msgs), add_bos=True)
                for msgs in conversations]


class DatasetEnvironment(core.Environment):
    """One single-turn episode: scores the response with the task's reward, then is done."""

    def __init__(self, task: "DatasetTask", prompt: core.Prompt):
        self._task = task
        self._prompt = prompt
        self._done = False

    def step(self, action_tokens: Sequence[int]) -> core.StepResult:
        if self._done:
            raise RuntimeError(f"prompt {self._prompt.prompt_id}: the episode is over (dataset "
                               "prompts are single-turn); make a new environment per episode")
        self._done = True
        score, counters = self._task.score(self._prompt, action_tokens)
        return core.StepResult(observation_tokens=[], reward=score, done=True,
                               info={"counters": counters})


class DatasetTask(core.Task):
    """Prompts from dataset files and a reward function (see the module docstring).

    Args:
      tokenizer: the model's tokenizer.
      train_files, eval_files: dataset files (.jsonl / .parquet).
      reward: a `rewards.Reward` (or anything with the same `__call__` and `close()`):
        reward(data_source, solution_str, ground_truth, extra_info) -> RewardResult. The task
        owns it: `close()` closes it.
      renderer: how prompts become ids (PromptRenderer over `tokenizer` by default).
      prompt_key, answer_key: the columns holding the prompt and the ground truth.
      max_prompt_length: longer prompts (in tokens) are left out and counted; 0: no limit.
      num_eval: held-out prompts (the first num_eval of eval_files, in order); 0: all.
      seed, shuffle: the training order.
      prompt_id_offset, prompt_id_stride: this actor's positions in the stream.
    """

    name = "dataset"

    def __init__(self, tokenizer: core.Tokenizer, train_files: Sequence[str],
                 eval_files: Sequence[str], reward, renderer: Optional[PromptRenderer] = None,
                 prompt_key: str = "prompt", answer_key: str = "reward_model.ground_truth",
                 max_prompt_length: int = 0, num_eval: int = 0, seed: int = 0,
                 shuffle: bool = True, prompt_id_offset: int = 0, prompt_id_stride: int = 1):
        if prompt_id_stride < 1 or prompt_id_offset < 0:
            raise ValueError(f"prompt_id_offset={prompt_id_offset}, prompt_id_stride="
                             f"{prompt_id_stride}: need offset >= 0 and stride >= 1")
        if max_prompt_length < 0 or num_eval < 0:
            raise ValueError(f"max_prompt_length={max_prompt_length}, num_eval={num_eval}: "
                             "must be >= 0")
        self.tokenizer = tokenizer
        self.reward = reward
        self.renderer = renderer or PromptRenderer(tokenizer)
        self.seed = seed
        self.shuffle = shuffle
        self.max_prompt_length = max_prompt_length
        self.stats: Dict[str, int] = {}
        self.prompt_cache_hits = 0   # splits whose ids came from the start-up cache
        self._train = self._load(train_files, "train", prompt_key, answer_key)
        evals = self._load(eval_files, "eval", prompt_key, answer_key)
        if num_eval:
            if num_eval > len(evals):
                raise DatasetError(f"num_eval={num_eval} but the eval files hold {len(evals)} "
                                   f"usable prompts ({', '.join(eval_files)}); lower --eval_size")
            evals = evals[:num_eval]
        self._eval = [self._prompt(row, ids, EVAL_ID_BASE + i)
                      for i, (row, ids) in enumerate(evals)]
        self._positions = itertools.count(prompt_id_offset, prompt_id_stride)
        self._lock = threading.Lock()
        self._orders: Dict[int, np.ndarray] = {}

    # Loading ---------------------------------------------------------------------------------
    def _load(self, files: Sequence[str], split: str, prompt_key: str,
              answer_key: str) -> List[Tuple[DatasetRow, Tuple[int, ...]]]:
        rows = read_dataset(files, prompt_key, answer_key)
        rendered = self._render_all(files, prompt_key, rows)
        kept: List[Tuple[DatasetRow, Tuple[int, ...]]] = []
        for row, ids in zip(rows, rendered):
            if self.max_prompt_length and len(ids) > self.max_prompt_length:
                continue
            kept.append((row, tuple(ids)))
        self.stats[f"{split}_rows"] = len(rows)
        self.stats[f"{split}_filtered_long"] = len(rows) - len(kept)
        if not kept:
            raise DatasetError(
                f"every {split} prompt of {', '.join(files)} is longer than max_prompt_length="
                f"{self.max_prompt_length} tokens; raise --max_prompt_length (and "
                "--max_sequence_length)")
        return kept

    def _render_all(self, files: Sequence[str], prompt_key: str,
                    rows: List[DatasetRow]) -> Sequence[Sequence[int]]:
        """Every row's ids: from the start-up cache, else rendered (and then cached)."""
        settings = self.renderer.fingerprint()
        key = None
        if settings is not None and disk_cache.cache_root() is not None:
            key = disk_cache.make_key("prompts", [[disk_cache.file_fingerprint(f) for f in files],
                                                  prompt_key, settings])
            cached = disk_cache.load_sequences("prompts", key, len(rows))
            if cached is not None:
                self.prompt_cache_hits += 1
                return cached
        try:
            rendered = self.renderer.render_many([row.prompt for row in rows])
        except Exception:   # some row does not render: one by one, to name it
            rendered = [self._render_row(row) for row in rows]
        if key is not None:
            disk_cache.save_sequences("prompts", key, rendered)
        return rendered

    def _render_row(self, row: DatasetRow) -> List[int]:
        try:
            return self.renderer.render(row.prompt)
        except Exception as e:   # a template that raises on this row's messages
            raise DatasetError(f"{row.file}: row {row.index}: the prompt does not render "
                               f"({e!r}); fix the row's messages") from None

    @staticmethod
    def _prompt(row: DatasetRow, ids: Tuple[int, ...], prompt_id: int) -> core.Prompt:
        text = row.prompt if isinstance(row.prompt, str) else row.prompt[-1]["content"]
        return core.Prompt(prompt_id=prompt_id, token_ids=ids, text=text, answer=row)

    # core.Task ---------------------------------------------------------------------------------
    @property
    def num_train(self) -> int:
        return len(self._train)

    def order(self, epoch: int) -> np.ndarray:
        """The training rows of epoch `epoch`, in the order they are used."""
        with self._lock:
            order = self._orders.get(epoch)
            if order is None:
                n = len(self._train)
                order = np.random.default_rng([self.seed, epoch]).permutation(n) \
                    if self.shuffle else np.arange(n)
                self._orders = {epoch: order}   # one epoch at a time is in use
        return order

    def prompt_at(self, position: int) -> core.Prompt:
        """The training prompt at stream position `position` (its prompt_id is the position)."""
        epoch, offset = divmod(position, len(self._train))
        row, ids = self._train[int(self.order(epoch)[offset])]
        return self._prompt(row, ids, position)

    def sample_prompt(self, rng=None) -> core.Prompt:
        """This actor's next training prompt (the stream is fixed by the seed; `rng` unused)."""
        with self._lock:
            position = next(self._positions)
        return self.prompt_at(position)

    def eval_prompts(self) -> List[core.Prompt]:
        return list(self._eval)

    def make_environment(self, prompt: core.Prompt) -> core.Environment:
        return DatasetEnvironment(self, prompt)

    def score(self, prompt: core.Prompt, completion_tokens: Sequence[int]
              ) -> Tuple[float, Dict[str, float]]:
        """(reward, counters) of a response: counters has reward_calls, reward_failed_<reason>
        for a failed call, and the reward's numeric metrics as reward_<name>."""
        row: DatasetRow = prompt.answer
        try:
            text = self.tokenizer.decode_response(completion_tokens)
        except ValueError:   # ids outside the tokenizer: a broken engine; the writer rejects it
            return 0.0, {"reward_calls": 1, "reward_failed_undecodable": 1}
        result = self.reward(row.data_source, text, row.ground_truth, row.extra_info)
        counters: Dict[str, float] = {"reward_calls": 1}
        if result.failure:
            counters[f"reward_failed_{result.failure}"] = 1
        for key, value in (result.metrics or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                counters[f"reward_{key}"] = float(value)
        return float(result.score), counters

    def is_correct(self, prompt: core.Prompt, completion_tokens: Sequence[int]) -> bool:
        return self.score(prompt, completion_tokens)[0] >= 1.0

    def close(self) -> None:
        self.reward.close()


def build_task(config, actor_id: int = 0, tokenizer=None) -> DatasetTask:
    """The dataset task of `config` for actor `actor_id` over the model's `tokenizer`, with the
    reward of --reward (its worker processes are closed if the files fail to load)."""
    from sao_actor_learner.rewards import make_reward
    renderer = PromptRenderer(tokenizer, config.apply_chat_template, config.template_kwargs,
                              config.system_prompt, config.instruction_suffix)
    reward = make_reward(config.reward, timeout_s=config.reward_timeout_s,
                         workers=config.reward_workers)
    try:
        return DatasetTask(tokenizer, config.train_files, config.eval_files, reward,
                           renderer=renderer, prompt_key=config.prompt_key,
                           answer_key=config.answer_key,
                           max_prompt_length=config.max_prompt_length,
                           num_eval=config.eval_size, seed=config.seed, shuffle=config.shuffle,
                           prompt_id_offset=actor_id, prompt_id_stride=config.num_actors)
    except BaseException:
        reward.close()
        raise


def check_options(config, fail) -> None:
    if not config.train_files:
        fail("task='dataset' needs --train_files=a.parquet[,b.jsonl] (training prompts)")
    if not config.eval_files:
        fail("task='dataset' needs --eval_files=test.parquet (held-out prompts, scored with "
             "the same reward)")
    if config.max_turns != 1:
        fail(f"max_turns={config.max_turns}: dataset prompts are single-turn; drop --max_turns")


TASK_SPEC = TaskSpec(
    name="dataset",
    description="Prompts from JSONL / parquet files in verl's schema (--train_files, "
                "--eval_files), rendered with the model's chat template, one turn, scored by "
                "--reward (gsm8k, exact, math_verify or a verl compute_score file) in worker "
                "processes with a timeout: the task for real models and real data.",
    build=build_task, check=check_options, exclusive_options=("train_files", "eval_files"),
    # The reward runs in the environment step: off the generation thread (env_threads).
    defaults=dict(max_sequence_length=512, max_new_tokens=128, max_turns=1,
                  env_threads="actor_batch"))
