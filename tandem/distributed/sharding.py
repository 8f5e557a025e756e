"""Which slice of each weight a tensor-parallel rank holds.

Column-parallel (output rows split): q/k/v and gate/up. Row-parallel (input columns
split, outputs summed): o and down. Vocab-parallel: embedding and lm head rows, the vocab
padded to a multiple of the rank count (padding rows are zero and their logits are cut off
before sampling). KV heads are split when there are at least as many as ranks and
replicated otherwise (rank r holds KV head r // (size / num_kv_heads)).
"""
import dataclasses
from dataclasses import dataclass

from tandem.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    full: ModelConfig
    rank: int
    size: int

    def __post_init__(self):
        cfg, n = self.full, self.size
        if cfg.num_heads % n:
            raise ValueError(f"tensor_parallel_size={n} does not divide the model's "
                             f"{cfg.num_heads} attention heads")
        kv = cfg.num_kv_heads
        if (kv >= n and kv % n) or (kv < n and n % kv):
            raise ValueError(f"tensor_parallel_size={n} and the model's {kv} KV heads: one must "
                             "divide the other")
        if cfg.intermediate_size % n:
            raise ValueError(f"tensor_parallel_size={n} does not divide the model's "
                             f"intermediate_size {cfg.intermediate_size}")

    @property
    def num_heads(self) -> int:
        return self.full.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.full.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        kv, n = self.full.num_kv_heads, self.size
        return self.rank * kv // n if kv >= n else self.rank // (n // kv)

    @property
    def intermediate_size(self) -> int:
        return self.full.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.full.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def local_config(self) -> ModelConfig:
        """The per-rank shapes (heads, KV heads, intermediate size) as a ModelConfig."""
        return dataclasses.replace(self.full, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate_size)

    def source_range(self, hf_name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of this rank's part of an HF tensor; None: the whole tensor."""
        d, r = self.full.head_dim, self.rank
        if self.size == 1:
            return None
        for proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj", "down_proj"):
            if f".{proj}." in hf_name:
                break
        else:
            proj = hf_name.removeprefix("model.").split(".")[0]
        if proj == "q_proj" or (proj == "o_proj" and hf_name.endswith("weight")):
            start = r * self.num_heads * d
            return (0 if proj == "q_proj" else 1, start, start + self.num_heads * d)
        if proj in ("k_proj", "v_proj"):
            start = self.kv_head_start * d
            return 0, start, start + self.num_kv_heads * d
        if proj in ("gate_proj", "up_proj", "down_proj"):
            start = r * self.intermediate_size
            return (1 if proj == "down_proj" else 0), start, start + self.intermediate_size
        if proj in ("embed_tokens", "lm_head"):
            vocab = self.full.vocab_size
            return 0, min(self.vocab_start, vocab), min(self.vocab_start + self.vocab_per_rank, vocab)
        return None
