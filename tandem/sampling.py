"""Sampling: the validated per-request `SamplingParams` and the batched device sampler.

The split matters for the overlap loop: everything that decides *which* kernels
run (greedy only? any top-k? penalties?) is computed on the host from the
params at schedule time (`SamplingInputs.build`). `Sampler.sample` then only
queues device work; it never reads a device value, so the CPU can stay one
step ahead.

Randomness is counter-based: the noise for token v of a row is a hash of
(seed, output_index, v), so a request's draws do not depend on which other
requests share its batch, on its row, or on any global generator, and the
overlap and plain loops produce the same tokens.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

# As in tandem.kernels: with no GPU, Triton kernels can only run interpreted, and the
# switch must be set before Triton is first imported. The CPU sampler uses the torch
# path anyway; this lets the tests check the fused kernel against it on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # CUDA builds of torch ship Triton; without it the torch path runs everywhere.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

MAX_LOGPROBS = 20


# --------------------------------------------------------------------------- params


def _is_int(x: object) -> bool:
    # bool is an int subclass; True as max_tokens is a caller bug, not 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        self._real("temperature", lo=0.0, rule=">= 0 (0 means greedy)")
        self._real("top_p", lo=0.0, lo_open=True, hi=1.0, rule="in (0, 1]")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(
                f"top_k must be -1 (disabled) or an int >= 1 (0 is not accepted as 'disabled'), "
                f"got {self.top_k!r}"
            )
        self._real("min_p", lo=0.0, hi=1.0, rule="in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")
        self.stop = self._stop_strings(self.stop)
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"stop_token_ids must be None or a list of ints >= 0, got {ids!r}")
            self.stop_token_ids = list(ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        self._real("repetition_penalty", lo=0.0, lo_open=True, rule="> 0 (1 means off)")
        self._real("presence_penalty", lo=-2.0, hi=2.0, rule="in [-2, 2]")
        self._real("frequency_penalty", lo=-2.0, hi=2.0, rule="in [-2, 2]")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )

    def _real(
        self, name: str, *, lo: float, hi: float | None = None, lo_open: bool = False, rule: str
    ) -> None:
        v = getattr(self, name)
        ok = _is_real(v) and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
        if not ok:
            raise ValueError(f"{name} must be a finite number {rule}, got {v!r}")
        setattr(self, name, float(v))

    @staticmethod
    def _stop_strings(stop: object) -> list[str] | None:
        if stop is None:
            return None
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
            raise ValueError(f"stop must be None, a non-empty str or a list of non-empty str, got {stop!r}")
        return list(items)

    # Host-side facts the scheduler uses to pick which batch-wide operations run.
    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_top_k(self) -> bool:
        return not self.is_greedy and self.top_k != -1

    @property
    def uses_top_p(self) -> bool:
        return not self.is_greedy and self.top_p < 1.0

    @property
    def uses_min_p(self) -> bool:
        return not self.is_greedy and self.min_p > 0.0

    @property
    def uses_penalties(self) -> bool:
        # Penalties change the argmax too, so greedy rows use them.
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def stop_tokens(self) -> list[int]:
        return list(self.stop_token_ids or [])

    def clone(self, **changes: object) -> "SamplingParams":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)


# --------------------------------------------------------------------------- per-batch inputs

_FLOAT_ROWS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INT_ROWS = ("top_k", "noise_key", "slots")


def seed_to_int64(seed: int) -> int:
    """Any Python int as the signed int64 with the same low 64 bits (seeds may be huge or negative)."""
    s = seed & 0xFFFF_FFFF_FFFF_FFFF
    return s - (1 << 64) if s >= 1 << 63 else s


@dataclass
class SamplingInputs:
    """One batch's sampling parameters: two packed tensors plus host-side flags.

    Packing all per-row values into one float32 and one int64 tensor makes the
    host-to-device move two copies instead of ten. The row views below are
    slices of the packs, on whichever device the packs are.
    """

    floats: Tensor  # [len(_FLOAT_ROWS), B] float32
    ints: Tensor  # [len(_INT_ROWS), B] int64; top_k is -1 where disabled
    # noise_key is row_keys(seed, output_index), hashed here on the host: a few dozen tiny
    # ops that would otherwise be a few dozen kernel launches per step.
    # Host flags: which batch-wide operations run. Computed once, never read back from the device.
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    need_penalties: bool
    max_top_k: int  # largest enabled top_k in the batch (0 if none); bounds torch.topk
    top_p_within_top_k: bool  # every top-p row also has top-k: no full-vocabulary sort needed
    max_logprobs: int | None  # largest requested top-n (0 = chosen token only); None = no logprobs

    @staticmethod
    def build(
        params: list[SamplingParams],
        seeds: list[int],
        output_index: list[int],
        slots: list[int],
        pin_memory: bool = False,
    ) -> "SamplingInputs":
        """`seeds[i]` is row i's effective seed: params.seed, or one the engine drew at admission."""
        n = len(params)
        if not (len(seeds) == len(output_index) == len(slots) == n):
            raise ValueError("params, seeds, output_index and slots must have the same length")
        # Columns by comprehension, flags by numpy: this runs on the scheduler's hot path
        # every step, and per-row Python branching costs about a microsecond a row.
        f = np.array(
            [[getattr(p, name) for p in params] for name in _FLOAT_ROWS], dtype=np.float32
        ).reshape(len(_FLOAT_ROWS), n)
        int_rows = np.empty((len(_INT_ROWS), n), dtype=np.int64)
        int_rows[0] = [p.top_k for p in params]
        int_rows[1] = row_keys_host(seeds, output_index)
        int_rows[2] = slots
        top_k = int_rows[0]
        sampled = f[0] != 0.0
        uses_k = sampled & (top_k != -1)
        uses_p = sampled & (f[1] < 1.0)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        floats = torch.empty((len(_FLOAT_ROWS), n), dtype=torch.float32, pin_memory=pin_memory)
        ints = torch.empty((len(_INT_ROWS), n), dtype=torch.int64, pin_memory=pin_memory)
        floats.copy_(torch.from_numpy(f))
        ints.copy_(torch.from_numpy(int_rows))
        return SamplingInputs(
            floats=floats,
            ints=ints,
            all_greedy=not sampled.any(),
            need_top_k=bool(uses_k.any()),
            need_top_p=bool(uses_p.any()),
            need_min_p=bool((sampled & (f[2] > 0.0)).any()),
            need_penalties=bool(((f[3] != 1.0) | (f[4] != 0.0) | (f[5] != 0.0)).any()),
            max_top_k=int(top_k[uses_k].max()) if uses_k.any() else 0,
            top_p_within_top_k=not (uses_p & ~uses_k).any(),
            max_logprobs=max(logprobs) if logprobs else None,
        )

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "SamplingInputs":
        # With pinned packs the copies are async; the caching host allocator keeps the
        # pinned blocks alive until the copies complete, so the host object may die early.
        return SamplingInputs(
            floats=self.floats.to(device, non_blocking=non_blocking),
            ints=self.ints.to(device, non_blocking=non_blocking),
            all_greedy=self.all_greedy,
            need_top_k=self.need_top_k,
            need_top_p=self.need_top_p,
            need_min_p=self.need_min_p,
            need_penalties=self.need_penalties,
            max_top_k=self.max_top_k,
            top_p_within_top_k=self.top_p_within_top_k,
            max_logprobs=self.max_logprobs,
        )

    @property
    def batch_size(self) -> int:
        return int(self.floats.shape[1])

    temperature = property(lambda self: self.floats[0])
    top_p = property(lambda self: self.floats[1])
    min_p = property(lambda self: self.floats[2])
    repetition_penalty = property(lambda self: self.floats[3])
    presence_penalty = property(lambda self: self.floats[4])
    frequency_penalty = property(lambda self: self.floats[5])
    top_k = property(lambda self: self.ints[0])
    noise_key = property(lambda self: self.ints[1])
    slots = property(lambda self: self.ints[2])


