"""One decoder for the Llama family: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Read top to bottom: attention, layer, model, then weight loading. Parameter names follow
transformers, except that q/k/v and gate/up are packed into one matmul each. Under tensor
parallelism (`tp`) each rank builds the same modules with its share of heads, intermediate
size and vocab (`Shard`), and reads only its slices of the checkpoint.
"""
from typing import Iterable

import torch
from torch import nn

from tandem.config import ModelConfig
from tandem.distributed.group import SINGLE, TPGroup
from tandem.distributed.sharding import Shard
from tandem.forward_batch import ForwardBatch
from tandem.memory.kv_cache import KVCache
from tandem.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, qkv_norm_rope_torch
from tandem.models.linear import Linear
from tandem.models.parallel import VocabParallelEmbedding, parallel_logits


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TPGroup):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        # input_layernorm in front: the layer projects (`_norm_project`), this module takes qkv.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias,
                               normed=True)
        # Row-parallel: this rank's input columns, then the all-reduce.
        self.o_proj = Linear(self.q_size, cfg.hidden_size, reduce=tp.all_reduce if tp.size > 1 else None)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary

    def forward(self, qkv: torch.Tensor, batch: ForwardBatch, kv: KVCache, backend) -> torch.Tensor:
        """Attention of the projected rows qkv [T, q + 2 kv], then o_proj."""
        k_cache, v_cache = kv.k[self.layer_id], kv.v[self.layer_id]
        # The CPU path never fuses (no kernels): the backend writes the cache itself.
        fused = qkv.is_cuda and backend.fused_kv_write
        q, k, v = self._norm_rope(qkv, batch, (k_cache, v_cache) if fused else None)
        # With `fused`, the cache stores are in the RoPE launch, before the attention kernel
        # in the same stream.
        out = backend.forward(q, k, v, k_cache, v_cache, batch, self.scale, kv_written=fused)
        return self.o_proj(out.reshape(-1, self.q_size))

    def _norm_rope(self, qkv: torch.Tensor, batch: ForwardBatch,
                   cache: tuple[torch.Tensor, torch.Tensor] | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as views of qkv, q and k (normed and) rotated in place; with `cache`
        (k_cache, v_cache; CUDA only) the rotated k and v also stored at the batch's slots."""
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()
        args = (qkv, batch.positions, self.rotary.cos, self.rotary.sin, self.num_heads,
                self.num_kv_heads, self.head_dim, *norm)
        if not qkv.is_cuda:
            return qkv_norm_rope_torch(*args)
        # One Triton launch: (q/k norm and) RoPE in place inside qkv; q, k, v are strided
        # views of it (the attention kernels and write_kv take strides).
        from tandem.kernels.rope import CacheOut, qkv_norm_rope
        return qkv_norm_rope(*args, cache=None if cache is None else CacheOut(*cache, batch.out_cache_loc))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TPGroup):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, rotary, tp)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                kv: KVCache, backend) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = _norm_project(self.input_layernorm, self.self_attn.qkv_proj, x, residual)
        x = self.self_attn(qkv, batch, kv, backend)
        gate_up, residual = _norm_project(self.post_attention_layernorm, self.mlp.gate_up_proj, x, residual)
        return self.mlp.down(gate_up), residual


def _norm_project(norm: RMSNorm, proj: Linear, x: torch.Tensor,
                  residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(proj(norm(x + residual)), x + residual); the first layer has no residual yet: (proj(norm(x)),
    x). One launch where proj's norm plan covers these rows (small batch on CUDA, issue 21)."""
    fused = proj.add_norm_forward(x, residual, norm.weight, norm.eps)
    if fused is not None:
        return fused
    if residual is None:
        residual, x = x, norm(x)
    else:
        x, residual = norm.add_forward(x, residual)
    return proj(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.config, self.tp = cfg, tp
        self.shard = Shard(cfg, tp.rank, tp.size)
        self.local_config = local = self.shard.local_config()
        vocab_rows, vocab_start = self.shard.vocab_per_rank, self.shard.vocab_start
        self.embed_tokens = VocabParallelEmbedding(vocab_rows, cfg.hidden_size, vocab_start, tp)
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(local, i, rotary, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab_rows, bias=False)

    def forward(self, batch: ForwardBatch, kv: KVCache, backend) -> torch.Tensor:
        """Hidden states [T, hidden] of every new token in the batch."""
        x = self.embed_tokens(batch.input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch, kv, backend)
        x, _ = self.norm.add_forward(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits; into `out` when given (CUDA graphs share one output buffer)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = parallel_logits(hidden, weight, self.config.vocab_size, self.tp)
        return logits if out is None else out.copy_(logits)

    # ---- weights ----
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (or lazy safetensors slices) into the packed parameters, this
        rank's slice of each; every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, source in tensors:
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes store the copy anyway
            if "rotary_emb" in name:
                continue
            target, rows = _packed_target(name, self.local_config)
            if target not in params:
                raise ValueError(f"unknown tensor {name!r} for {self.config.architecture}")
            tensor = _take(source, self.shard.source_range(name))
            param = params[target]
            dest = param.data if rows is None else param.data[rows[0]:rows[1]]
            if target in ("embed_tokens.weight", "lm_head.weight") and self.tp.size > 1:
                dest[tensor.shape[0]:].zero_()  # vocab padding rows: never looked up, logits cut
                dest = dest[:tensor.shape[0]]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            filled.add(target if rows is None else f"{target}:{rows[0]}")
        missing = [n for n, p in params.items() if not _is_filled(n, p, filled, self.local_config)]
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))


def _shard_rows(cfg: ModelConfig, packed: str) -> dict[str, tuple[int, int]]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if packed == "qkv_proj":
        return {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    inter = cfg.intermediate_size
    return {"gate_proj": (0, inter), "up_proj": (inter, 2 * inter)}


def _packed_target(name: str, cfg: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    """HF name -> (our parameter name, row range inside it or None)."""
    for packed, shards in (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                           ("gate_up_proj", ("gate_proj", "up_proj"))):
        for shard in shards:
            if f".{shard}." in name:
                return name.replace(f".{shard}.", f".{packed}.").removeprefix("model."), \
                    _shard_rows(cfg, packed)[shard]
    return name.removeprefix("model."), None


def _is_filled(name: str, param: torch.Tensor, filled: set[str], cfg: ModelConfig) -> bool:
    for packed in ("qkv_proj", "gate_up_proj"):
        if f".{packed}." in name:
            return all(f"{name}:{start}" in filled for start, _ in _shard_rows(cfg, packed).values())
    return name in filled


def _take(source, part: tuple[int, int, int] | None) -> torch.Tensor:
    """This rank's part of a checkpoint tensor: a torch tensor or a lazy safetensors slice
    (which reads only the part from disk)."""
    if part is None:
        return source if isinstance(source, torch.Tensor) else source[:]
    dim, start, stop = part
    return source[start:stop] if dim == 0 else source[:, start:stop]


def hf_pieces(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> Iterable[tuple[str, torch.Tensor]]:
    """A full (unsharded) packed parameter as the HF tensors it packs: the inverse of load."""
    for packed, shards in (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                           ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{packed}." in name:
            for shard in shards:
                start, stop = _shard_rows(cfg, packed)[shard]
                yield name.replace(f".{packed}.", f".{shard}."), tensor[start:stop]
            return
    yield name, tensor
