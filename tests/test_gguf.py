"""GGUF loading: tiny synthetic files written with gguf.GGUFWriter, and the built-in model
checked against transformers' own GGUF loader."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tandem.models.checkpoint import builtin_model_path, open_checkpoint
from tandem.models.gguf_loader import llama3_rope_factors, unpermute_rotary

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB = 256, 4, 2, 64, 32
HEAD_DIM = HIDDEN // HEADS


def tiny_tensors(
    rng: np.random.Generator,
    *,
    layers: int = 1,
    head_dim: int = HEAD_DIM,
    tied: bool = True,
    qkv_bias: bool = False,
    qk_norm: bool = False,
) -> dict[str, np.ndarray]:
    """GGUF-named float32 tensors of a tiny decoder, numpy (rows, cols) order."""

    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    t = {"token_embd.weight": r(VOCAB, HIDDEN), "output_norm.weight": r(HIDDEN)}
    if not tied:
        t["output.weight"] = r(VOCAB, HIDDEN)
    for i in range(layers):
        b = f"blk.{i}."
        t |= {
            b + "attn_norm.weight": r(HIDDEN),
            b + "attn_q.weight": r(HEADS * head_dim, HIDDEN),
            b + "attn_k.weight": r(KV_HEADS * head_dim, HIDDEN),
            b + "attn_v.weight": r(KV_HEADS * head_dim, HIDDEN),
            b + "attn_output.weight": r(HIDDEN, HEADS * head_dim),
            b + "ffn_norm.weight": r(HIDDEN),
            b + "ffn_gate.weight": r(INTER, HIDDEN),
            b + "ffn_up.weight": r(INTER, HIDDEN),
            b + "ffn_down.weight": r(HIDDEN, INTER),
        }
        if qkv_bias:
            t |= {b + f"attn_{x}.bias": r(n * head_dim) for x, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
        if qk_norm:
            t |= {b + "attn_q_norm.weight": r(head_dim), b + "attn_k_norm.weight": r(head_dim)}
    return t


def write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, np.ndarray],
    *,
    layers: int = 1,
    raw: dict[str, tuple[np.ndarray, Q]] | None = None,
    key_length: int | None = None,
) -> Path:
    """Write tensors (float32, or raw bytes with their GGML type) plus llama.cpp-style metadata."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(50000.0)
    if key_length is not None:
        w.add_key_length(key_length)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    for name, (data, qtype) in (raw or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    ck = open_checkpoint(path)
    return ck.config, dict(ck.tensors())


def k_quant_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random k-quant blocks (gguf-py cannot quantize these) with sane fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    # fp16 fields: Q4_K/Q5_K start with d, dmin; Q6_K ends with d.
    if qtype == Q.Q6_K:
        data[..., -2:] = scale
    else:
        data[..., 0:2] = scale
        data[..., 2:4] = scale
    return data.reshape(rows, -1)


QUANTIZABLE = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]
# Worst-case error of each format on standard normal data (row max ~3.5).
TOLERANCE = {"F32": 0, "F16": 2e-3, "BF16": 2e-2, "Q8_0": 3e-2, "Q4_0": 0.5, "Q4_1": 0.35}


@pytest.mark.parametrize("type_name", QUANTIZABLE + K_QUANTS)
def test_each_supported_type_dequantizes_to_float32(tmp_path: Path, type_name: str) -> None:
    rng = np.random.default_rng(0)
    qtype = Q[type_name]
    tensors = tiny_tensors(rng)
    target = "blk.0.ffn_up.weight"
    original = tensors.pop(target)
    if type_name in K_QUANTS:
        data = k_quant_blocks(rng, qtype, *original.shape)
    else:
        data = gguf.quants.quantize(original, qtype)
    path = write_gguf(tmp_path / "m.gguf", "qwen2", tensors, raw={target: (data, qtype)})

    _, ours = load(path)
    got = ours["model.layers.0.mlp.up_proj.weight"]
    assert got.dtype == torch.float32 and tuple(got.shape) == original.shape
    expected = gguf.quants.dequantize(data, qtype).reshape(original.shape)
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32)))
    if type_name in TOLERANCE:
        assert np.abs(got.numpy() - original).max() <= TOLERANCE[type_name]
    else:
        assert torch.isfinite(got).all() and got.abs().max() > 0