@dataclass
class SampleOutput:
    token_ids: Tensor  # [B] int64
    logprobs: Tensor | None = None  # [B] float32: log_softmax(raw logits) at the chosen token
    top_ids: Tensor | None = None  # [B, n] int64, n = max requested top-n, best first
    top_logprobs: Tensor | None = None  # [B, n] float32


# --------------------------------------------------------------------------- counter-based noise

_M32 = 0xFFFF_FFFF


def _mix32(x: Tensor) -> Tensor:
    """lowbias32 (Wellons) on 32-bit values held in int64.

    Every product is a 32-bit value times a constant below 2**31, so it fits in
    int64 without overflow: the bits are defined and equal on CPU and CUDA. The
    second constant, 0x846ca68b, is above 2**31, so it is applied as the
    negation of a multiply by 2**32 - 0x846ca68b (the same thing mod 2**32).
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (-(x * 0x7B935975)) & _M32
    return x ^ (x >> 16)


def row_keys(seed: Tensor, output_index: Tensor) -> Tensor:
    """[B] int64 32-bit key per (seed, output_index): all 64 seed bits matter."""
    k = _mix32(seed & _M32)
    k = _mix32(k ^ ((seed >> 32) & _M32))
    return _mix32(k ^ (output_index & _M32))


def row_keys_host(seeds: list[int], output_index: list[int]) -> np.ndarray:
    """`row_keys` for host lists, in numpy uint64 (products of two 32-bit values cannot
    wrap there); the same bits, as int64."""
    m = np.uint64(_M32)

    def mix(x: np.ndarray) -> np.ndarray:
        x = x ^ (x >> np.uint64(16))
        x = (x * np.uint64(0x7FEB352D)) & m
        x = x ^ (x >> np.uint64(15))
        x = (x * np.uint64(0x846CA68B)) & m
        return x ^ (x >> np.uint64(16))

    seed = np.array([s & 0xFFFF_FFFF_FFFF_FFFF for s in seeds], dtype=np.uint64)
    index = np.array(output_index, dtype=np.int64).astype(np.uint64)
    k = mix(seed & m)
    k = mix(k ^ (seed >> np.uint64(32)))
    return mix(k ^ (index & m)).astype(np.int64)


def gumbel_noise(keys: Tensor, token_hash: Tensor) -> Tensor:
    """[B, V] float32 standard Gumbel noise, a pure function of (row key, token)."""
    h = _mix32(keys[:, None] ^ token_hash[None, :])
    # (h + 0.5) / 2**32 lies strictly inside (0, 1). The logs run in float64 and are
    # rounded to float32 so CPU and CUDA libm differences (<= 1 ulp in float64)
    # almost never reach the float32 result.
    u = (h.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)
    return (-torch.log(-torch.log(u))).to(torch.float32)


def gumbel_argmax_torch(scores: Tensor, keys: Tensor, token_hash: Tensor) -> Tensor:
    """Reference: argmax(scores + Gumbel noise) per row; ~20 passes over [B, V]."""
    return (scores + gumbel_noise(keys, token_hash)).argmax(dim=-1)


def _gumbel_argmax_body(
    scores_ptr, stride, keys_ptr, hash_ptr, best_val_ptr, best_idx_ptr, V, M32,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,  # a string under `from __future__ import annotations`
):
    """One program per (row, chunk of CHUNK tokens): the same noise as `gumbel_noise`
    (same hash, same float64 logs), fused with a running argmax, so scores are read once."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    key = tl.load(keys_ptr + row)
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    for off in range(0, CHUNK, BLOCK):
        start = chunk * CHUNK + off
        cols = start + tl.arange(0, BLOCK)
        live = cols < V
        s = tl.load(scores_ptr + row * stride + cols, mask=live, other=float("-inf"))
        x = key ^ tl.load(hash_ptr + cols, mask=live, other=0)
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & M32
        x = x ^ (x >> 15)
        x = (-(x * 0x7B935975)) & M32
        x = x ^ (x >> 16)
        u = (x.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)
        g = (-tl.log(-tl.log(u))).to(tl.float32)
        v = tl.where(live, s + g, float("-inf"))
        # Ties go to the lowest index, as torch.argmax: left within a block, strict > across.
        bv, bi = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
        take = bv > best_val
        best_idx = tl.where(take, start + bi.to(tl.int64), best_idx)
        best_val = tl.where(take, bv, best_val)
    tl.store(best_val_ptr + row * tl.num_programs(1) + chunk, best_val)
    tl.store(best_idx_ptr + row * tl.num_programs(1) + chunk, best_idx)


