"""Model shapes for benchmarks with dummy weights (config.json only, written to a temp dir)."""
import json
import tempfile
from pathlib import Path
from typing import Any

PRESETS = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "eos_token_id": 151645,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "torch_dtype": "bfloat16", "eos_token_id": 128001,
    },
    "llama-3.1-70b": {  # too big for one H200 in bf16: tensor_parallel_size >= 2
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "torch_dtype": "bfloat16", "eos_token_id": 128001,
    },
    "smollm2-135m": {  # the built-in model's shape
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "eos_token_id": 2,
    },
    "tiny": {  # for CPU runs of the harness
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True, "eos_token_id": 2,
    },
}


def preset_dir(name: str, tokenizer: Any = None) -> str:
    """A directory holding the preset's config.json (use with dummy_weights=True). With a
    tokenizer, the config takes its vocabulary and EOS and the tokenizer is saved beside it: the
    engine then detokenizes, stops and templates as it does for a user."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    if tokenizer is not None:
        cfg = {**cfg, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id}
    path = Path(tempfile.mkdtemp(prefix=f"tandem-{name}-"))
    (path / "config.json").write_text(json.dumps(cfg))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return str(path)


def load_tokenizer(path: str | None) -> Any:
    """A saved HF tokenizer directory's tokenizer, or the built-in model's (from its GGUF)."""
    if path:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    from tandem.models.checkpoint import builtin_model_path, open_checkpoint
    return open_checkpoint(builtin_model_path(), config_only=True).load_tokenizer()
