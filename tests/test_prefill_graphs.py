"""Prefill steps replayed as CUDA graphs (tandem.prefill_graphs): the buckets, the padded layout
with its block table, and the same tokens as eager prefill steps. On the CPU the fixed-shape
work runs eagerly (capture=False) through the Triton backend, interpreted; on CUDA the engine's
own captured graphs run."""
import random
from dataclasses import replace

import pytest
import torch

from tandem.config import EngineConfig, Experiments
from tandem.engine import Engine
from tandem.kernels.grid import cdiv
from tandem.memory_budget import graph_reserve
from tandem.prefill_graphs import (LARGEST_BUCKET, PREFILL_FIELDS, PrefillBucket, PrefillGraphs, graph_token_limit,
                                   graphable, prefill_buckets, prefill_graph_metadata)
from tandem.request import Request
from tandem.sampling import SamplingParams
from tandem.scheduler.batch import Row, ScheduledBatch
from test_prefix_cache import shared_prefix_specs
from tiny_models import TEST_DEVICE
from workload import assert_kv_conserved, random_specs, run_workload, step_without_host_syncs


def test_token_limit_follows_the_model_size():
    assert graph_token_limit(600_000_000, 8192) == 6666  # Qwen3-0.6B: buckets up to 6,656 tokens
    assert graph_token_limit(100_000_000, 16384) == LARGEST_BUCKET == 8192  # the largest, whatever the model
    assert graph_token_limit(600_000_000, 8192, largest=2048) == 2048  # the experiment's A/B side
    assert graph_token_limit(8_000_000_000, 8192) == 500  # Llama-3.1-8B: buckets up to 256
    assert graph_token_limit(600_000_000, 1024) == 1024  # never past the step budget
    assert graph_token_limit(70_000_000_000, 8192) == 57  # 70B on one device: 16 and 32 tokens
    assert graph_token_limit(400_000_000_000, 8192) < 16  # every step GPU-bound: no graphs


def test_buckets_pad_at_most_2x_and_hold_an_eighth_of_their_tokens_in_prompts():
    buckets = prefill_buckets(2048, 64, 128)
    assert [b.tokens for b in buckets] == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert [b.rows for b in buckets][:6] == [2, 4, 8, 16, 32, 64] and buckets[-1].rows == 64
    for b in buckets:
        assert b.blocks == cdiv(b.tokens, 128) + b.rows + 1
    assert [b.tokens for b in prefill_buckets(500, 4, 128)] == [16, 32, 64, 128, 256]
    # Past 2,048 every 512 tokens (a step of dense work pads at most 25%).
    assert [b.tokens for b in prefill_buckets(6666, 64, 128)][11:] == [2048, 2560, 3072, 3584, 4096, 4608, 5120,
                                                                      5632, 6144, 6656]
    assert all(b.rows <= 4 for b in prefill_buckets(500, 4, 128))


def _prefill_batch(lens: list[int], prefixes: list[int], sampled: list[bool], step: int = 3) -> ScheduledBatch:
    rows, slot = [], 100
    for i, (n, p, s) in enumerate(zip(lens, prefixes, sampled)):
        req = Request(rid=f"r{i}", prompt_token_ids=list(range(1, p + n + 1)), params=SamplingParams(), seed=0, max_samples=1)
        req.slot = 3 + i
        rows.append(Row(req, p, list(range(slot, slot + n)), list(range(p + 1, p + n + 1)), 0 if s else None))
        slot += n
    return ScheduledBatch(step, rows)


@pytest.mark.parametrize("seed", range(6))
def test_metadata_pads_the_step_and_its_block_table_covers_every_query_block_once(seed):
    rng = random.Random(seed)
    block = rng.choice([16, 64, 128])
    lens = [rng.randint(1, 150) for _ in range(rng.randint(1, 6))]
    prefixes = [rng.choice([0, 0, rng.randint(1, 300)]) for _ in lens]
    sampled = [rng.random() < 0.7 for _ in lens]
    batch = _prefill_batch(lens, prefixes, sampled)
    bucket = next(b for b in prefill_buckets(2048, 64, block) if b.tokens >= sum(lens) and b.rows >= len(lens))
    f = prefill_graph_metadata(batch, bucket, block)
    assert tuple(f) == PREFILL_FIELDS and {k: len(v) for k, v in f.items()} == bucket.sizes()
    real, pad = sum(lens), bucket.tokens - sum(lens)
    assert f["input_ids"][:real] == [t for r in batch.rows for t in r.prefill_ids]
    positions, token_req = list(f["positions"]), list(f["token_req_slots"])
    assert f["out_cache_loc"][real:] == token_req[real:] == positions[real:] == [0] * pad
    # Real tokens: each row's positions from its cached prefix on, and its request slot.
    assert positions[:real] == [p + j for p, e in zip(prefixes, lens) for j in range(e)]
    assert token_req[:real] == [r.req.slot for r in batch.rows for _ in range(len(r.kv_slots))]
    # Rows: the real ones, the padding row (length 0, holding the padding tokens), then empty rows.
    n = len(lens)
    assert f["qo_indptr"][n] == real and f["qo_indptr"][n + 1:] == [bucket.tokens] * (bucket.rows + 1 - n)
    assert f["seq_lens"][:n] == [p + e for p, e in zip(prefixes, lens)] and not any(f["seq_lens"][n:])
    # Every query block of every row (the padding row's included) exactly once; the rest idle.
    extend = [f["qo_indptr"][i + 1] - f["qo_indptr"][i] for i in range(bucket.rows + 1)]
    active = [(r, j) for r, j in zip(f["block_rows"], f["block_index"]) if j * block < extend[r]]
    assert sorted(active) == [(r, j) for r in range(bucket.rows + 1) for j in range(cdiv(extend[r], block))]
    # Sampled rows: their last token, in row order; then padding.
    ends = [f["qo_indptr"][i + 1] - 1 for i in range(n) if sampled[i]]
    assert f["sample_token_idx"] == ends + [0] * (bucket.rows - len(ends))
    assert f["sample_slots"][:len(ends)] == [3 + i for i in range(n) if sampled[i]]


