"""Warm start: pay every first-use cost before the first real request does.

Triton compiles a kernel per specialization of its arguments (integers equal to 1 or divisible
by 16 get their own), cuBLAS picks and loads kernels per shape, and CUDA loads modules lazily.
Left to the first requests, that is seconds of TTFT for whoever comes first (seen: TTFT p99
1.7 s against a 27 ms p50 at 16 req/s from a cold server). So the engine runs, once at start,
the shape classes serving hits: prefills of assorted lengths alone and together (chunked where
long), prefill steps just past the largest prefill graph (they run eagerly), a mixed step when
mixed batches are on, decode at every CUDA-graph bucket and eagerly
above them (a cascade step too, when cascade attention is on), and each sampling path (greedy, top-k/top-p/min-p, penalties, logprobs). Then it
forgets them: the prefix cache and its counters are reset.
"""
from __future__ import annotations

import random
import time

from tandem.kernels.grid import cdiv
from tandem.sampling import SamplingParams


def warm_up_lengths(max_model_len: int, chunk: int) -> list[int]:
    """Prompt lengths covering Triton's integer specializations (1, multiples of 16, others)
    and a prompt long enough to be chunked."""
    wanted = {1, 2, 15, 16, 17, 100, 255, 256, chunk + 3}
    return sorted(n for n in wanted if n <= max_model_len - 4)


def eager_prefill_steps(largest_graphed: int, budget: int, longest: int, max_rows: int) -> list[list[int]]:
    """Prompt lengths of two prefill steps just past the largest prefill graph, which serving
    runs eagerly: one of a multiple of 16 tokens, one of 16k + 1. Prompts of at most `longest`
    tokens (not chunked), at most `max_rows` of them (one step); none past the step budget.
    (Without them, graphs up to 6,656 tokens left the eager path's kernels to the first such
    step while serving: the H200 suite's 128 req/s TTFT p99 went 77 -> 369-825 ms.)"""
    if longest < 1:
        return []
    steps = []
    aligned = cdiv(largest_graphed + 1, 16) * 16  # the first multiple of 16 past the largest graph
    for total in (aligned, aligned + 1):
        if total > budget:
            continue
        lengths = [longest] * (total // longest) + ([total % longest] if total % longest else [])
        if len(lengths) <= max_rows:
            steps.append(lengths)
    return steps


def warm_up(engine) -> float:
    """Run the warm-up workload through `engine.step()`; returns the seconds it took."""
    started = time.monotonic()
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    cfg = engine.cfg
    chunk = cfg.chunked_prefill_size or cfg.max_prefill_tokens
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=1,
                              ignore_eos=True),
               SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.1, presence_penalty=0.2,
                              frequency_penalty=0.2, logprobs=5, ignore_eos=True)]

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    lengths = warm_up_lengths(engine.max_model_len, chunk)
    for n in lengths:  # one at a time: batch of one, every length class
        _run(engine, [(prompt(n), greedy)])
    _run(engine, [(prompt(n), greedy) for n in lengths] + [(prompt(16), p) for p in sampled])
    prefill_graphs = engine.runner.prefill_graphs
    if prefill_graphs is not None:  # eager prefill past the largest graph
        longest = min(chunk, engine.max_model_len - 4)
        for step in eager_prefill_steps(prefill_graphs.buckets[-1].tokens, cfg.max_prefill_tokens, longest,
                                        cfg.max_running_requests):
            _run(engine, [(prompt(n), greedy) for n in step])
    graphs = engine.runner.graphs
    decode_batches = sorted(set(graphs.buckets) | {graphs.max_batch + 1}) if graphs is not None else [1, 3, 16]
    for b in decode_batches:  # decode at every graph bucket, and eagerly past the largest
        b = min(b, cfg.max_running_requests)
        _run(engine, [(prompt(3), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
                      for _ in range(b)])
    rule = engine.runner.cascade
    if rule is not None:  # an eager cascade step (graphs compiled theirs at capture): one shared prompt
        rows = min(decode_batches[-1], cfg.max_running_requests)
        enough = max(rule.min_shared_len, rule.min_saved_tokens // max(rows - 1, 1)) + 16  # the rule groups it
        shared = prompt(min(enough, engine.max_model_len - 8))
        _run(engine, [(shared, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))] * rows)
    engine.reset_prefix_cache()
    engine.prefix_cache.hit_tokens = engine.prefix_cache.queried_tokens = engine.prefix_cache.host_hit_tokens = 0
    if engine.kv_tier is not None:  # the warm-up's host-tier copies are not news either
        engine.kv_tier.reset_stats()
    engine.scheduler.num_preemptions = 0  # a small pool preempts during the warm-up: not news
    engine.scheduler.steps_planned_ahead = 0  # nor plans it made ahead
    engine.runner.steps_staged_ahead = 0  # nor their inputs staged ahead
    engine.runner.cascade_steps = engine.runner.cascade_rows = 0  # nor its cascade step
    return time.monotonic() - started


def _run(engine, requests: list[tuple[list[int], SamplingParams]]) -> None:
    rids = [engine.add_request(p, sp, request_id=f"warm-up-{engine.step_id}-{i}")
            for i, (p, sp) in enumerate(requests)]
    while engine.has_unfinished():
        engine.step()
    for rid in rids:
        engine.release(rid)