_gumbel_argmax_kernel = triton.jit(_gumbel_argmax_body) if triton is not None else None

_CHUNK = 4096
_BLOCK = 1024


def gumbel_argmax_triton(scores: Tensor, keys: Tensor, token_hash: Tensor, kernel=None) -> Tensor:
    """Fused `gumbel_argmax_torch`: per (row, chunk) maxima in one kernel, then a tiny
    torch argmax over chunks (first chunk wins ties, so the lowest index overall)."""
    kernel = kernel or _gumbel_argmax_kernel
    scores = scores.contiguous()
    B, V = scores.shape
    n_chunks = triton.cdiv(V, _CHUNK)
    best_val = torch.empty((B, n_chunks), dtype=torch.float32, device=scores.device)
    best_idx = torch.empty((B, n_chunks), dtype=torch.int64, device=scores.device)
    if B > 0:
        kernel[(B, n_chunks)](
            scores, scores.stride(0), keys, token_hash, best_val, best_idx, V, _M32, CHUNK=_CHUNK, BLOCK=_BLOCK
        )
    return best_idx.gather(1, best_val.argmax(dim=1, keepdim=True)).squeeze(1)


def gumbel_argmax(scores: Tensor, keys: Tensor, token_hash: Tensor) -> Tensor:
    if scores.is_cuda and _gumbel_argmax_kernel is not None:
        return gumbel_argmax_triton(scores, keys, token_hash)
    return gumbel_argmax_torch(scores, keys, token_hash)