def test_only_prefill_steps_without_prompt_logprobs_are_graphed():
    batch = _prefill_batch([5, 9], [0, 0], [True, True])
    assert graphable(batch)
    batch.rows[1].prompt_logprobs = (0, 9)
    assert not graphable(ScheduledBatch(4, batch.rows))
    decode = Row(batch.rows[0].req, 5, [7], None, 1)
    assert not graphable(ScheduledBatch(5, [_prefill_batch([4], [0], [True]).rows[0], decode]))
    assert not graphable(ScheduledBatch(6, []))


def test_graph_reserve_covers_the_largest_prefill_bucket():
    gib = 2**30
    assert graph_reserve(256, 1000, 8 * gib, 8192, 2048) == 256 * 1000 * 4 + 2 * gib
    assert graph_reserve(256, 1000, 8 * gib, 8192, 0) == 256 * 1000 * 4 + 256 * 2**20


def _engine(path, prefill_graphs: bool, **kw) -> Engine:
    backend = {} if TEST_DEVICE == "cuda" else {"attention_backend": "triton"}  # CPU: interpreted kernels
    return Engine(EngineConfig(model=str(path), device=TEST_DEVICE, dtype="float32", seed=0,
                               experiments=Experiments(prefill_graphs=prefill_graphs), **backend, **kw))


def _with_prefill_graphs(engine: Engine) -> PrefillGraphs:
    """The engine's captured graphs on CUDA; on the CPU the same fixed-shape work run eagerly."""
    if engine.runner.prefill_graphs is None:
        from tandem.kernels.extend_attention import extend_block_rows
        e = engine
        block = extend_block_rows(e.model_config.head_dim)
        buckets = prefill_buckets(256, 8, block)
        logits = torch.empty(8, e.model_config.vocab_size, device=e.device)
        e.runner.prefill_graphs = PrefillGraphs(e.model, e.kv, e.table, e.backend, e.streams, e.stager, buckets,
                                                block, e.max_model_len, logits, capture=False)
    return engine.runner.prefill_graphs


def test_graphed_prefill_gives_the_eager_tokens(tiny_text_model):
    """Fresh prompts and prompts reusing cached prefixes (their table rows are written before
    the replay), greedy and seeded sampling, aborts: token for token the eager run's."""
    pytest.importorskip("triton")
    specs = shared_prefix_specs(8, seed=5) + [replace(s, rid=f"x{s.rid}") for s in random_specs(4, 1000, seed=6)]
    runs = {}
    for on in (False, True):
        engine = _engine(tiny_text_model, on, max_running_requests=8)
        graphs = _with_prefill_graphs(engine) if on else None
        assert on or engine.runner.prefill_graphs is None
        runs[on] = run_workload(engine, specs, arrive_per_step=6)
        assert_kv_conserved(engine)
    assert runs[True] == runs[False]
    assert graphs.replays == engine.stats()["prefill_graph_steps"] > 3


def test_graphed_prefill_with_ngram_speculation(tiny_text_model):
    """Speculation records each sampled token after its input's position: a graphed prefill
    step's sampled rows give those positions too."""
    pytest.importorskip("triton")
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    specs = random_specs(6, 1000, seed=8)
    runs = {}
    for on in (False, True):
        engine = _engine(tiny_text_model, on, max_running_requests=4, speculative_config=spec)
        graphs = _with_prefill_graphs(engine) if on else None
        runs[on] = run_workload(engine, specs, arrive_per_step=3)
    assert runs[True] == runs[False] and graphs.replays > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_prefill_queues_without_host_syncs(tiny_text_model):
    engine = _engine(tiny_text_model, True)
    graphs = engine.runner.prefill_graphs
    assert graphs is not None and graphs.graphs and engine.stats()["cuda_graph_memory_mib"] > 0
    for i in range(12):
        engine.add_request([5 + i, 6, 7, 8] * (2 + 3 * i), SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9,
                                                                        seed=i, ignore_eos=True), request_id=f"p{i}")
    step_without_host_syncs(engine)
    assert graphs.replays > 0 and all(len(engine.output(f"p{i}").token_ids) == 6 for i in range(12))
    engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_steps_past_the_largest_graph_build_no_kernel_after_the_warm_up(tiny_text_model):
    """Graphs up to 2,048 tokens under the 8,192-token step budget: larger prefill steps run
    eagerly. The warm-up ran such steps, so serving them builds no Triton kernel (before, the
    first one built the eager path's kernels inside its requests' TTFT)."""
    engine = Engine(EngineConfig(model=str(tiny_text_model), device="cuda", dtype="float32", seed=0, warm_up="on",
                                 experiments=Experiments(prefill_graph_max_tokens=2048)))
    assert engine.runner.prefill_graphs.buckets[-1].tokens == 2048
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for n, (count, length) in enumerate([(12, 200), (11, 211)]):  # 2,400 and 2,321 tokens: one eager step each
        for i in range(count):
            engine.add_request([(7 * i + j + 5 * n) % 400 + 3 for j in range(length)], params, request_id=f"s{n}-{i}")
        while engine.has_unfinished():
            engine.step()
    assert engine.stats()["kernel_builds_while_serving"] == 0, engine.builds_while_serving.kernels
    engine.close()
