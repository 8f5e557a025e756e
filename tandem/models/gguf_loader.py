"""Read llama.cpp GGUF files as HF-named float32 tensors plus an HF-style config.

Only the dense decoder families the engine runs (llama, qwen2, qwen3) are
accepted; everything is validated when the file is opened so a bad file fails
before any weight is dequantized.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
)

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# llama.cpp stores precomputed llama3 rope factors as a tensor, not as metadata.
ROPE_FREQS = "rope_freqs.weight"

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_TOP_NAME = re.compile(r"(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The transformers parameter name for a GGUF tensor name, or None if unknown."""
    if m := _LAYER_NAME.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        if part in _PER_LAYER:
            return f"model.layers.{layer}.{_PER_LAYER[part]}.{kind}"
        return None
    if (m := _TOP_NAME.fullmatch(gguf_name)) and m.group(1) in _TOP_LEVEL:
        return f"{_TOP_LEVEL[m.group(1)]}.{m.group(2)}"
    return None


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (it converts HF's half-split rotary
    layout to interleaved pairs). Works for weights (rows, cols) and biases (rows,)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rows over {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's own permutation (convert_hf_to_gguf.py); the inverse of unpermute_rotary."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """An opened, validated GGUF file: metadata, config, and lazy tensors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._reader = GGUFReader(path)
        except Exception as e:  # gguf raises bare ValueError/struct errors on junk
            raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
        self.arch = self._get("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"{path}: GGUF architecture {self.arch!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._validate_tensors()
        self.config = self._build_config()

    # -- metadata ---------------------------------------------------------

    def _get(self, key: str, default: Any = ...) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            if default is ...:
                raise ValueError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        return field.contents()

    def _arch_get(self, key: str, default: Any = ...) -> Any:
        return self._get(f"{self.arch}.{key}", default)

    def _validate_tensors(self) -> None:
        unknown = [n for n in self._tensors if n != ROPE_FREQS and hf_tensor_name(n) is None]
        if unknown:
            raise ValueError(f"{self.path}: unknown GGUF tensors {unknown[:8]} ({len(unknown)} in all)")
        for name, t in self._tensors.items():
            if t.tensor_type not in SUPPORTED_TYPES:
                raise ValueError(
                    f"{self.path}: tensor {name!r} has unsupported type {t.tensor_type.name} "
                    f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
                )
        if "token_embd.weight" not in self._tensors:
            raise ValueError(f"{self.path}: GGUF file has no token_embd.weight tensor")

    def _rows(self, name: str) -> int | None:
        t = self._tensors.get(name)
        # GGUF shapes are listed innermost first; rows are the last entry.
        return int(t.shape[-1]) if t is not None else None

    def _build_config(self) -> dict[str, Any]:
        n_heads = int(self._arch_get("attention.head_count"))
        n_kv = int(self._arch_get("attention.head_count_kv", n_heads))
        hidden = int(self._arch_get("embedding_length"))
        k_rows = self._rows("blk.0.attn_k.weight")
        head_dim = self._arch_get("attention.key_length", None)
        if head_dim is None:
            head_dim = k_rows // n_kv if k_rows else hidden // n_heads
        rope_theta = float(self._arch_get("rope.freq_base", 10000.0))
        tokens = self._get("tokenizer.ggml.tokens", None)
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "hidden_size": hidden,
            "intermediate_size": int(self._arch_get("feed_forward_length")),
            "num_hidden_layers": int(self._arch_get("block_count")),
            "num_attention_heads": n_heads,
            "num_key_value_heads": n_kv,
            "head_dim": int(head_dim),
            # The embedding's row count is the vocabulary the model was built with;
            # llama.cpp pads the token list to it, so both agree on sane files.
            "vocab_size": self._rows("token_embd.weight") or len(tokens),
            "max_position_embeddings": int(self._arch_get("context_length")),
            "rms_norm_eps": float(self._arch_get("attention.layer_norm_rms_epsilon")),
            "rope_theta": rope_theta,
            "rope_scaling": self._rope_scaling(rope_theta, int(head_dim)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "hidden_act": "silu",
        }
        for key in ("bos", "eos", "padding"):
            value = self._get(f"tokenizer.ggml.{key}_token_id", None)
            if value is not None:
                config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(value)
        return config

    def _rope_scaling(self, rope_theta: float, head_dim: int) -> dict[str, Any] | None:
        if ROPE_FREQS in self._tensors:
            factors = dequantize(self._tensors[ROPE_FREQS].data, self._tensors[ROPE_FREQS].tensor_type)
            return llama3_scaling_from_factors(np.asarray(factors, dtype=np.float64), rope_theta, head_dim, self.path)
        kind = self._arch_get("rope.scaling.type", None)
        if kind in (None, "none"):
            return None
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(self._arch_get("rope.scaling.factor", 1.0))}
        orig = self._arch_get("rope.scaling.original_context_length", None)
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        return scaling

    # -- tensors ----------------------------------------------------------

    def tensor_names(self) -> list[str]:
        return [hf_tensor_name(n) for n in self._tensors if n != ROPE_FREQS]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._tensors.items():
            if name == ROPE_FREQS:
                continue
            yield hf_tensor_name(name), torch.from_numpy(self._load(name, t))

    def _load(self, name: str, t: ReaderTensor) -> np.ndarray:
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # copies off the mmap
        expected = tuple(int(d) for d in reversed(t.shape))
        if w.shape != expected:
            w = w.reshape(expected)
        if self.arch == "llama":
            # Only llama.cpp's llama converter permutes q/k; qwen2/qwen3 keep HF's layout.
            if ".attn_q." in name:
                w = unpermute_rotary(w, self.config["num_attention_heads"])
            elif ".attn_k." in name:
                w = unpermute_rotary(w, self.config["num_key_value_heads"])
        return np.ascontiguousarray(w)

    # -- tokenizer --------------------------------------------------------

    def load_tokenizer(self) -> Any:
        if self._get("tokenizer.ggml.tokens", None) is None:
            return None
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        template = self._get("tokenizer.chat_template", None)
        if template is not None and not getattr(tok, "chat_template", None):
            tok.chat_template = template
        return tok


def llama3_rope_factors(
    rope_theta: float, head_dim: int, factor: float, low: float, high: float, original: float
) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as rope_freqs.weight."""
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, medium))


def llama3_scaling_from_factors(
    factors: np.ndarray, rope_theta: float, head_dim: int, path: Path | str
) -> dict[str, Any] | None:
    """Recover HF's llama3 rope_scaling dict from llama.cpp's rope_freqs tensor.

    The factors depend on (original, low, high) only through the line
    smooth = original/(high-low) / wavelen - low/(high-low), so fixing
    low_freq_factor=1 (what Llama 3.x uses) makes the recovery exact.
    """
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    wavelen = 2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    medium = (factors > 1.0 + 1e-4) & (factors < factor * (1 - 1e-4))
    if medium.sum() >= 2:
        smooth = (1.0 / factors[medium] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(1.0 / wavelen[medium], smooth, 1)
        low, high, original = 1.0, 1.0 - 1.0 / intercept, -slope / intercept
    else:  # not identifiable from the tensor: try Meta's published defaults
        low, high, original = 1.0, 4.0, 8192.0
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": round(float(high), 4),
        "original_max_position_embeddings": int(round(original)),
    }
    rebuilt = llama3_rope_factors(rope_theta, head_dim, factor, low, scaling["high_freq_factor"],
                                  scaling["original_max_position_embeddings"])
    if not np.allclose(rebuilt, factors, rtol=1e-3):
        raise ValueError(f"{path}: tensor {ROPE_FREQS!r} does not match any llama3 rope scaling")
    return scaling
