"""SamplingInputs: a batch's sampling parameters, built on the host at schedule time."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tandem.sampling.noise import row_keys_host, seed_key
from tandem.sampling.params import SamplingParams


_FLOAT_ROWS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INT_ROWS = ("top_k", "noise_key", "slots")
_ROW_WIDTH = len(_FLOAT_ROWS) + 3  # sampling_row: the float rows, top_k, logprobs, seed key


def sampling_row(params: SamplingParams, seed: int) -> bytes:
    """A request's per-row sampling values, packed once: the `_FLOAT_ROWS`, top_k, logprobs
    (-1: none asked) and its `seed_key`, as float64 (every value exact). A batch joins its
    rows' bytes into one array: no per-field pass over the rows each step."""
    p = params
    return np.array([p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                     p.frequency_penalty, p.top_k, -1 if p.logprobs is None else p.logprobs, seed_key(seed)],
                    dtype=np.float64).tobytes()


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
    # Sparse additive biases (logit_bias, bans): [2, K] int64 (row, token id) and [K] float32
    # (-inf bans). None when no row has any, so the common batch pays nothing.
    bias_index: Tensor | None = None
    bias_value: Tensor | None = None

    @staticmethod
    def build(
        params: list[SamplingParams],
        seeds: list[int],
        output_index: list[int],
        slots: list[int],
        pin_memory: bool = False,
        biases: list[tuple[tuple[int, float], ...]] | None = None,
    ) -> "SamplingInputs":
        """`seeds[i]` is row i's effective seed: params.seed, or one the engine drew at admission;
        `biases[i]` row i's (token id, added logit) pairs."""
        if len(seeds) != len(params):
            raise ValueError("params, seeds, output_index and slots must have the same length")
        return SamplingInputs.from_rows([sampling_row(p, s) for p, s in zip(params, seeds)], output_index, slots,
                                        pin_memory, biases)

    @staticmethod
    def from_rows(
        rows: list[bytes],
        output_index: list[int],
        slots: list[int],
        pin_memory: bool = False,
        biases: list[tuple[tuple[int, float], ...]] | None = None,
    ) -> "SamplingInputs":
        """`build` from each row's `sampling_row` (the engine keeps it per request): one join
        of the rows' bytes, not one pass over the rows per parameter."""
        n = len(rows)
        if not (len(output_index) == len(slots) == n):
            raise ValueError("params, seeds, output_index and slots must have the same length")
        # One join of packed rows, flags by numpy: this runs on the scheduler's hot path every
        # step, and per-row Python costs about a microsecond a row.
        table = np.frombuffer(b"".join(rows), dtype=np.float64).reshape(n, _ROW_WIDTH)
        f = table[:, :len(_FLOAT_ROWS)].T.astype(np.float32)
        sampled = f[0] != 0.0
        int_rows = np.empty((len(_INT_ROWS), n), dtype=np.int64)
        int_rows[0] = table[:, len(_FLOAT_ROWS)]
        # Only draws read the keys (never an all-greedy batch's): skip the hashing then.
        int_rows[1] = row_keys_host(table[:, _ROW_WIDTH - 1], output_index) if sampled.any() else 0
        int_rows[2] = slots
        top_k = int_rows[0]
        uses_k = sampled & (top_k != -1)
        uses_p = sampled & (f[1] < 1.0)
        logprobs = table[:, _ROW_WIDTH - 2]
        wants_logprobs = logprobs >= 0
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
            max_logprobs=int(logprobs.max()) if wants_logprobs.any() else None,
            **_pack_biases(biases, pin_memory),
        )

    @staticmethod
    def plain_greedy() -> "SamplingInputs":
        """A batch whose every row samples the argmax of its raw logits (no penalties, bias
        or logprobs): flags only, no per-row values (the greedy argmax reads none)."""
        return _PLAIN_GREEDY

    @property
    def need_bias(self) -> bool:
        return self.bias_index is not None

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
            bias_index=None if self.bias_index is None else self.bias_index.to(device, non_blocking=non_blocking),
            bias_value=None if self.bias_value is None else self.bias_value.to(device, non_blocking=non_blocking),
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


_PLAIN_GREEDY = SamplingInputs(
    floats=torch.empty((len(_FLOAT_ROWS), 0), dtype=torch.float32), ints=torch.empty((len(_INT_ROWS), 0), dtype=torch.int64),
    all_greedy=True, need_top_k=False, need_top_p=False, need_min_p=False, need_penalties=False,
    max_top_k=0, top_p_within_top_k=True, max_logprobs=None)


def _pack_biases(biases: list | None, pin_memory: bool) -> dict[str, Tensor]:
    if not biases or not any(biases):
        return {}
    rows = [i for i, b in enumerate(biases) for _ in b]
    index = torch.tensor([rows, [t for b in biases for t, _ in b]], dtype=torch.int64)
    value = torch.tensor([v for b in biases for _, v in b], dtype=torch.float32)
    if pin_memory:  # so the schedule stream's copies are async
        index, value = index.pin_memory(), value.pin_memory()
    return {"bias_index": index, "bias_value": value}


@dataclass
class SampleOutput:
    token_ids: Tensor  # [B] int64
    logprobs: Tensor | None = None  # [B] float32: log_softmax(raw logits) at the chosen token
    top_ids: Tensor | None = None  # [B, n] int64, n = max requested top-n, best first
    top_logprobs: Tensor | None = None  # [B, n] float32


