"""Cascade attention in the engine: grouping from the radix tree, and greedy tokens identical
with the path forced on, chosen by the rule (auto) and off."""
import random

import pytest

from tandem.config import EngineConfig, Experiments
from tandem.cuda_graph import DecodeGraphs
from tandem.engine import Engine
from tandem.memory.allocator import SlotAllocator
from tandem.memory.prefix_cache import PrefixCache
from tandem.request import Request
from tandem.sampling import SamplingParams
from tandem.scheduler.cascade import CascadeMemo, CascadeRule, plan_cascade
from test_prefix_cache import shared_prefix_specs
from tiny_models import TEST_DEVICE
from workload import Spec, assert_kv_conserved, run_workload

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _engine(path, cascade: str, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device=TEST_DEVICE, dtype="float32",
                               experiments=Experiments(cascade_attention=cascade), **kw))


def group_specs(groups: int, per_group: int, prefix_len: int, seed: int) -> list[Spec]:
    """The generated-shared-prefix shape, small: each group's requests share a long prefix and
    differ in a short question; greedy, fixed output lengths."""
    rng = random.Random(seed)
    specs = []
    for g in range(groups):
        prefix = [rng.randrange(3, 1000) for _ in range(prefix_len)]
        for i in range(per_group):
            question = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 9))]
            specs.append(Spec(f"g{g}r{i}", prefix + question,
                              SamplingParams(max_tokens=rng.randint(4, 16), **GREEDY)))
    return specs


def _run(path, specs, cascade: str, **kw) -> tuple[dict, dict]:
    engine = _engine(path, cascade, **kw)
    out = run_workload(engine, specs, arrive_per_step=64)
    assert_kv_conserved(engine)
    return out, engine.stats()


@pytest.mark.parametrize("overlap", [True, False])
def test_shared_prefix_workload_same_tokens(tiny_text_model, overlap):
    specs = group_specs(groups=3, per_group=6, prefix_len=83, seed=1)
    kw = dict(disable_overlap=not overlap, chunked_prefill_size=32, max_prefill_tokens=64)
    off, off_stats = _run(tiny_text_model, specs, "off", **kw)
    on, on_stats = _run(tiny_text_model, specs, "on", **kw)
    assert on == off
    assert off_stats["cascade_steps"] == 0
    assert on_stats["cascade_steps"] > 5 and on_stats["cascade_rows"] > 5 * on_stats["cascade_steps"]


def test_fuzzed_workload_same_tokens_with_preemption(tiny_text_model):
    """Shared prefixes, n > 1 copies, aborts, a pool small enough to preempt and evict."""
    specs = [Spec(s.rid, s.prompt, SamplingParams(max_tokens=s.params.max_tokens, temperature=0.0),
                  s.abort_after) for s in shared_prefix_specs(120, seed=5)]
    kw = dict(max_total_tokens=700, chunked_prefill_size=24, max_prefill_tokens=96)
    off, _ = _run(tiny_text_model, specs, "off", **kw)
    on, stats = _run(tiny_text_model, specs, "on", **kw)
    assert on == off
    assert stats["cascade_steps"] > 0 and stats["num_preemptions"] > 0


def test_auto_rule_skips_short_prefixes(tiny_text_model):
    specs = group_specs(groups=2, per_group=4, prefix_len=40, seed=2)  # below min_shared_len
    out, stats = _run(tiny_text_model, specs, "auto")
    assert stats["cascade_steps"] == 0


def test_rule_scales_with_the_models_kv_bytes():
    """The step threshold is a fixed cost in KV bytes: 8x the tokens with 1 KV head than 8.
    Qwen3-0.6B's sits between the H100 crossover's losers (<= 31k saved) and winners (>= 57k)."""
    qwen = CascadeRule.for_model(32, 33, kv_bytes_per_token=2 * 28 * 8 * 128 * 2)
    one_head = CascadeRule.for_model(32, 33, kv_bytes_per_token=2 * 28 * 1 * 128 * 2)
    assert 31_000 < qwen.min_saved_tokens < 57_000
    assert abs(one_head.min_saved_tokens - 8 * qwen.min_saved_tokens) <= 8


