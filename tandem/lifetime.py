"""An engine's lifetime: the GC freeze that live engines share, the collector's passes moved
into the waits for long steps, and giving memory back.

Engines freeze what they built (`gc.freeze()`), so the collector's scans skip the model,
the tokenizer and the buffers; scans otherwise stall steps for milliseconds. Frozen objects
are never collected, though, so a closed engine unfreezes before collecting, and freezes
again only for the engines still open.
"""
import gc
import weakref

import torch

_open = weakref.WeakSet()


def freeze(engine: object) -> None:
    """Called once the engine is built: everything alive now is long-lived."""
    _open.add(engine)
    gc.collect()
    gc.freeze()


def return_memory(engine: object, device: torch.device, device_usable: bool) -> None:
    """Called by `close()` after the engine dropped its state: collect it, return device memory."""
    _open.discard(engine)
    gc.unfreeze()
    gc.collect()
    if _open:
        gc.freeze()
    if device.type == "cuda" and device_usable:  # never touch a context a sticky error poisoned
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# A step of this many tokens runs long enough on the device to hide the collector's passes
# (Qwen3-0.6B on an H100: ~6 us a prefill token, so >= ~12 ms; a young pass of the host-tier
# workload took <= 9 ms and a full one 7 ms on the 2-core CI machine, session 49).
SHADOW_MIN_TOKENS = 2048


class ShadowCollector:
    """Runs the garbage collector in the host's wait for a long step, where the device still has
    that step to run, instead of wherever an allocation trips it. A running request's token and
    slot lists are young for a while, and a young pass visits each of their elements: on the
    host-tier workload automatic passes took 10-15 ms between two 4 ms decode steps (H100 host,
    session 49), longer than the host is ahead. A young pass (generations 0 and 1) before every
    wait for a step of `min_tokens` or more keeps the automatic ones rare; the full pass runs
    there too once it is due (the third generation's count at its threshold). The step's size
    stands for its remaining time: a full pass (15-21 ms there) in the wait for a step nearly
    done still idles the GPU (docs/async-model.md)."""

    def __init__(self, enabled: bool, min_tokens: int = SHADOW_MIN_TOKENS):
        self.enabled, self.min_tokens = enabled, min_tokens
        self.passes = 0

    def before_wait(self, num_tokens: int, result_ready) -> None:
        """Before waiting for a step of `num_tokens` tokens whose result arrives with
        `result_ready` (an event): collect if the step is long and still running."""
        if not self.enabled or num_tokens < self.min_tokens or not gc.isenabled() or result_ready.query():
            return  # (a caller that disabled the collector wants no passes)
        full = gc.get_count()[2] >= gc.get_threshold()[2]
        gc.collect(2 if full else 1)
        self.passes += 1
