"""Tiny random transformers checkpoints of each supported family, saved as HF directories."""
import os
from pathlib import Path

import torch
import transformers

# The engine tests run on the CPU in CI and on CUDA through the device tool.
TEST_DEVICE = os.environ.get("TANDEM_TEST_DEVICE", "cpu")

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# Each variant covers shape features: GQA ratios incl. one KV head, head_dim != hidden/heads,
# tied and untied embeddings, llama3 RoPE scaling, qkv bias (Qwen2), q/k norm (Qwen3).
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama-mqa-headdim-llama3rope-tied": ("LlamaConfig", "LlamaForCausalLM",
                                         dict(num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                                              rope_parameters=LLAMA3_ROPE)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(num_key_value_heads=1, sliding_window=None, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, num_attention_heads=4,
                                                     num_key_value_heads=2, tie_word_embeddings=False)),
}


def make_tiny_model(root: Path, variant: str, seed: int = 0, **overrides) -> Path:
    config_cls, model_cls, extra = VARIANTS[variant]
    cfg = getattr(transformers, config_cls)(**{**BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).to(torch.float32).eval()
    path = root / variant
    model.save_pretrained(path)
    return path


def load_hf(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_cycling_model(root: Path, cycle: int = 5, sharpness: float = 1.0, layer_scale: float = 0.3,
                       seed: int = 0, **overrides) -> Path:
    """A tiny Llama whose next token mostly follows a fixed permutation made of cycles of
    `cycle` tokens, so its outputs repeat and n-gram proposals are often right (speculative
    decoding's accepted runs). The layers still count, scaled by `layer_scale`: a wrong KV
    entry or position changes the logits. `sharpness` scales the permutation's logit gap
    (about 8 x sharpness): low values make sampling at temperature 1 a real draw."""
    config_cls, model_cls, extra = VARIANTS["llama"]
    cfg = getattr(transformers, config_cls)(**{**BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).to(torch.float32).eval()
    vocab = cfg.vocab_size
    with torch.no_grad():
        embed = torch.randn(vocab, cfg.hidden_size)
        model.model.embed_tokens.weight.copy_(embed)
        nxt = torch.arange(vocab)
        for start in range(0, vocab - cycle + 1, cycle):  # t -> t + 1 within each block of `cycle`
            nxt[start:start + cycle] = torch.roll(torch.arange(start, start + cycle), -1)
        head = torch.empty_like(embed)
        head[nxt] = embed  # logits[v] ~ e_t . e_{t'} with nxt[t'] = v: largest at v = nxt[t]
        model.lm_head.weight.copy_(head * sharpness / cfg.hidden_size ** 0.5)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(layer_scale)
            layer.mlp.down_proj.weight.mul_(layer_scale)
    path = root / f"cycling-{cycle}-{sharpness}-{vocab}"
    model.save_pretrained(path)
    return path