# ---- grouping from the tree (host only) ----
def _admitted(cache: PrefixCache, tokens: list[int], slot: int, computed: int | None = None) -> Request:
    req = Request(f"q{slot}", tokens, SamplingParams(max_tokens=4), seed=0, max_samples=4)
    req.slot, req.prefill_target = slot, len(tokens)
    cache.admit(req)
    req.kv_slots += cache.alloc(len(tokens) - req.cached_len)
    req.num_computed = len(tokens) if computed is None else computed
    return req


def _one_prefix_four_readers(cache: PrefixCache) -> tuple[Request, list[Request]]:
    """A request that cached a 50-token prefix, and three admitted after it that read it."""
    prefix = list(range(100, 150))
    first = _admitted(cache, prefix + [1, 2], slot=1)
    cache.cache_prefill(first)
    return first, [_admitted(cache, prefix + [3 + i, 9], slot=2 + i) for i in range(3)]


def test_plan_groups_rows_reading_the_same_node():
    cache = PrefixCache(SlotAllocator(400))
    first, others = _one_prefix_four_readers(cache)
    lone = _admitted(cache, list(range(500, 560)), slot=9)
    rows = [others[0], lone, first, others[1], others[2]]  # each row's request
    plan = plan_cascade(rows, CascadeRule.forced(max_group_rows=16))
    assert plan.group_indptr == [0, 4] and sorted(plan.group_rows) == [0, 2, 3, 4]
    assert plan.shared_lens == [50, 0, 50, 50, 50]
    leader = rows[plan.group_rows[0]].slot
    assert plan.shared_src == [leader, 9, leader, leader, leader]
    # Larger groups are cut to the tile; the rule's thresholds drop short prefixes.
    cut = plan_cascade(rows, CascadeRule.forced(max_group_rows=2))
    assert cut.group_indptr == [0, 2, 4]
    assert plan_cascade(rows, CascadeRule(min_shared_len=51, min_group_rows=2, min_saved_tokens=0)) is None
    assert plan_cascade(rows, CascadeRule(min_shared_len=50, min_group_rows=5, min_saved_tokens=0)) is None
    # The step-level rule: 4 rows x 50 shared tokens save 3 x 50 reads.
    assert plan_cascade(rows, CascadeRule(min_shared_len=50, min_group_rows=4, min_saved_tokens=150)) is not None
    assert plan_cascade(rows, CascadeRule(min_shared_len=50, min_group_rows=4, min_saved_tokens=151)) is None


def test_memo_reuses_the_plan_only_for_the_same_rows_on_the_same_paths():
    cache = PrefixCache(SlotAllocator(400))
    first, others = _one_prefix_four_readers(cache)
    rows = [first, *others]
    rule, memo = CascadeRule.forced(max_group_rows=16), CascadeMemo()
    plan = plan_cascade(rows, rule, memo)
    assert plan_cascade(rows, rule, memo) is plan  # steady decode: the same rows, the same paths
    assert plan_cascade(rows[::-1], rule, memo) is not plan  # another order: planned again
    assert plan_cascade(rows[::-1], rule, memo).group_rows == [0, 1, 2, 3]
    fewer = plan_cascade(rows[:3], rule, memo)
    assert fewer.group_rows == [0, 1, 2]
    assert plan_cascade(rows, rule, memo).group_rows == [0, 1, 2, 3]  # a row back: planned again
    cache.cache_prefill(others[0])  # its cache_node moves down its own suffix: its path is read again
    again = plan_cascade(rows, rule, memo)
    assert again is not plan and again.shared_lens == plan.shared_lens


def test_copies_of_a_512_token_prompt_group_under_the_default_rule():
    """Copies of one prompt share all but its last token (each computes that one itself): the
    default length bound lets 16 copies of a 512-token prompt group at 511 shared tokens."""
    cache = PrefixCache(SlotAllocator(20_000))
    prompt = list(range(1000, 1512))
    first = _admitted(cache, prompt, slot=1)
    cache.cache_prefill(first)
    copies = [_admitted(cache, prompt, slot=2 + i) for i in range(15)]
    assert {c.cached_len for c in copies} == {511}
    rows = [first, *copies]
    plan = plan_cascade(rows, CascadeRule(min_saved_tokens=0))
    assert plan is not None and plan.group_indptr == [0, 16] and set(plan.shared_lens) == {511}
    assert plan_cascade(rows, CascadeRule(min_shared_len=512, min_saved_tokens=0)) is None