# --------------------------------------------------------------------------- sampler


class Sampler:
    """Batched sampling on the device; one instance per model runner.

    Order (vLLM's): penalties -> temperature -> top-k -> top-p -> min-p -> draw.
    Penalty history (which tokens each slot's prompt contains, how often each
    token was generated) lives on the device because the host lags one step
    behind the sampled tokens.
    """

    def __init__(self, vocab_size: int, max_slots: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.max_slots = max_slots
        self.device = torch.device(device)
        # Hash of every token id, fixed for the sampler's life: the per-step noise
        # then costs one mix over [B, V] instead of two.
        vocab = torch.arange(vocab_size, dtype=torch.int64, device=self.device)
        self._token_hash = _mix32(vocab ^ 0x9E3779B9)
        self._vocab = vocab
        # Allocated on the first request with penalties (see start_request).
        self._prompt_mask: Tensor | None = None  # [max_slots, V] bool
        self._output_counts: Tensor | None = None  # [max_slots, V] int32

    # ---- penalty state

    @property
    def has_penalty_state(self) -> bool:
        return self._output_counts is not None

    def start_request(
        self,
        slot: int,
        prompt_token_ids: Tensor | list[int],
        params: SamplingParams | None = None,
    ) -> None:
        """Reset `slot` for a new request and remember its prompt tokens.

        Call it on the forward stream before the request's first sample. With
        `params` given and no penalties in it, nothing happens: a slot's history
        is only read by a request with penalties, and that request resets the slot
        itself. Without `params` the slot is always reset (and the state allocated).
        """
        if params is not None and not params.uses_penalties:
            return
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must be in [0, {self.max_slots}), got {slot}")
        if self._output_counts is None:
            shape = (self.max_slots, self.vocab_size)
            self._prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
            self._output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        assert self._prompt_mask is not None
        ids = self._to_device_ids(prompt_token_ids)
        self._prompt_mask[slot].zero_()
        self._prompt_mask[slot].index_fill_(0, ids, True)
        self._output_counts[slot].zero_()

    def _to_device_ids(self, ids: Tensor | list[int]) -> Tensor:
        if isinstance(ids, Tensor):
            return ids.to(self.device, dtype=torch.int64, non_blocking=True)
        host = torch.tensor(ids, dtype=torch.int64)
        if self.device.type == "cuda":
            # Pinned so the copy is async; the caching host allocator keeps it alive until done.
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def record(self, slots: Tensor, token_ids: Tensor) -> None:
        """Count each row's sampled token in its slot's history: one device scatter, no host read.

        A no-op until some request needed penalties; padding rows should use a
        padding slot (their counts are never read).
        """
        if self._output_counts is None:
            return
        flat = slots.to(torch.int64) * self.vocab_size + token_ids.to(torch.int64)
        ones = torch.ones_like(flat, dtype=torch.int32)
        self._output_counts.view(-1).index_add_(0, flat, ones)

    def apply_penalties(self, logits: Tensor, inputs: SamplingInputs) -> Tensor:
        """vLLM semantics, out of place: repetition over prompt+output, presence and
        frequency over output only. Rows with neutral values are unchanged."""
        if self._output_counts is None or self._prompt_mask is None:
            raise RuntimeError("penalties requested but no request with penalties went through start_request")
        slots = inputs.slots
        counts = self._output_counts.index_select(0, slots)
        seen_out = counts > 0
        seen = seen_out | self._prompt_mask.index_select(0, slots)
        rep = inputs.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        logits = logits - inputs.frequency_penalty[:, None] * counts.to(logits.dtype)
        return logits - inputs.presence_penalty[:, None] * seen_out.to(logits.dtype)

    # ---- sampling

    def sample(self, logits: Tensor, inputs: SamplingInputs) -> SampleOutput:
        """Sample one token per row of `logits` [B, V]. Queues device work only."""
        logits = logits.to(torch.float32)
        raw = logits
        if inputs.need_penalties:
            logits = self.apply_penalties(logits, inputs)

        greedy_ids = logits.argmax(dim=-1)
        if inputs.all_greedy:
            token_ids = greedy_ids
        else:
            temperature = inputs.temperature
            is_greedy = temperature == 0
            scaled = logits / torch.where(is_greedy, 1.0, temperature)[:, None]
            scaled = self._mask(scaled, inputs)
            sampled_ids = gumbel_argmax(scaled, inputs.noise_key, self._token_hash)
            token_ids = torch.where(is_greedy, greedy_ids, sampled_ids)

        out = SampleOutput(token_ids=token_ids)
        if inputs.max_logprobs is not None:
            logprobs = torch.log_softmax(raw, dim=-1)
            out.logprobs = logprobs.gather(1, token_ids[:, None]).squeeze(1)
            if inputs.max_logprobs > 0:
                top = torch.topk(logprobs, min(inputs.max_logprobs, self.vocab_size), dim=-1)
                out.top_logprobs, out.top_ids = top.values, top.indices
        return out

    def _mask(self, scaled: Tensor, inputs: SamplingInputs) -> Tensor:
        """Set disallowed tokens to -inf. Each step runs only if some row needs it; a row
        with the neutral value (top_k=-1, top_p=1, min_p=0) passes through unchanged."""
        V = self.vocab_size
        neg_inf = float("-inf")
        if inputs.need_top_k or inputs.need_top_p:
            k = inputs.top_k
            k = torch.where((k < 1) | (k > V), V, k)  # -1 (off) keeps all V
        if inputs.need_top_p and not inputs.top_p_within_top_k:
            # Some top-p row has no top-k: sort the whole vocabulary once; top-k is then a
            # rank cut and top-p a mass cut in sorted order.
            vals, idx = scaled.sort(dim=-1, descending=True, stable=True)
            if inputs.need_top_k:
                vals = vals.masked_fill(self._vocab[None, :] >= k[:, None], neg_inf)
            vals = self._top_p_sorted(vals, inputs.top_p)
            scaled = torch.empty_like(scaled).scatter_(1, idx, vals)
        elif inputs.need_top_k:
            kmax = min(inputs.max_top_k, V)
            if inputs.need_top_p:
                # Every top-p row has top-k, so its nucleus lies within its top kmax tokens:
                # a [B, kmax] topk replaces the [B, V] sort. Rows without top-k keep all.
                vals, idx = torch.topk(scaled, kmax, dim=-1)
                vals = vals.masked_fill(self._vocab[None, :kmax] >= k[:, None], neg_inf)
                vals = self._top_p_sorted(vals, inputs.top_p)
                cut = torch.full_like(scaled, neg_inf).scatter_(1, idx, vals)
                scaled = torch.where((k < V)[:, None], cut, scaled)
            else:
                top_vals = torch.topk(scaled, kmax, dim=-1).values
                kth = top_vals.gather(1, (k.clamp(max=kmax) - 1)[:, None])
                kth = torch.where((k < V)[:, None], kth, neg_inf)
                scaled = scaled.masked_fill(scaled < kth, neg_inf)
        if inputs.need_min_p:
            # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p); min_p = 0 gives -inf (keeps all).
            # Renormalising after top-k/top-p keeps ratios, so this equals min-p on the cut distribution.
            floor = scaled.amax(dim=-1, keepdim=True) + torch.log(inputs.min_p)[:, None]
            scaled = scaled.masked_fill(scaled < floor, neg_inf)
        return scaled

    @staticmethod
    def _top_p_sorted(vals: Tensor, top_p: Tensor) -> Tensor:
        """Top-p on logits sorted descending: keep the smallest prefix whose mass reaches p.
        The top token has mass_before 0 < p, so it always stays. Rows with p = 1 are exempt
        so cumsum rounding cannot trim their tail."""
        probs = vals.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        p = top_p[:, None]
        return vals.masked_fill((mass_before >= p) & (p < 1.0), float("-inf"))
