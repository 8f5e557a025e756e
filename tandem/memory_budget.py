"""How much device memory the KV pool gets, and the profiling forward that decides it.

    budget   = total device memory x gpu_memory_utilization
    kv pool  = budget - in use (weights, whatever else the process holds, the CUDA context)
                      - activation peak (a profiling forward at the largest prefill step,
                        plus sampling the largest batch)
                      - per-request buffers made after the pool (request table, sampler state)
                      - CUDA-graph reserve (one shared logits buffer + decode work buffers)

Sizing from *total* memory (not free memory) makes the pool the same for every engine the
process creates, given the same other holdings; a second engine after `close()` gets the
first one's capacity back. The arithmetic (`plan_kv_pool`) takes plain figures so it is
tested on the CPU; the measurements (`measure_activations`) need CUDA.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from tandem.forward_batch import ForwardBatch
from tandem.memory.kv_cache import KVCache
from tandem.memory.req_to_token import ReqToTokenTable
from tandem.sampling import MAX_LOGPROBS, Sampler, SamplingInputs, SamplingParams
from tandem.sampling.prompt_logprobs import chunk_rows, compute_prompt_logprobs

log = logging.getLogger("tandem")

GiB = 2**30


@dataclass
class MemoryBudget:
    """The split of `total x utilization`, in bytes."""

    total: int
    utilization: float
    in_use: int  # device memory in use once the weights are loaded (all of the process's tensors)
    weights: int  # part of in_use
    activations: int  # peak of the profiling forward and sampling above in_use
    buffers: int  # made after the pool: request->token table, penalty state
    cuda_graphs: int  # reserved for decode graphs (their logits buffer and work buffers)
    kv_pool: int

    def as_dict(self) -> dict[str, float]:
        """GiB figures (and the utilization) for stats()."""
        return {k: (v if k == "utilization" else round(v / GiB, 3)) for k, v in asdict(self).items()}

    def describe(self, kv_tokens: int) -> str:
        g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        return (f"memory: total {g(self.total)} x gpu_memory_utilization {self.utilization} = "
                f"{g(self.total * self.utilization)}; in use {g(self.in_use)} (weights {g(self.weights)}), "
                f"activations {g(self.activations)}, buffers {g(self.buffers)}, CUDA graphs {g(self.cuda_graphs)}, "
                f"KV pool {g(self.kv_pool)} ({kv_tokens} tokens)")


def plan_kv_pool(total: int, utilization: float, in_use: int, weights: int, activations: int,
                 buffers: int, cuda_graphs: int, bytes_per_token: int, min_tokens: int) -> MemoryBudget:
    """The pool left in the budget; ValueError (saying what is needed and what to change) when
    it cannot hold `min_tokens` (one full-length request)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    kv = int(total * utilization) - in_use - activations - buffers - cuda_graphs
    budget = MemoryBudget(total, utilization, in_use, weights, activations, buffers, cuda_graphs, max(kv, 0))
    needed = min_tokens * bytes_per_token
    if kv < needed:
        short = needed - kv
        raise ValueError(
            f"not enough device memory for the KV cache: {budget.describe(max(kv, 0) // bytes_per_token)}; "
            f"at least {needed / GiB:.2f} GiB ({min_tokens} tokens) are needed, {short / GiB:.2f} GiB more. "
            f"Raise gpu_memory_utilization (to {min(1.0, (total * utilization + short) / total):.2f} "
            f"would do), lower max_model_len, max_prefill_tokens or max_running_requests, or free "
            f"memory held elsewhere in the process")
    return budget


def graph_reserve(max_batch: int, vocab_size: int, activations: int, profiled_tokens: int,
                  prefill_tokens: int = 0) -> int:
    """Decode graphs share one fp32 [max_batch, vocab] logits buffer (prefill graphs use its
    first rows); the graphs' work buffers, one memory pool for both, scale with their largest
    step (max_batch decode rows or `prefill_tokens`) like the profiled activations (at least
    64 MiB for small models)."""
    if max_batch == 0:
        return 0
    work = activations * max(max_batch, prefill_tokens) // max(profiled_tokens, 1)
    return max_batch * vocab_size * 4 + max(work, 64 * 2**20)