def test_a_path_read_before_a_split_is_read_again():
    """The request that computed a prefix reads its path (one node, its own) before others
    arrive; their admission splits that node, putting the shared part above the request's
    `cache_node` without changing it. The tree's split count makes the planner read it again:
    the first request groups with the rest (it did not before session 41)."""
    cache = PrefixCache(SlotAllocator(400))
    prefix = list(range(100, 150))
    first = _admitted(cache, prefix + [1, 2], slot=1)
    cache.cache_prefill(first)
    rule, memo, stale = CascadeRule.forced(max_group_rows=16), CascadeMemo(), CascadeMemo()
    before = cache.tree.splits
    for m in (memo, stale):  # alone: nothing to group
        assert plan_cascade([first], rule, m, before) is None
    others = [_admitted(cache, prefix + [3 + i, 9], slot=2 + i) for i in range(3)]
    assert cache.tree.splits > before and first.cache_node.parent is not cache.tree.root
    rows = [first, *others]
    assert plan_cascade(rows, rule, memo, cache.tree.splits).shared_lens == [50, 50, 50, 50]
    # Under the count it was read at, the first request's path from before the split is reused.
    assert plan_cascade(rows, rule, stale, before).shared_lens == [0, 50, 50, 50]


def test_every_row_of_a_running_group_decodes_grouped(tiny_text_model):
    """The shared-prefix workload at steady decode: each group's first request (which computed
    the prefix) is grouped too, so no row attends its whole context in the suffix part."""
    engine = _engine(tiny_text_model, "on")
    specs = group_specs(groups=2, per_group=4, prefix_len=40, seed=3)
    for spec in specs:
        engine.add_request(spec.prompt, SamplingParams(max_tokens=30, **GREEDY), request_id=spec.rid)
    grouped = []
    for _ in range(12):
        engine.step()
        plan, reqs = engine.runner.cascade_memo.plan, engine.runner.cascade_memo.reqs
        if plan is not None and len(reqs) == len(specs):
            grouped.append(sorted(plan.shared_lens))
    assert grouped and all(lens == [40] * len(specs) for lens in grouped[-3:]), grouped


def test_rows_sharing_only_a_node_too_short_to_group_get_no_plan():
    """Rows whose shallowest long-enough node is their own share nothing deeper either: no plan,
    though a rule that groups any length groups them at the short node."""
    cache = PrefixCache(SlotAllocator(2000))
    head = [7]  # a one-token node all rows share: below min_shared_len, so no group
    rows = []
    for i in range(4):  # each cached before the next is admitted: the next matches the shared token
        rows.append(_admitted(cache, head + [300 + 50 * i + j for j in range(300)], slot=1 + i))
        cache.cache_prefill(rows[-1])
    rule = CascadeRule(min_shared_len=256, min_group_rows=2, min_saved_tokens=0)
    assert plan_cascade(rows, rule) is None
    assert plan_cascade(rows, CascadeRule.forced(max_group_rows=16)).shared_lens == [1, 1, 1, 1]


def test_plan_excludes_duplicate_copies():
    """A request that computed its own copy of a prefix cached meanwhile reads its own slots:
    it must not join the group of the tree's copy."""
    cache = PrefixCache(SlotAllocator(400))
    prefix = list(range(100, 150))
    a = _admitted(cache, prefix + [1], slot=1)
    b = _admitted(cache, prefix + [2], slot=2)  # admitted before a's prefix was cached: no match
    cache.cache_prefill(a)
    cache.cache_prefill(b)  # b's first 50 slots duplicate a's
    assert b.duplicate_slots and b.cached_len == 51
    c = _admitted(cache, prefix + [3], slot=3)
    plan = plan_cascade([a, b, c], CascadeRule.forced(max_group_rows=16))
    assert plan.shared_lens == [50, 0, 50] and plan.group_rows == [0, 2]


