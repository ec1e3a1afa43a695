"""programs/export_model.py (sao_actor_learner/export.py): a LoRA learner's checkpoint leaves as a
plain Hugging Face directory that transformers and vLLM load and that decodes greedily as the
learner's model does; what may not be exported or overwritten is refused, naming the file or
flag."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import hf_fixtures as fx
from sao_actor_learner import core
from sao_actor_learner.builder import assemble_learner, make_critic
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.engines.vllm_process import resolve_vllm_python
from sao_actor_learner.export import export_model
from sao_actor_learner.models import lora
from sao_actor_learner.models.checkpoint import load_policy, state_dict_to_buffers
from sao_actor_learner.models.model_dir import ModelDirError

pytest.importorskip("peft")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHATS = ["What is 3 plus 4?", "Tom has 5 apples and eats 2. How many are left?"]
NEW_TOKENS = 10


class _NoReplay(core.RolloutSource):
    def sample(self, n, timeout_s):
        return []

    def queue_size(self):
        return 0


def greedy(model, prompt, steps=NEW_TOKENS):
    """Greedy tokens by argmax of full forwards (no cache, no generate())."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(base model dir, run folder, the LoRA learner's policy, chat prompts): a learner with
    adapters moved away from zero, checkpointed by the learner's own code."""
    tmp = tmp_path_factory.mktemp("export")
    base = fx.tiny_qwen3(str(tmp / "base"))
    config = SAOConfig(batch_size=4, actor_batch=4, max_steps=5, model=base, lora_rank=4,
                       lora_alpha=8.0, kernel_backend="torch")
    policy, tokenizer = load_policy(base)
    critic = make_critic(config, policy)
    lora.prepare_learner_policy(policy, lora.LoraSpec.from_config(config), None, base)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in lora.adapted_layers(policy).values():
            w = layer.lora_B[lora.ADAPTER_NAME].weight
            w.copy_(0.5 * torch.randn(w.shape, generator=g))
    run = tmp / "run"
    learner = assemble_learner(config, policy, critic, _NoReplay(), publisher=None,
                               serialize=state_dict_to_buffers, tokenizer=tokenizer,
                               checkpoint_root=str(run / "checkpoints"), pad_id=tokenizer.pad_id)
    learner.version = 3
    learner.save_checkpoint()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    return base, str(run), policy, prompts


def test_the_export_loads_in_transformers_and_decodes_as_the_learners_model(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    base, run, policy, prompts = trained
    out = str(tmp_path / "export")
    record = export_model(run, out)
    assert record["step"] == 3 and record["model_dir"].endswith("step_000003")
    files = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json", "export.json"} <= files
    assert not {"adapter", "learner_state.pt", "manifest.json"} & files
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert not any("lora" in k or "base_layer" in k for k in model.state_dict())
    assert AutoTokenizer.from_pretrained(out, local_files_only=True).chat_template
    assert GenerationConfig.from_pretrained(out).eos_token_id
    base_model = load_policy(base)[0]
    policy.eval()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            theirs = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                    min_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
            torch.testing.assert_close(model(ids).logits, policy(ids).logits, atol=1e-5,
                                       rtol=1e-5)
            assert (model(ids).logits - base_model(ids).logits).abs().max() > 1e-2  # merged
        assert theirs == greedy(policy, prompt)


def test_an_export_is_replaced_but_someone_elses_folder_is_refused(trained, tmp_path):
    base, run, _, _ = trained
    out = str(tmp_path / "export")
    export_model(base, out)
    export_model(run, out)                                    # an earlier export: replaced
    with open(os.path.join(out, "export.json")) as f:
        assert json.load(f)["step"] == 3
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="--out_dir=.*did not make"):
        export_model(run, str(foreign))
    assert (foreign / "notes.txt").read_text() == "keep me"
    with pytest.raises(ConfigError, match="is \\(or holds\\) the source"):
        export_model(base, base)


@pytest.mark.parametrize("missing", ["generation_config.json", "chat_template.jinja"])
def test_a_source_without_chat_template_or_generation_config_is_refused(trained, tmp_path,
                                                                        missing):
    base = trained[0]
    source = str(tmp_path / "source")
    shutil.copytree(base, source)
    os.remove(os.path.join(source, missing))
    if missing == "chat_template.jinja":     # the template may also sit in tokenizer_config
        path = os.path.join(source, "tokenizer_config.json")
        with open(path) as f:
            config = json.load(f)
        config.pop("chat_template", None)
        with open(path, "w") as f:
            json.dump(config, f)
    with pytest.raises(ModelDirError, match=missing):
        export_model(source, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_the_program_exports_and_refuses_naming_the_flag(trained, tmp_path):
    base, run, _, _ = trained
    script = os.path.join(REPO, "programs", "export_model.py")
    env = {**os.environ, "PYTHONPATH": REPO}
    out = str(tmp_path / "export")
    proc = subprocess.run([sys.executable, script, f"--model={run}", f"--out_dir={out}",
                           "--dtype=bfloat16"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["dtype"] == "bfloat16"
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    proc = subprocess.run([sys.executable, script, f"--model={run}", f"--out_dir={REPO}"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0 and "--out_dir=" in proc.stderr


@pytest.mark.skipif(not os.path.exists(resolve_vllm_python()),
                    reason=f"no vLLM environment at {resolve_vllm_python()}: `make vllm-env`")
@pytest.mark.timeout(900)
def test_vllm_serves_the_export_and_decodes_its_greedy_tokens(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    from sao_actor_learner.engines import VLLMEngine
    _, run, _, prompts = trained
    out = str(tmp_path / "export")
    export_model(run, out)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    engine = VLLMEngine.from_checkpoint(out, version=0, start_timeout_s=600,
                                        log_path=str(tmp_path / "vllm_server.log"))
    try:
        params = core.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
        gens = engine.generate(prompts, params)
    finally:
        engine.close()
    for prompt, gen in zip(prompts, gens):
        expected = greedy(model, prompt, len(gen.tokens))
        assert list(gen.tokens) == expected
