"""Helpers for the host tier's tests: engines with a small pool and a host tier, multi-turn
chats that outgrow the pool, and the conservation checks."""
import random

from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.memory.allocator import SlotAllocator
from tandem.memory.host_kv import HostKVPool
from tandem.memory.prefix_cache import HostTier
from tandem.sampling import SamplingParams
from tiny_models import TEST_DEVICE
from workload import Spec, assert_kv_conserved, run_workload


def make_engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device=TEST_DEVICE, dtype="float32", **kw))


def chat_specs(conversations: int, turns: int, seed: int, vocab: int = 1000) -> list[list[Spec]]:
    """Multi-turn chats: each turn's prompt is the previous prompt plus new user tokens (the
    model's reply is not fed back, so the turns of one round can be built up front). Returns
    one list of specs per round; the rounds run one after another, so a conversation's history
    is evicted (and written back) between its turns. Some requests abort."""
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(30)]
    history = [system + [rng.randrange(3, vocab) for _ in range(rng.randint(10, 40))]
               for _ in range(conversations)]
    rounds = []
    for t in range(turns):
        specs = []
        for c in range(conversations):
            history[c] = history[c] + [rng.randrange(3, vocab) for _ in range(rng.randint(5, 25))]
            abort = rng.randint(0, 4) if rng.random() < 0.1 else None
            specs.append(Spec(f"c{c}t{t}", list(history[c]),
                              SamplingParams(max_tokens=rng.randint(2, 12), temperature=0.0, ignore_eos=True),
                              abort))
        rounds.append(specs)
    return rounds


def run_chats(engine: Engine, rounds: list[list[Spec]]) -> dict:
    results = {}
    for specs in rounds:
        results.update(run_workload(engine, specs, arrive_per_step=6))
    return results


def small_tiered_engine(path, host_tokens: int = 4096, **kw) -> Engine:
    """A pool far smaller than chat_specs' working set, and a host tier of `host_tokens` (4096
    hold it; fewer make the host tier evict too). With a draft model (`speculative_config`)
    the tier holds the draft's KV too, so a token is priced at both caches' bytes."""
    probe = make_engine(path, max_total_tokens=64, speculative_config=kw.get("speculative_config"))
    gb = host_tokens * engine_bytes_per_token(probe) / 2**30
    probe.close()
    return make_engine(path, max_total_tokens=400, chunked_prefill_size=48, max_prefill_tokens=96,
                       host_kv_cache_gb=gb, **kw)


def assert_tiers_conserved(engine: Engine, stats: dict) -> None:
    """Every GPU slot is free, cached or held (assert_kv_conserved), and every host slot is
    free or holds a cached token."""
    assert_kv_conserved(engine)
    host = engine.kv_tier.host.host_slots
    assert host.num_free + stats["host_cache_tokens"] == host.count


def assert_reset_empties_the_host_tier(engine: Engine) -> None:
    host = engine.kv_tier.host.host_slots
    engine.reset_prefix_cache()
    assert engine.stats()["host_cache_tokens"] == 0 and host.num_free == host.count


def engine_bytes_per_token(engine: Engine) -> int:
    """Host bytes a cached token takes: the target's KV, and the draft model's if it has one."""
    return HostKVPool.bytes_per_token([engine.kv] + ([engine.draft_kv] if engine.draft_kv is not None else []))


def instant_tier(host_pool: SlotAllocator, **fields) -> HostTier:
    """A host tier whose copies move nothing and are complete at once (number 0: nothing to wait
    for); `fields` replace any of its parts."""
    return HostTier(host_pool, **{"write_back": lambda g, h: 0, "load": lambda h, g: 0,
                                  "require": lambda seq: None, "copy_done": lambda seq: True, **fields})