def test_unpermute_inverts_llama_cpp_layout() -> None:
    # One head of dim 4: HF keeps rotary halves [x0 x1 | y0 y1]; llama.cpp interleaves them.
    interleaved = np.array([[0.0], [2.0], [1.0], [3.0]])  # rows x0 y0 x1 y1
    assert unpermute_rotary(interleaved, n_head=1)[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    bias = np.array([0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0])
    assert unpermute_rotary(bias, n_head=2).tolist() == list(range(8))


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # Verbatim from llama.cpp's convert_hf_to_gguf.py LlamaModel.permute.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_llama_q_and_k_are_unpermuted(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    hf = tiny_tensors(rng, qkv_bias=True)
    stored = dict(hf)
    for suffix in ("weight", "bias"):
        stored[f"blk.0.attn_q.{suffix}"] = llama_cpp_permute(hf[f"blk.0.attn_q.{suffix}"], HEADS)
        stored[f"blk.0.attn_k.{suffix}"] = llama_cpp_permute(hf[f"blk.0.attn_k.{suffix}"], KV_HEADS)
    config, ours = load(write_gguf(tmp_path / "llama.gguf", "llama", stored))

    assert config["architectures"] == ["LlamaForCausalLM"] and config["attention_bias"] is True
    for x in "qk":
        for suffix in ("weight", "bias"):
            assert torch.equal(ours[f"model.layers.0.self_attn.{x}_proj.{suffix}"],
                               torch.from_numpy(hf[f"blk.0.attn_{x}.{suffix}"]))
    # v is never permuted.
    assert torch.equal(ours["model.layers.0.self_attn.v_proj.weight"], torch.from_numpy(hf["blk.0.attn_v.weight"]))


def test_qwen2_is_not_permuted_and_keeps_biases(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    t = tiny_tensors(rng, qkv_bias=True, tied=False)
    config, ours = load(write_gguf(tmp_path / "qwen2.gguf", "qwen2", t))
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert torch.equal(ours["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(t["blk.0.attn_q.weight"]))
    assert torch.equal(ours["model.layers.0.self_attn.k_proj.bias"], torch.from_numpy(t["blk.0.attn_k.bias"]))


def test_qwen3_norms_and_head_dim_from_key_length(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    head_dim = 128  # differs from hidden / heads = 64, as in real Qwen3 models
    t = tiny_tensors(rng, head_dim=head_dim, qk_norm=True, layers=2)
    config, ours = load(write_gguf(tmp_path / "qwen3.gguf", "qwen3", t, layers=2, key_length=head_dim))
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == head_dim
    assert torch.equal(ours["model.layers.1.self_attn.q_norm.weight"], torch.from_numpy(t["blk.1.attn_q_norm.weight"]))
    assert torch.equal(ours["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(t["blk.0.attn_q.weight"]))
    assert len(ours) == len(t)


def test_config_from_metadata(tmp_path: Path) -> None:
    config, _ = load(write_gguf(tmp_path / "m.gguf", "llama", tiny_tensors(np.random.default_rng(4), layers=2), layers=2))
    expected = {
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": 2,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "vocab_size": VOCAB, "max_position_embeddings": 512, "rope_theta": 50000.0, "rope_scaling": None,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True, "attention_bias": False,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["rms_norm_eps"] == pytest.approx(1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_output(tmp_path: Path, tied: bool) -> None:
    t = tiny_tensors(np.random.default_rng(5), tied=tied)
    config, ours = load(write_gguf(tmp_path / "m.gguf", "llama", t))
    assert config["tie_word_embeddings"] is tied
    assert ("lm_head.weight" in ours) is not tied
    if not tied:
        assert torch.equal(ours["lm_head.weight"], torch.from_numpy(t["output.weight"]))


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path: Path) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    theta, head_dim = 500000.0, 128
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

    def inv_freq(rope_scaling: dict | None) -> torch.Tensor:
        # LlamaConfig edits the dict it is given, so hand it a copy.
        cfg = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, max_position_embeddings=131072,
                          rope_theta=theta, rope_scaling=dict(rope_scaling) if rope_scaling else None)
        return LlamaRotaryEmbedding(config=cfg).inv_freq.double()

    # llama.cpp divides the base frequencies by rope_freqs; build it from transformers' own llama3 rope.
    factors = (inv_freq(None) / inv_freq(scaling)).float().numpy()
    assert np.allclose(factors, llama3_rope_factors(theta, head_dim, 8.0, 1.0, 4.0, 8192), rtol=1e-5)
    w = gguf.GGUFWriter(str(tmp_path / "l3.gguf"), "llama")
    w.add_rope_freq_base(theta)
    w.add_key_length(head_dim)
    for key, value in [("block_count", 0), ("context_length", 131072), ("embedding_length", HIDDEN),
                       ("feed_forward_length", INTER), ("attention.head_count", HEADS)]:
        w.add_uint32(f"llama.{key}", value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), np.float32))
    w.add_tensor("rope_freqs.weight", factors)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()

    config, ours = load(tmp_path / "l3.gguf")
    assert config["rope_scaling"] == scaling
    assert set(ours) == {"model.embed_tokens.weight"}  # rope_freqs is config, not a parameter
    assert torch.allclose(inv_freq(config["rope_scaling"]), inv_freq(scaling), rtol=1e-6)


def test_unknown_tensor_is_an_error_naming_it(tmp_path: Path) -> None:
    t = tiny_tensors(np.random.default_rng(6)) | {"blk.0.ffn_gate_exps.weight": np.zeros((4, HIDDEN), np.float32)}
    path = write_gguf(tmp_path / "m.gguf", "llama", t)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate_exps\.weight"):
        open_checkpoint(path)


def test_unsupported_type_is_an_error_naming_tensor_and_type(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    t = tiny_tensors(rng)
    up = t.pop("blk.0.ffn_up.weight")
    path = write_gguf(tmp_path / "m.gguf", "llama", t, raw={"blk.0.ffn_up.weight": (gguf.quants.quantize(up, Q.Q5_0), Q.Q5_0)})
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*Q5_0"):
        open_checkpoint(path)


def test_unsupported_architecture_and_junk_file(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "gemma2", tiny_tensors(np.random.default_rng(8)))
    with pytest.raises(ValueError, match="gemma2"):
        open_checkpoint(path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="junk.gguf"):
        open_checkpoint(junk)


def test_no_token_list_means_no_tokenizer(tmp_path: Path) -> None:
    ck = open_checkpoint(write_gguf(tmp_path / "m.gguf", "llama", tiny_tensors(np.random.default_rng(9))))
    assert ck.load_tokenizer() is None


# -- the built-in model against transformers ----------------------------------


@pytest.fixture(scope="module")
def builtin() -> Path:
    return builtin_model_path()


@pytest.fixture(scope="module")
def builtin_ck(builtin: Path):
    # Opening parses ~100k tokenizer strings from the metadata: do it once.
    return open_checkpoint(builtin)


def test_builtin_config_matches_transformers(builtin: Path, builtin_ck) -> None:
    from transformers import AutoConfig

    ours = builtin_ck.config
    theirs = AutoConfig.from_pretrained(str(builtin.parent), gguf_file=builtin.name)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert ours[key] == getattr(theirs, key), key
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"]
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["rope_scaling"] is None


def test_builtin_tokenizer_and_chat_template(builtin_ck) -> None:
    tok = builtin_ck.load_tokenizer()
    assert tok("Once upon a time")["input_ids"] == [6403, 1980, 253, 655]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_builtin_tensors_equal_transformers(builtin: Path, builtin_ck) -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF models")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(builtin.parent), gguf_file=builtin.name, dtype=torch.float32)
    theirs = model.state_dict()
    ours = dict(builtin_ck.tensors())
    # Tied: transformers reports lm_head as an alias of the embedding; we omit it.
    assert set(theirs) - set(ours) == {"lm_head.weight"} and set(ours) <= set(theirs)
    assert theirs["lm_head.weight"].data_ptr() == theirs["model.embed_tokens.weight"].data_ptr()
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, theirs[name]), name
