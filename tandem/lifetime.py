"""An engine's lifetime: the GC freeze that live engines share, and giving memory back.

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
