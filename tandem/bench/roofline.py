"""Roofline of an engine run, counted from its step timeline (DESIGN.md §5).

Per step (a `StepRecord`):
  bytes = weights read once (every parameter, except that an untied input embedding only has
          its gathered rows read, and the lm_head only when some row samples)
        + KV read by attention (context_tokens x KV bytes per token, all layers, K and V)
        + KV written (new tokens x KV bytes per token)
  FLOPs = 2 x body params x new tokens            (body: everything but embedding / lm_head)
        + 2 x lm_head params x sampled rows
        + 4 x attention pairs x heads x head_dim x layers   (QK^T and PV)
  floor = max(bytes / bandwidth, FLOPs / matmul rate)
Roofline time of a run is the sum of the floors; achieved fraction = roofline / measured.

Bandwidth (a large device-to-device copy, read + write bytes counted) and the matmul rate
(a large square matmul in the run's dtype) are measured in the same process, with CUDA events
on the GPU; on the CPU with the host clock after each op completes (small sizes, CPU figures).
Activations, norms and elementwise work are not counted: the roofline is a lower bound.
"""
import time
from dataclasses import dataclass

import torch


@dataclass
class ModelCost:
    """What one forward costs, independent of the batch."""
    weight_bytes: int  # parameters read every forward (excludes untied input embedding and lm_head)
    lm_head_bytes: int  # the output projection, read when some row samples
    embed_row_bytes: int  # one gathered input-embedding row (0 when tied: read via the lm_head)
    body_params: int  # parameters of the layers and final norm (matmul FLOPs per token / 2)
    lm_head_params: int
    kv_bytes_per_token: int  # K and V over all layers
    num_layers: int
    num_heads: int
    head_dim: int


@dataclass
class Hardware:
    bandwidth: float  # bytes/s, copy read+write
    matmul_flops: float  # FLOP/s in `dtype`
    dtype: str
    device: str
    copy_bytes: int  # size of the copied buffer
    matmul_n: int


@dataclass
class Roofline:
    steps: int
    bytes: float
    flops: float
    time_s: float  # sum of per-step floors
    memory_bound_steps: int
    decode_time_s: float
    prefill_time_s: float


def model_cost(model: torch.nn.Module, mc, kv_dtype: torch.dtype) -> ModelCost:
    """Counts from the model's own parameters. `mc` is a tandem ModelConfig, `kv_dtype` the KV
    pool's element type (the engine's `kv_dtype`: e4m3 halves the KV bytes a step reads)."""
    from tandem.memory.kv_cache import KVCache
    embed = model.embed_tokens.weight
    head = embed if getattr(model, "lm_head", None) is None else model.lm_head.weight
    tied = head is embed
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed_bytes = embed.numel() * embed.element_size()
    head_bytes = head.numel() * head.element_size()
    weight_bytes = total - embed_bytes - (0 if tied else head_bytes)
    params = sum(p.numel() for p in model.parameters())
    body = params - embed.numel() - (0 if tied else head.numel())
    return ModelCost(weight_bytes=weight_bytes, lm_head_bytes=head_bytes,
                     embed_row_bytes=0 if tied else embed.shape[1] * embed.element_size(),
                     body_params=body, lm_head_params=head.numel(),
                     kv_bytes_per_token=KVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads,
                                                                mc.head_dim, kv_dtype),
                     num_layers=mc.num_layers, num_heads=mc.num_heads, head_dim=mc.head_dim)


def sampled_rows(rec) -> int:
    """Rows that compute logits. The timeline may not record it: then every row (exact for
    decode steps; an upper bound for prefill chunks that do not finish their prompt)."""
    n = getattr(rec, "num_sampled", None)
    return rec.batch_size if n is None else n


def step_bytes(rec, cost: ModelCost) -> int:
    sampled = sampled_rows(rec)
    return (cost.weight_bytes + (cost.lm_head_bytes if sampled else 0)
            + rec.num_tokens * cost.embed_row_bytes
            + rec.context_tokens * cost.kv_bytes_per_token
            + rec.num_tokens * cost.kv_bytes_per_token)


def step_flops(rec, cost: ModelCost) -> int:
    return (2 * cost.body_params * rec.num_tokens + 2 * cost.lm_head_params * sampled_rows(rec)
            + 4 * rec.attn_pairs * cost.num_heads * cost.head_dim * cost.num_layers)


def step_floor_s(rec, cost: ModelCost, hw: Hardware) -> float:
    return max(step_bytes(rec, cost) / hw.bandwidth, step_flops(rec, cost) / hw.matmul_flops)


def roofline(records, cost: ModelCost, hw: Hardware) -> Roofline:
    total_b = total_f = total_t = dec_t = pre_t = 0.0
    mem_bound = 0
    for rec in records:
        b, f = step_bytes(rec, cost), step_flops(rec, cost)
        tb, tf = b / hw.bandwidth, f / hw.matmul_flops
        t = max(tb, tf)
        total_b += b
        total_f += f
        total_t += t
        mem_bound += tb >= tf
        if rec.is_decode:
            dec_t += t
        else:
            pre_t += t
    return Roofline(len(records), total_b, total_f, total_t, mem_bound, dec_t, pre_t)


# ---- measuring the machine ----
def _timed(fn, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Seconds per call: CUDA events on the GPU, the host clock after completion on the CPU."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    best = float("inf")
    for _ in range(reps):  # best of: the CPU is shared and noisy
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(device: torch.device, nbytes: int | None = None, reps: int | None = None) -> float:
    """Bytes/s of a device-to-device copy of `nbytes`, counting the read and the write."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 64 << 20)
    reps = reps or (20 if device.type == "cuda" else 5)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), device, reps)


def measure_matmul(device: torch.device, dtype: torch.dtype, n: int | None = None,
                   reps: int | None = None) -> float:
    """FLOP/s of an n x n x n matmul in `dtype`."""
    n = n or (8192 if device.type == "cuda" else 512)
    reps = reps or (20 if device.type == "cuda" else 5)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / _timed(lambda: torch.matmul(a, b, out=out), device, reps)


def measure_hardware(device: torch.device, dtype: torch.dtype, copy_bytes: int | None = None,
                     matmul_n: int | None = None) -> Hardware:
    copy_bytes = copy_bytes or (1 << 30 if device.type == "cuda" else 64 << 20)
    matmul_n = matmul_n or (8192 if device.type == "cuda" else 512)
    bw = measure_bandwidth(device, copy_bytes)
    mm = measure_matmul(device, dtype, matmul_n)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Hardware(bw, mm, str(dtype).replace("torch.", ""), device.type, copy_bytes, matmul_n)
