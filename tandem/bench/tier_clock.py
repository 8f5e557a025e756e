"""A modeled device clock for the host tier's CPU replay (`tandem bench tier-replay --modeled`).

On the CPU every copy completes as it is queued and a step takes the CPU's own time, so the
replay plans as a GPU run with infinitely fast copies would: the TTFT tail that copies taking
time cause on the GPU (a held request whose load is still running is passed, its place taken)
does not show. Here the engine keeps planning with its real code, but time is modeled:

- one device timeline: a step starts when the one before it ends (the host is one step ahead),
  or later if its forward waits for a host-tier copy it depends on (`KVTierCopier.fence`), and
  lasts `step_ms` plus `prefill_us_per_token` for each token of a step with prefill rows;
- one copy stream: a copy queued when the step launched last starts starts once the copies
  before it are done, and moves `token_bytes` a token at `copy_gb_s`;
- `copy_done` answers by that clock, the window's copy pace measures modeled step periods and
  modeled rates, and request arrivals and first tokens are stamped with it.

Session 52 calibrated it on the H100's multi-turn run (4.3 ms a step plus 6 us a prefill
token; copies at 37 GB/s measured there) and predicted the held place's GPU result: the p99
under tier off's, a run ~5% longer (H100, session 53: 4.68 against 6.32 s, 4.4% longer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.bench.presets import PRESETS
from tandem.engine import Engine
from tandem.memory.kv_cache import KVCache

_QWEN3_0_6B = PRESETS["qwen3-0.6b"]
QWEN3_0_6B_TOKEN_BYTES = KVCache.bytes_per_token(_QWEN3_0_6B["num_hidden_layers"], _QWEN3_0_6B["num_key_value_heads"],
                                                 _QWEN3_0_6B["head_dim"], torch.bfloat16)  # the GPU run's bf16 pool


@dataclass
class ClockModel:
    step_ms: float = 4.3
    prefill_us_per_token: float = 6.0
    copy_gb_s: float | None = 37.0  # None: copies complete as they are queued
    token_bytes: int = QWEN3_0_6B_TOKEN_BYTES

    def step_s(self, num_tokens: int, has_prefill: bool) -> float:
        return (self.step_ms + (self.prefill_us_per_token * num_tokens / 1e3 if has_prefill else 0.0)) / 1e3

    def copy_s(self, tokens: int) -> float:
        return tokens * self.token_bytes / (self.copy_gb_s * 1e9) if self.copy_gb_s else 0.0


class ModeledClock:
    """Instance wrappers around the engine's launch, its host tier's copies, fence, `copy_done`,
    rates and pace; `close()` removes them. `now` is the modeled time the host is at: the start of
    the step launched last (it waited for the one before, which ended then)."""

    def __init__(self, engine: Engine, model: ClockModel):
        self.engine = engine
        self.now = 0.0
        self.device_free = 0.0  # the end of the last step launched
        self.copy_free = 0.0  # the end of the last copy queued
        self.copy_end: dict[int, float] = {}  # copy number -> its modeled end (in copy order: one stream)
        self.wait_until = 0.0  # the next forward waits for the copies it depends on until then
        self.stall_s = 0.0
        self.steps = 0
        self._wrapped: list[tuple[object, str]] = []
        runner_launch = engine.runner.launch
        # A GPU runs a prefill step of max_prefill_tokens far within the scheduler's target, whose
        # pace the CPU's own steps would set: the plans must be the GPU's.
        self._target = engine.scheduler.cfg.prefill_step_target_s
        engine.scheduler.cfg.prefill_step_target_s = 3600.0

        def launch(batch, **kw):
            start = max(self.device_free, self.now, self.wait_until)
            self.stall_s += max(0.0, self.wait_until - max(self.device_free, self.now))
            self.wait_until, self.now = 0.0, start
            self.device_free = start + model.step_s(batch.num_tokens, batch.has_prefill)
            self.steps += 1
            return runner_launch(batch, **kw)

        self._wrap(engine.runner, "launch", launch)
        tier = engine.kv_tier
        if tier is None:
            return
        copy, fence, tick = tier._copy, tier.fence, engine.tier_pace.tick

        def timed_copy(kind, gpu_slots, host_slots):
            record = copy(kind, gpu_slots, host_slots)
            self.copy_free = max(self.copy_free, self.now) + model.copy_s(len(gpu_slots))
            self.copy_end[record.seq] = self.copy_free
            return record

        def timed_fence(forward_stream, timed=False):
            target = tier.required if tier.precise else tier.seq
            if target > tier.fenced:  # the forward waits for it (and, on one stream, all before it)
                self.wait_until = max(self.wait_until, self.copy_end.get(target, 0.0))
            return fence(forward_stream, timed)

        def done(seq: int) -> bool:
            return self.copy_end.get(seq, 0.0) <= self.now

        rate = model.copy_gb_s * 1e9 if model.copy_gb_s else None
        self._wrap(tier, "_copy", timed_copy)
        self._wrap(tier, "fence", timed_fence)
        self._wrap(tier, "done", done)
        self._wrap(tier, "bytes_per_s", lambda kind: rate)
        self._wrap(engine.tier_pace, "tick", lambda now, prefill=False: tick(self.now, prefill))
        self._host_done = engine.prefix_cache.host.copy_done
        engine.prefix_cache.host.copy_done = done  # bound at the engine's construction
        self._token_bytes, engine.tier_pace.token_bytes = engine.tier_pace.token_bytes, model.token_bytes

    def clock(self) -> float:
        """The modeled time, for the workload driver's arrivals and first tokens."""
        return self.now

    def end(self) -> float:
        """The modeled time the last step ends."""
        return max(self.device_free, self.now)

    def _wrap(self, obj: object, name: str, fn) -> None:
        setattr(obj, name, fn)
        self._wrapped.append((obj, name))

    def close(self) -> None:
        for obj, name in self._wrapped:
            delattr(obj, name)  # the instance attribute: the class's method shows again
        self._wrapped = []
        self.engine.scheduler.cfg.prefill_step_target_s = self._target
        if self.engine.kv_tier is not None:
            self.engine.prefix_cache.host.copy_done = self._host_done
            self.engine.tier_pace.token_bytes = self._token_bytes