def request_buffers(max_running: int, max_model_len: int, vocab_size: int) -> int:
    """The request->token table (int32) and the sampler's penalty state (bool + int32 per slot)."""
    return (max_running + 1) * (max_model_len * 4 + vocab_size * 5)


def profile_rows(num_tokens: int, max_model_len: int) -> list[int]:
    """Prompt lengths that fill the largest prefill step: full-length rows, then the rest."""
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


@torch.no_grad()
def profile_forward(model, backend, num_layers: int, num_kv_heads: int, head_dim: int,
                    kv_dtype: torch.dtype, device: torch.device, num_tokens: int, max_model_len: int,
                    vocab_size: int, num_samples: int) -> int:
    """One eager forward of `num_tokens` prefill tokens on a throw-away KV pool, then sampling
    `num_samples` rows with every sampling option on (the largest sampler temporaries). The
    pool has the engine's KV dtype, so the attention kernels profiled are the ones it runs.
    Returns the bytes of its throw-away pool and table, which are not activations."""
    lens = profile_rows(num_tokens, max_model_len)
    kv = KVCache(num_layers, num_tokens + 1, num_kv_heads, head_dim, kv_dtype, device)
    table = ReqToTokenTable(len(lens), max(lens), device)
    slots = [i + 1 for i, n in enumerate(lens) for _ in range(n)]
    positions = [p for n in lens for p in range(n)]
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    locs, req_slots = i64(list(range(1, num_tokens + 1))), i64(list(range(1, len(lens) + 1)))
    table.write_on_device(i64(slots), i64(positions), locs)
    ends = [sum(lens[:i + 1]) for i in range(len(lens))]
    fb = ForwardBatch(
        input_ids=i64([(p * 7919) % vocab_size for p in range(num_tokens)]), positions=i64(positions),
        out_cache_loc=locs, req_slots=req_slots, seq_lens=i32(lens), prefix_lens=i32([0] * len(lens)),
        qo_indptr=i32([0] + ends), req_to_token=table.table, host_req_slots=list(range(1, len(lens) + 1)),
        host_seq_lens=lens, host_extend_lens=lens, is_decode=False, max_seq_len=max(lens))
    scratch = sum(t.nbytes for t in kv.k + kv.v) + table.table.nbytes
    hidden = model(fb, kv, backend)
    rows = i64([(e - 1) % num_tokens for e in ends] * (num_samples // len(lens) + 1))[:num_samples]
    logits = model.compute_logits(hidden[rows])
    # Prompt logprobs: one chunk of scored rows is the most their LM head holds at once.
    scored = torch.arange(min(num_tokens, chunk_rows(vocab_size)), device=device)
    compute_prompt_logprobs(hidden, scored, scored % vocab_size, MAX_LOGPROBS, model.compute_logits, vocab_size)
    del hidden, kv, table
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, logprobs=20,
                            repetition_penalty=1.1)
    sampler = Sampler(vocab_size, num_samples + 1, device)
    for slot in range(1, num_samples + 1):
        sampler.start_request(slot, [1, 2, 3], params)
    inputs = SamplingInputs.build([params] * num_samples, [0] * num_samples, [0] * num_samples,
                                  list(range(1, num_samples + 1))).to(device)
    sampler.sample(logits, inputs)
    return scratch


def measure_activations(device: torch.device, run) -> int:
    """Peak bytes `run()` allocates above what was allocated before it, less the scratch bytes
    it returns (CUDA only); the temporaries go back to the driver afterwards so they do not
    count as in use."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    scratch = run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - scratch
    torch.cuda.empty_cache()
    return max(peak, 0)
