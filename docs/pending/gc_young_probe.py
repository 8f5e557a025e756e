"""Which young containers the generation-0 passes walk (`tandem bench tier-replay` under a
`gc.callbacks` probe): at each pass's start, the young containers of more than 500 elements and
their owners; at the end, the 15 longest passes and the elements walked in all. A diagnostic for
one run (`gc.get_referrers` scans every tracked object), not a benchmark. Session 54:
`python docs/pending/gc_young_probe.py --conversations 24 --modeled`."""
import collections
import gc
import sys
import time

from tandem.bench import tier_replay as tr

long_passes = []
state = {}

def describe(obj):
    t = type(obj).__name__
    if isinstance(obj, (list, dict, tuple, set)):
        # owner: a referrer that is an instance dict / slots holder
        for ref in gc.get_referrers(obj):
            if ref is state.get("objs"):
                continue
            if isinstance(ref, dict):
                for k, v in ref.items():
                    if v is obj:
                        for holder in gc.get_referrers(ref):
                            if getattr(holder, "__dict__", None) is ref:
                                return f"{type(holder).__name__}.{k}:{t}"
                        return f"dict[{k!r}]:{t}"
            elif isinstance(ref, (list, tuple)):
                return f"in {type(ref).__name__}:{t}"
            else:
                return f"{type(ref).__name__}:{t}"
    return t

def cb(phase, info):
    if info["generation"] != 0:
        return
    if phase == "start":
        objs = gc.get_objects(generation=0)
        big = [o for o in objs if isinstance(o, (list, dict, tuple, set)) and len(o) > 500]
        state["big"] = [(describe(o), len(o)) for o in big]
        state["elems"] = sum(len(o) for o in objs if isinstance(o, (list, dict, tuple, set)))
        state["n"] = len(objs)
        del objs, big
        state["t0"] = time.perf_counter()
    else:
        ms = (time.perf_counter() - state["t0"]) * 1e3
        long_passes.append((ms, state["n"], state["elems"], state["big"]))

gc.callbacks.insert(0, cb)
tr.main(sys.argv[1:])
gc.callbacks.remove(cb)
long_passes.sort(key=lambda p: -p[0])
print("passes", len(long_passes), "total ms", round(sum(p[0] for p in long_passes), 1))
for ms, n, elems, big in long_passes[:15]:
    agg = collections.Counter()
    for d, l in big:
        agg[d] += l
    print(f"{ms:6.2f} ms objs {n:7d} elems {elems:8d} big:", dict(agg.most_common(6)))
print("elements walked in all young passes", sum(p[2] for p in long_passes))
agg = collections.Counter()
for ms, n, elems, big in long_passes:
    for d, l in big:
        agg[d] += l
print("big containers' elements over all passes", dict(agg.most_common(10)))