class _EagerGraphs(DecodeGraphs):
    """The CUDA-graph layout on the CPU: a 'replay' runs the captured function eagerly on the
    staged views it would read, so the padded inputs and the runner's graph path are tested."""

    cascade_replays = 0

    def replay(self, bucket: int, ring: int, req_slots, cascade: bool = False):
        self.cascade_replays += cascade
        return self.forward(self.graph_views(self.feed(bucket, ring, cascade), bucket, cascade), bucket, cascade)


def _with_graph_layout(engine: Engine, per_ring_slot: bool = True) -> Engine:
    e = engine
    e.runner.graphs = _EagerGraphs(e.model, e.kv, e.table, e.backend, e.future_map, e.streams, e.stager,
                                   [1, 2, 4, 8, 16, 32], e.max_model_len, cascade=e.runner.cascade,
                                   per_ring_slot=per_ring_slot)
    return e


def test_graph_layout_same_tokens(tiny_text_model):
    """Both sides through the graph layout: its attention spans the model's whole context
    (a graph's bound), whose float32 sums differ from the eager path's in the last bits."""
    specs = group_specs(groups=3, per_group=5, prefix_len=61, seed=3)
    kw = dict(chunked_prefill_size=32, max_prefill_tokens=64)
    runs = {}
    for mode in ("off", "on"):
        engine = _with_graph_layout(_engine(tiny_text_model, mode, **kw))
        runs[mode] = run_workload(engine, specs, arrive_per_step=64)
        assert_kv_conserved(engine)
    assert runs["on"] == runs["off"]
    assert engine.runner.graphs.cascade_replays == engine.stats()["cascade_steps"] > 5


def test_one_graph_per_bucket_fed_from_the_ring_gives_the_same_tokens(tiny_text_model):
    """`decode_graph_per_ring_slot` off: every step's ring slot is copied into the graphs' own
    inputs before the replay; with cascade groups (their layout after the decode fields) and
    without, the tokens of the graphs read in place."""
    specs = group_specs(groups=3, per_group=5, prefix_len=61, seed=3)
    kw = dict(chunked_prefill_size=32, max_prefill_tokens=64)
    for mode in ("off", "on"):
        runs = {}
        for per_ring_slot in (True, False):
            engine = _with_graph_layout(_engine(tiny_text_model, mode, **kw), per_ring_slot)
            runs[per_ring_slot] = run_workload(engine, specs, arrive_per_step=64)
            assert_kv_conserved(engine)
        assert runs[False] == runs[True]
        graphs = engine.runner.graphs
        assert graphs.inputs is not None and graphs.feed(4, 1, False) == 0


def test_triton_backend_same_tokens(tiny_text_model):
    """The Triton backend's cascade wiring, interpreted on the CPU (float32): a small run."""
    pytest.importorskip("triton")
    specs = group_specs(groups=2, per_group=3, prefix_len=45, seed=7)
    runs, steps = {}, {}
    for mode in ("off", "on"):
        engine = _engine(tiny_text_model, mode, attention_backend="triton")
        runs[mode] = run_workload(engine, specs, arrive_per_step=64)
        steps[mode] = engine.stats()["cascade_steps"]
    assert runs["on"] == runs["off"]
    assert steps["off"] == 0 and steps["on"] > 3


def test_n_samples_decode_as_one_group(tiny_text_model):
    """n > 1 shares the prompt through the cache, so its samples decode as one group; seeded
    sampling gives the same tokens with the path on and off."""
    from tandem import LLM
    prompt = list(range(10, 130))
    params = SamplingParams(n=4, temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    outs, steps = {}, {}
    for mode in ("off", "on"):
        llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32",
                  experiments=Experiments(cascade_attention=mode))
        outs[mode] = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
        steps[mode] = llm.engine.stats()["cascade_steps"]
    assert outs["on"] == outs["off"] and len(set(map(tuple, outs["on"]))) > 1
    assert steps["off"] == 0 and steps["on"] >= 8
