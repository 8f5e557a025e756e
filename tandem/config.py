"""Model and engine configuration."""
import os
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k before RoPE
    eos_token_ids: list[int]
    bos_token_id: int | None
    dtype: torch.dtype | None  # what the checkpoint says, if it says

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else cfg.get("model_type", "<missing>")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; tandem supports "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "llama3":
            raise ValueError(f"unsupported rope_scaling {scaling!r}; only llama3-style scaling is")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        max_pos = cfg.get("max_position_embeddings", 4096)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if window and window < max_pos:
            # Without sliding-window attention, cap the context so semantics stay exact.
            max_pos = window
        dtype = cfg.get("dtype") or cfg.get("torch_dtype")
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            dtype=_DTYPES.get(str(dtype).replace("torch.", "")) if dtype else None,
        )


def resolve_dtype(name: str, device: torch.device, model_dtype: torch.dtype | None) -> torch.dtype:
    """`auto` is float32 on the CPU (fast and exact there) and the checkpoint's 16-bit type on CUDA."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of auto, cpu, cuda; got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


@dataclass
class EngineConfig:
    """Knobs of the engine; defaults suit a single GPU or a small CPU run."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    dummy_weights: bool = False
    allow_pickle: bool = False
    disable_overlap: bool = False
    max_total_tokens: int | None = None  # KV pool size in tokens; None sizes from memory
    gpu_memory_utilization: float = 0.85  # fraction of free CUDA memory for weights' leftovers
    cpu_kv_cache_bytes: int = 1 << 30  # KV budget on the CPU
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192  # per-step token budget for prefill chunks
    chunked_prefill_size: int | None = 4096  # split prompts longer than this; None: never
    enable_mixed_batch: bool = False  # put prefill chunks and decodes in one forward
    enable_prefix_caching: bool = True  # reuse the KV of cached prompt prefixes (radix tree)
    schedule_policy: str = "fcfs"  # fcfs, or lpm: longest cached prefix first
    process_before_consecutive_prefill: bool = False  # better first-batch TTFT, lower throughput
    coarse_war_barrier: bool = False  # wait_stream(forward) instead of the fine-grained event
    attention_backend: str = "auto"
    # Split-K decode attention: each row picks its split count from its own length (on the
    # device); off spreads every row over the grid's splits, sized for the longest context.
    attention_split_by_context: bool = True
    cuda_graph: str = "auto"  # auto (on with CUDA + Triton), on, off: decode steps replay graphs
    cuda_graph_max_batch: int = 256
    warm_up: str = "auto"  # auto (on with CUDA), on, off: run every kernel shape class at start
    # Weight-streaming Triton GEMMs for <= 16 rows, tuned per shape at startup (CUDA only):
    # auto (on with CUDA), off (cuBLAS everywhere).
    small_m_gemm: str = "auto"
    quantization: str | None = None  # "fp8": per-channel e4m3 weights, quantized at load
    max_model_len: int | None = None
    seed: int = 0
    # Tensor parallelism: one process per rank (rank 0 is this one). Several nodes: start the
    # same command on each with its node_rank; rank 0's node hosts the rendezvous.
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one node only)
    dist_timeout_s: float = 600.0  # start-up rendezvous and collective timeout
    # FutureMap read-before-write check on the device; the test suite turns it on via the env.
    debug_future_map: bool = field(default_factory=lambda: os.environ.get("TANDEM_DEBUG_FUTURE_MAP") == "1")
    # Prefix-cache books checked after every step (reference counts, slot owners); tests' env.
    debug_prefix_cache: bool = field(default_factory=lambda: os.environ.get("TANDEM_DEBUG_PREFIX_CACHE") == "1")
    timeline: bool = False  # record per-step host and device times (CUDA events)
    timeline_path: str | None = None  # also write each step as a JSON line here
    timeline_max_records: int | None = None  # keep at most this many steps in memory (servers)
    grammar_threads: int = 2  # threads compiling grammars and filling token masks
    grammar_overlap: bool = True  # fill token masks while the forward runs (off: before it is queued)
    extra: dict = field(default_factory=dict)
