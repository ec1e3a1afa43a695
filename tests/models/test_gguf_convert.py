"""GGUF files that cannot be converted (models/gguf_convert.py) fail naming the file and what is
missing. The files are written here with the `gguf` package's own writer (metadata and a few
small float32 tensors; no model is loaded). The conversion of the real SmolLM2 file is tested in
tests/models/test_real_model.py."""
import json

import numpy as np
import pytest

from sao_actor_learner.models.gguf_convert import (GGUFConversionError, check_gguf_file,
                                                   find_gguf_file, generation_config_of,
                                                   plain_config_dict)

gguf = pytest.importorskip("gguf", reason="the gguf extra: pip install -e '.[gguf]'")


def write_gguf(path, arch="llama", tokens=("<unk>", "a", "b"), embedding=True):
    """A small GGUF file: architecture `arch`, a gpt2 tokenizer with `tokens` (None: none), a
    token embedding (or not) and one norm weight."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if tokens is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(list(tokens))
    if embedding:
        writer.add_tensor("token_embd.weight", np.zeros((3, 8), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_complete_header_is_accepted(tmp_path):
    path = write_gguf(tmp_path / "ok.gguf")
    assert check_gguf_file(path) == {"architecture": "llama", "tensors": 2,
                                     "has_chat_template": False}
    assert find_gguf_file(str(tmp_path)) == path    # the one .gguf of a directory


@pytest.mark.parametrize("content, expected", [
    (b"", "not a GGUF file: it is empty"),
    (b'{"model_type": "llama"}', "not a GGUF file: it starts with b'{\"mo'"),
])
def test_files_that_are_not_gguf(tmp_path, content, expected):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFConversionError, match=f"{path}: ") as e:
        check_gguf_file(str(path))
    assert expected in str(e.value)


def test_a_truncated_file_names_the_damage(tmp_path):
    good = write_gguf(tmp_path / "full.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(good, "rb").read()[:40])
    with pytest.raises(GGUFConversionError, match="cut.gguf: the GGUF header does not parse"):
        check_gguf_file(str(cut))


def test_a_file_without_a_tokenizer_names_the_missing_keys(tmp_path):
    path = write_gguf(tmp_path / "notok.gguf", tokens=None)
    with pytest.raises(GGUFConversionError) as e:
        check_gguf_file(path)
    message = str(e.value)
    assert message.startswith(path) and "tokenizer.ggml.model (the tokenizer type)" in message
    assert "tokenizer.ggml.tokens (the tokenizer vocabulary)" in message
    assert "general.architecture" not in message


def test_a_file_without_the_token_embedding(tmp_path):
    path = write_gguf(tmp_path / "noemb.gguf", embedding=False)
    with pytest.raises(GGUFConversionError, match="noemb.gguf: the file holds no "
                                                  r"token_embd.weight tensor \(the token "
                                                  r"embedding; 1 tensors found\)"):
        check_gguf_file(path)


def test_directories_without_exactly_one_gguf_file(tmp_path):
    with pytest.raises(GGUFConversionError, match="holds no \\*.gguf file"):
        find_gguf_file(str(tmp_path))
    write_gguf(tmp_path / "a.gguf")
    write_gguf(tmp_path / "b.gguf")
    with pytest.raises(GGUFConversionError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\)"):
        find_gguf_file(str(tmp_path))
    with pytest.raises(GGUFConversionError, match="no such file or directory"):
        find_gguf_file(str(tmp_path / "missing"))


def test_an_architecture_transformers_cannot_load_is_named(tmp_path):
    from sao_actor_learner.models.gguf_convert import convert_gguf
    path = write_gguf(tmp_path / "bert.gguf", arch="bert")
    out = tmp_path / "out"
    with pytest.raises(GGUFConversionError, match="bert.gguf: transformers cannot load it: .*bert"):
        convert_gguf(path, str(out))
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_the_plain_config_drops_the_gguf_bookkeeping():
    cfg = {"model_type": "llama", "vocab_size": 3, "_model_name_or_path": "Smollm2",
           "quantization_config": {"quant_method": "gguf", "gguf_file": "x.gguf"}}
    assert plain_config_dict(cfg) == {"model_type": "llama", "vocab_size": 3}
    json.dumps(plain_config_dict(cfg))


def test_generation_ids_need_an_eos():
    class Tok:
        bos_token_id, eos_token_id, pad_token_id = 1, None, None

    class Config:
        bos_token_id, eos_token_id, pad_token_id = 1, 2, None

    assert generation_config_of(Tok(), Config()) == {"bos_token_id": 1, "eos_token_id": 2}
    Config.eos_token_id = None
    with pytest.raises(GGUFConversionError, match="names no eos token"):
        generation_config_of(Tok(), Config())


def test_a_folder_this_project_did_not_make_is_never_replaced(tmp_path):
    from sao_actor_learner.config import ConfigError
    from sao_actor_learner.models.gguf_convert import convert_gguf
    from sao_actor_learner.run_dirs import mark_owned
    mine = tmp_path / "my_models"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="--out_dir: .* a folder this project did not make"):
        convert_gguf(str(tmp_path / "missing.gguf"), str(mine))
    assert (mine / "notes.txt").read_text() == "mine"
    mark_owned(str(mine))                            # an earlier conversion: may be replaced,
    with pytest.raises(GGUFConversionError, match="no such file"):   # so the GGUF is read next
        convert_gguf(str(tmp_path / "missing.gguf"), str(mine))
