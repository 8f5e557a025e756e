"""What a full pass of the garbage collector walks now: the tracked objects outside the start-up
heap the engine froze (`lifetime.freeze`), by type, and the biggest containers by owner.

A pass visits every element of every tracked container, so the elements, not the objects, are
its cost: on the host-tier workload the prefix tree's token and slot lists were most of it
(session 49). Owners are found through `gc.get_referrers`, a scan of every tracked object per
container: a diagnostic for one moment of a run (`tandem bench prefix --gc-census-at`), never
for the loop.
"""
from __future__ import annotations

import gc
import heapq
import time
import warnings
from collections import Counter

CONTAINERS = (list, tuple, dict, set, frozenset)


def census(top: int = 10, largest: int = 200) -> dict:
    """Tracked objects and the elements their containers hold, by type (the `top` types by
    elements); the `largest` containers' elements by owner ("Type.attribute"); and one full pass,
    timed."""
    count, elements = Counter(), Counter()
    containers = []
    with warnings.catch_warnings():  # isinstance() on a deprecated module attribute warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():  # every generation; the frozen heap is not among them
            name = type(obj).__name__
            count[name] += 1
            if isinstance(obj, CONTAINERS):
                elements[name] += len(obj)
                containers.append(obj)
    big = heapq.nlargest(largest, containers, key=len)
    del containers, obj
    owners = Counter()
    for held in big:
        owners[_owner(held, skip=big)] += len(held)
    del big, held
    return {"objects": sum(count.values()), "elements": sum(elements.values()), "full_pass_ms": full_pass_ms(),
            "by_type": {name: [count[name], elements[name]] for name, _ in elements.most_common(top)},
            "largest_by_owner": dict(owners.most_common(top))}


def full_pass_ms() -> float:
    """One full pass of the collector, timed (ms)."""
    t0 = time.perf_counter()
    gc.collect()
    return round((time.perf_counter() - t0) * 1e3, 2)


def _owner(obj: object, skip: list) -> str:
    """"Type.attribute" of the first object found holding `obj` as an attribute (an instance's
    dict entry or a slot), else the holder's type, else "?". `skip`: the caller's own list."""
    for ref in gc.get_referrers(obj):
        if ref is skip:
            continue
        if isinstance(ref, dict):
            for holder in gc.get_referrers(ref):  # the instance whose __dict__ this is
                if getattr(holder, "__dict__", None) is ref:
                    key = next((k for k, v in ref.items() if v is obj), "?")
                    return f"{type(holder).__name__}.{key}"
            continue
        for slot in getattr(type(ref), "__slots__", ()):
            if getattr(ref, slot, None) is obj:
                return f"{type(ref).__name__}.{slot}"
        attrs = getattr(ref, "__dict__", None)  # an instance whose dict is inline (3.11+): it refers itself
        key = next((k for k, v in attrs.items() if v is obj), None) if isinstance(attrs, dict) else None
        return type(ref).__name__ if key is None else f"{type(ref).__name__}.{key}"
    return "?"
