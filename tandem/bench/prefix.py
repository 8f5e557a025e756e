"""`tandem bench prefix`: workloads that share prompt prefixes, prefix cache on vs off.

Workloads (random token ids, EOS ignored, fixed seed; greedy):
- shared: SGLang's "generated-shared-prefix" shape, G groups x R requests, each group one
  system prompt of S tokens, each request its own question of Q tokens, O output tokens; all
  requests arrive at once.
- multiturn: C conversations x T turns; every turn resends the whole history (earlier prompts
  and the tokens the engine generated) plus Q new tokens, and arrives when the previous turn of
  its conversation finished (closed loop).
- standard: DESIGN.md's offline workload (N requests, input and output U[100, 1024]), no
  sharing: what the cache costs when it cannot help.
- samples: n samples of each of P prompts (P x n requests, prompt length S, O output tokens,
  temperature 1, one seed per sample), all at once: n > 1 shares its prompt through the cache.

Cascade attention (decode rows sharing a cached prefix read it once per group) is the
`--cascade` experiment: auto (its cost rule), on (every shared prefix), off.

Each configuration runs in its own process (an engine does not give GPU memory back to a
second one in the same process); `--compare` runs cache on and off and prints both with their
ratios; `--compare-cascade` runs cache off, cache on without cascade and cache on with it;
`--compare-host-tier` runs the cache with the host tier (`--host-kv-cache-gb`) and without. Per
run: wall time, output tok/s, TTFT p50/p99 (arrival to first token seen by the host), prefix
hit rate (cached / looked-up prompt tokens) and its GPU and host-tier parts, host-tier copy
bandwidth each way (bytes / device time of the copies), host ms per step, GPU busy, and with a
host tier: the device time forwards waited for its copies and the tokens it moved by why
(prefetch and admission loads, write-ahead and eviction write-backs). `--experiment NAME=VALUE`
(repeatable) sets an `Experiments` field for an A/B.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass

import torch

from tandem.bench.presets import preset_dir
from tandem.config import EngineConfig, Experiments
from tandem.diagnostics.compiles import count_compiles
from tandem.diagnostics.gc_census import census
from tandem.diagnostics.profile import step_window
from tandem.diagnostics.phases import phase_timers
from tandem.diagnostics.timeline import IDLE_EPS_MS
from tandem.engine import Engine
from tandem.sampling import SamplingParams


@dataclass
class Turn:
    """One request to send: its prompt and output length; `conversation` chains turns.

    Prompts are tuples: a workload holds every prompt it will send (up to ~0.5M drawn tokens for
    the host tier's), and in lists a full pass of the garbage collector would walk them all,
    several ms a pass that a server, whose clients hold their own prompts, never pays (the
    engine copies a prompt it admits). The collector stops tracking a tuple of ints once a pass
    has seen it (session 49)."""

    prompt: tuple[int, ...]
    output_len: int
    conversation: int | None = None
    temperature: float = 0.0
    seed: int | None = None


class SharedPrefix:
    def __init__(self, groups: int, per_group: int, system_len: int, question_len: int,
                 output_len: int, vocab: int, seed: int):
        rng = random.Random(seed)
        systems = [[rng.randrange(vocab) for _ in range(system_len)] for _ in range(groups)]
        self.turns = [Turn(tuple(system + [rng.randrange(vocab) for _ in range(question_len)]), output_len)
                      for _ in range(per_group) for system in systems]
        rng.shuffle(self.turns)

    def initial(self) -> list[Turn]:
        return self.turns

    def follow_up(self, turn: Turn, output_ids: list[int]) -> Turn | None:
        return None


class MultiTurn:
    def __init__(self, conversations: int, turns: int, first_len: int, question_len: int,
                 output_len: int, vocab: int, seed: int):
        self.rng, self.vocab, self.turns = random.Random(seed), vocab, turns
        self.output_len = output_len
        self.sent = [1] * conversations
        self.first = [Turn(self._tokens(first_len), output_len, c) for c in range(conversations)]
        # Drawn now, not between engine steps: 1,024 draws took 3 ms of the measured loop's host time.
        self.questions = [[self._tokens(question_len) for _ in range(turns - 1)] for _ in range(conversations)]

    def _tokens(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(self.vocab) for _ in range(n))

    def initial(self) -> list[Turn]:
        return self.first

    def follow_up(self, turn: Turn, output_ids: list[int]) -> Turn | None:
        c = turn.conversation
        if self.sent[c] >= self.turns:
            return None
        question = self.questions[c][self.sent[c] - 1]
        self.sent[c] += 1
        return Turn((*turn.prompt, *output_ids, *question), self.output_len, c)


class Samples:
    def __init__(self, prompts: int, n: int, prompt_len: int, output_len: int, vocab: int, seed: int):
        rng = random.Random(seed)
        texts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(prompts)]
        self.turns = [Turn(tuple(text), output_len, temperature=1.0, seed=rng.randrange(1 << 30))
                      for text in texts for _ in range(n)]

    def initial(self) -> list[Turn]:
        return self.turns

    def follow_up(self, turn: Turn, output_ids: list[int]) -> Turn | None:
        return None


class Standard:
    def __init__(self, num_requests: int, vocab: int, seed: int, min_len: int = 100, max_len: int = 1024):
        rng = random.Random(seed)
        self.turns = [Turn(tuple(rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))),
                           rng.randint(min_len, max_len)) for _ in range(num_requests)]

    def initial(self) -> list[Turn]:
        return self.turns

    def follow_up(self, turn: Turn, output_ids: list[int]) -> Turn | None:
        return None


@dataclass
class PrefixRow:
    workload: str
    cache: bool
    cascade: str
    requests: int
    input_tokens: int
    output_tokens: int
    wall_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    hit_rate: float  # cached prompt tokens / prompt tokens looked up
    steps: int
    host_ms_per_step: float
    gpu_busy: float | None
    cascade_steps: int  # decode steps that grouped rows by shared prefix
    host_kv_cache_gb: float = 0.0
    host_hit_rate: float = 0.0  # the part of hit_rate loaded back from the host tier
    load_gb_s: float | None = None  # host -> GPU, per second of copy device time
    write_back_gb_s: float | None = None
    kernel_compiles: int = 0  # Triton builds inside the measured run (0 when warm-up covered it)
    compile_s: float = 0.0
    alloc_retries: int = 0  # CUDA caching-allocator retries (each frees cached blocks: a device sync)
    preemptions: int = 0  # the pool could not hold the running requests (their KV was dropped)
    tier_stall_s: float | None = None  # device time forwards waited for host-tier copies
    moved_tokens: dict | None = None  # host-tier tokens by why: prefetch, admission, write_ahead, eviction
    tier_window_ms: float | None = None  # host time a step's window spent queueing tier copies (mean)
    # Where the run's time went, by tenths of its steps (in launch order): the device's idle seconds
    # (CUDA; None on the CPU) and the mean batch size. Is an idle GPU the whole run or its tail?
    gpu_idle_s_by_tenth: list | None = None
    batch_by_tenth: list | None = None
    # The requests at or past TTFT p99: (ttft ms, turn of their conversation, plans they waited for
    # the host tier's prefetch), slowest first. Did the tail wait for prefetch, or in the queue?
    slowest: list | None = None
    # Per step kind ("prefill", "decode"): steps, device idle seconds before them, and median host
    # planning / launch and device forward ms. Which kind of step leaves the GPU idle, and why?
    by_kind: dict | None = None
    # Prefill steps that follow a decode step D (CUDA): the GPU idles for the host's path from the
    # result before D to the prefill's first kernel, less D (`prefill_gaps`).
    prefill_gaps: dict | None = None
    # `--phase-timers`: per host phase, [median, mean] ms per engine iteration, for iterations
    # that planned a prefill step, the ones before them, and decode-only ones (diagnostics.phases).
    phases: dict | None = None
    prefill_graph_steps: int = 0  # prefill steps that replayed a CUDA graph (the rest launched eagerly)
    cuda_graph_memory_mib: float = 0.0  # what the engine's graphs took at capture
    # Host tier: tokens admissions loaded themselves, by why they were not held for prefetch
    # (`prefix_cache.admission_load_reason`), and the forwards' copy stall by what they waited
    # for (`tier_stalls`). Which rule lets a forward wait for a copy?
    admission_loaded_by: dict | None = None
    tier_stall_by_cause: dict | None = None
    # The GPU's idle after the first tenth of the steps, by what the host did before the step
    # that waited (`idle_steps`): the garbage collector, a host-tier copy, or neither.
    idle_steps: dict | None = None
    # `--gc-census-at STEP`: what a full collector pass walked at that step of the measured run
    # (`diagnostics.gc_census`): tracked objects and elements by type, the biggest by owner.
    gc_census: dict | None = None
    ttft_p90_ms: float | None = None  # the tail's shoulder: did a change move p99 alone, or the tail?

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    def to_dict(self) -> dict:
        return {**asdict(self), "output_tok_s": self.output_tok_s, "gpu_hit_rate": self.hit_rate - self.host_hit_rate}


@dataclass
class FirstToken:
    """One request's time to first token, its turn in its conversation (0: first; 0 for requests
    without one) and the plans it waited for the host tier's prefetch before admission."""

    ttft_ms: float
    turn: int
    prefetch_waits: int


def drive(engine: Engine, workload, tag: str, clock=time.perf_counter) -> tuple[int, int, float, list[FirstToken]]:
    """Send the workload's requests (follow-ups as their predecessors finish) until all are
    done. Returns input tokens, output tokens, wall seconds and each request's first token.
    `clock` stamps arrivals and first tokens (the CPU replay's modeled device time:
    `tier_clock.ModeledClock`)."""
    arrival: dict[str, float] = {}
    turns: dict[str, Turn] = {}
    turn_of: dict[str, int] = {}
    sent: dict[int, int] = {}  # requests sent so far per conversation
    firsts: list[FirstToken] = []
    ids = iter(range(1 << 62))
    inputs = outputs = 0

    def send(turn: Turn) -> None:
        nonlocal inputs
        rid = f"{tag}-{next(ids)}"
        engine.add_request(turn.prompt, SamplingParams(max_tokens=turn.output_len, temperature=turn.temperature,
                                                       seed=turn.seed, ignore_eos=True), request_id=rid)
        arrival[rid], turns[rid] = clock(), turn
        turn_of[rid] = sent.get(turn.conversation, 0)
        if turn.conversation is not None:
            sent[turn.conversation] = turn_of[rid] + 1
        inputs += len(turn.prompt)

    _sync(engine.device)
    start = time.perf_counter()
    for turn in workload.initial():
        send(turn)
    while engine.has_unfinished():
        for out in engine.step():
            now = clock()
            if out.new_token_ids and out.request_id in arrival:  # its first token
                rid = out.request_id
                firsts.append(FirstToken((now - arrival.pop(rid)) * 1e3, turn_of.pop(rid),
                                         engine.requests[rid].prefetch_waits))
            if out.finished:
                got = engine.output(out.request_id).token_ids
                outputs += len(got)
                engine.release(out.request_id)
                nxt = workload.follow_up(turns.pop(out.request_id), got)
                if nxt is not None:
                    send(nxt)
    _sync(engine.device)
    return inputs, outputs, time.perf_counter() - start, firsts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def make_workload(args: argparse.Namespace, vocab: int, seed: int):
    if args.workload == "shared":
        return SharedPrefix(args.groups, args.per_group, args.system_len, args.question_len,
                            args.output_len, vocab, seed)
    if args.workload == "samples":
        return Samples(args.prompts, args.n, args.system_len, args.output_len, vocab, seed)
    if args.workload == "multiturn":
        return MultiTurn(args.conversations, args.turns, args.system_len, args.question_len,
                         args.output_len, vocab, seed)
    return Standard(args.num_requests, vocab, seed)


def run_one(args: argparse.Namespace) -> PrefixRow:
    model = preset_dir(args.preset) if args.preset else args.model
    engine = Engine(EngineConfig(model=model, dummy_weights=bool(args.preset), device=args.device,
                                 dtype=args.dtype, enable_prefix_caching=args.cache == "on",
                                 max_total_tokens=args.max_total_tokens, max_model_len=args.max_model_len,
                                 max_running_requests=args.max_running_requests,
                                 host_kv_cache_gb=args.host_kv_cache_gb,
                                 timeline=args.step_records or True, seed=0,  # the default warm-up, as users run it
                                 experiments=Experiments.from_overrides(
                                     [f"cascade_attention={args.cascade}", *args.experiment])))
    vocab = engine.model_config.vocab_size
    small = argparse.Namespace(**{**vars(args), "groups": min(args.groups, 2), "per_group": min(args.per_group, 2),
                                  "conversations": min(args.conversations, 2), "turns": min(args.turns, 2),
                                  "num_requests": min(args.num_requests, 8), "prompts": min(args.prompts, 2),
                                  "n": min(args.n, 2)})
    # After the engine's default warm-up (off here until session 38: on the H100 at 6fa100a an
    # 8,192-token eager prefill compiled in the first measured step, 859 ms), the workload's sizes.
    drive(engine, make_workload(small, vocab, seed=1_000 + args.seed), "warm")
    engine.reset_prefix_cache()
    for i in range(args.warm_passes):  # the whole workload: whatever the small one did not compile
        drive(engine, make_workload(args, vocab, args.seed), f"pass{i}")
        engine.reset_prefix_cache()
    retries = _alloc_retries(engine.device)
    s0, first = engine.stats(), len(engine.timeline.records)
    loaded_by0 = Counter(engine.prefix_cache.tier_moves.admission_loaded_by)
    window = (step_window(engine, *args.profile_steps) if args.profile_steps else contextlib.nullcontext([]))
    host_window = (step_window(engine, *args.host_profile_steps, rows=40, host=True) if args.host_profile_steps
                   else contextlib.nullcontext([]))
    timers = phase_timers(engine) if args.phase_timers else contextlib.nullcontext(None)
    at_step = census_at(engine, args.gc_census_at) if args.gc_census_at else contextlib.nullcontext({})
    with count_compiles() as compiles, window as tables, host_window as host_tables, timers as phase_log, \
            at_step as gc_census:
        inputs, outputs, wall, firsts = drive(engine, make_workload(args, vocab, args.seed), "run")
    ttft = [f.ttft_ms for f in firsts]
    ttft_p99 = _percentile(ttft, 99)
    for steps, table in [(args.profile_steps, t) for t in tables] + [(args.host_profile_steps, t) for t in host_tables]:
        print(f"steps {steps[0]}..{sum(steps)} of the measured run:\n{table}", file=sys.stderr)
    if engine.kv_tier is not None:
        engine.kv_tier.collect()  # drive() synchronized: every copy's time is known
    s1 = engine.stats()
    delta = {k: s1[k] - s0[k] for k in ("prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "cascade_steps",
                                        "host_cache_hit_tokens", "host_load_bytes", "host_load_seconds",
                                        "host_write_back_bytes", "host_write_back_seconds", "num_preemptions",
                                        "prefill_graph_steps", *MOVED_TOKENS.values())}
    queried = max(delta["prefix_cache_queried_tokens"], 1)
    summary = engine.timeline.summary(skip=first)
    loaded_by = dict(engine.prefix_cache.tier_moves.admission_loaded_by - loaded_by0)
    row = PrefixRow(args.workload, args.cache == "on", args.cascade, len(ttft), inputs, outputs, wall,
                     _percentile(ttft, 50), ttft_p99, delta["prefix_cache_hit_tokens"] / queried,
                     summary["steps"], summary["mean_host_ms"], summary.get("gpu_busy_fraction"),
                     delta["cascade_steps"], args.host_kv_cache_gb, delta["host_cache_hit_tokens"] / queried,
                     _gb_s(delta["host_load_bytes"], delta["host_load_seconds"]),
                     _gb_s(delta["host_write_back_bytes"], delta["host_write_back_seconds"]),
                     len(compiles.kernels), compiles.seconds, _alloc_retries(engine.device) - retries,
                     delta["num_preemptions"],
                     summary["gpu_tier_stall_ms"] / 1e3 if "gpu_tier_stall_ms" in summary else None,
                     {why: delta[key] for why, key in MOVED_TOKENS.items()} if engine.kv_tier is not None else None,
                     summary.get("mean_tier_window_ms"), *by_tenth(engine.timeline.records[first:]),
                     slowest(firsts, ttft_p99), by_kind(engine.timeline.records[first:]),
                     prefill_gaps(engine.timeline.records[first:]),
                     phase_log.summary() if phase_log is not None else None, delta["prefill_graph_steps"],
                     round(s1["cuda_graph_memory_mib"], 1), idle_steps=idle_steps(engine.timeline.records[first:]))
    if engine.kv_tier is not None:
        row.admission_loaded_by, row.tier_stall_by_cause = loaded_by, tier_stalls(engine.timeline.records[first:])
    row.gc_census = gc_census.get("census")
    row.ttft_p90_ms = _percentile(ttft, 90)
    return row


@contextlib.contextmanager
def census_at(engine: Engine, step: int):
    """For the block: the collector's census (`gc_census.census`) taken before the engine's
    `step`-th `step()` call from now, into the yielded dict's "census"."""
    taken, calls, step_fn = {}, [0], engine.step

    def counted():
        calls[0] += 1
        if calls[0] == step:
            taken["census"] = census()
        return step_fn()

    engine.step = counted  # an instance attribute: shadows the method until deleted
    try:
        yield taken
    finally:
        del engine.step


def tier_stalls(records: list) -> dict:
    """The forwards' waits for host-tier copies by cause (`KVTierCopier.require`): steps that
    waited, the device ms they waited, and the MB of copies not done when each was queued."""
    out: dict = {}
    for r in records:
        if r.gpu_tier_stall_ms is None:
            continue
        entry = out.setdefault(r.tier_stall_cause, {"steps": 0, "ms": 0.0, "pending_mb": 0.0})
        entry["steps"] += 1
        entry["ms"] = round(entry["ms"] + r.gpu_tier_stall_ms, 2)
        entry["pending_mb"] = round(entry["pending_mb"] + (r.tier_stall_pending_mb or 0.0), 1)
    return out


def idle_steps(records: list, worst: int = 8) -> dict | None:
    """Where the GPU idles after the first tenth of the steps (CUDA records; None on the CPU).
    A step idles when the host's iteration before it (previous launch to its launch) outlasts
    the previous forward. Per cause: steps and idle seconds where the garbage collector ran in
    that iteration (`gc`), else where the forward waited for a host-tier copy (`tier_stall`),
    else the rest; the collector's whole time and passes by generation; and the `worst` idle
    steps as [idle ms, kind, gc ms, gc generation, tier stall ms, iteration ms, previous forward
    ms, tier window ms, plan ahead ms, previous step's tokens, schedule ms, launch ms, queued
    after the previous result ms]. The last says whether the overlap held for that step: negative,
    it was queued before the host had the previous step's result; positive, only after (a plan
    that processed the step in flight first: the GPU then idles by the plan and the launch)."""
    if not any(r.gpu_forward_ms is not None for r in records):
        return None
    skip = max(len(records) // 10, 1)
    causes = {c: {"steps": 0, "idle_s": 0.0} for c in ("gc", "tier_stall", "other")}
    passes, rows = Counter(), []
    for before, r in zip(records[skip - 1:], records[skip:]):
        if r.gc_generation >= 0:
            passes[r.gc_generation] += 1
        idle = r.gpu_idle_before_ms or 0.0
        if idle <= IDLE_EPS_MS:
            continue
        cause = "gc" if r.gc_ms > 0 else "tier_stall" if r.gpu_tier_stall_ms else "other"
        causes[cause]["steps"] += 1
        causes[cause]["idle_s"] += idle / 1e3
        rows.append([round(idle, 2), "decode" if r.is_decode else "prefill", round(r.gc_ms, 2), r.gc_generation,
                     round(r.gpu_tier_stall_ms or 0.0, 2), round((r.launch_end - before.launch_end) * 1e3, 2),
                     before.gpu_forward_ms and round(before.gpu_forward_ms, 2), r.tier_window_ms and round(r.tier_window_ms, 2),
                     r.plan_ahead_ms and round(r.plan_ahead_ms, 2), before.num_tokens, round(r.schedule_ms, 2),
                     round(r.launch_ms, 2),
                     None if before.host_done is None else round((r.launch_end - before.host_done) * 1e3, 2)])
    for c in causes.values():
        c["idle_s"] = round(c["idle_s"], 4)
    return {"causes": causes, "gc_s": round(sum(r.gc_ms for r in records[skip:]) / 1e3, 4),
            "gc_passes": {str(g): n for g, n in sorted(passes.items())},
            "worst": sorted(rows, reverse=True)[:worst]}


def by_tenth(records: list) -> tuple[list | None, list]:
    """(device idle seconds, mean batch size) of each tenth of the steps, in launch order; the
    idle is None on the CPU (no device timings)."""
    n = len(records)
    tenths = [records[n * i // 10:n * (i + 1) // 10] for i in range(10)] if n else []
    batch = [round(statistics.mean(r.batch_size for r in t), 1) if t else None for t in tenths]
    if not any(r.gpu_forward_ms is not None for r in records):
        return None, batch
    idle = [round(sum(r.gpu_idle_before_ms or 0.0 for r in t) / 1e3, 3) for t in tenths]
    return idle, batch


def by_kind(records: list) -> dict:
    """Steps, idle seconds before them and median planning / launch / forward ms, per step kind;
    and the steps planned in the wait before them (`Scheduler.plan_ahead`, a prefill after a
    decode step) with their plans' [median, p90] ms: issue 23's prefill plans, on any device."""
    def median(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 2) if values else None

    def median_p90(values: list) -> list | None:
        return [round(statistics.median(values), 3), round(_percentile(values, 90), 3)] if values else None

    kinds = {}
    for kind, steps in (("prefill", [r for r in records if not r.is_decode]),
                        ("decode", [r for r in records if r.is_decode])):
        kinds[kind] = {"steps": len(steps),
                       "idle_s": round(sum(r.gpu_idle_before_ms or 0.0 for r in steps) / 1e3, 3),
                       "schedule_ms": median([r.schedule_ms for r in steps]),
                       "launch_ms": median([r.launch_ms for r in steps]),
                       "forward_ms": median([r.gpu_forward_ms for r in steps])}
        ahead = [r.plan_ahead_ms for r in steps if r.plan_ahead_ms is not None]
        kinds[kind].update(planned_ahead=len(ahead), plan_ahead_ms=median_p90(ahead))
    return kinds


def prefill_gaps(records: list) -> dict | None:
    """Where the GPU idles before a prefill step P that follows a decode step D (CUDA records;
    None on the CPU). The host waits for the step before D, processes it, plans P and launches
    it; D covers that path for as long as it runs. Per such P, medians over all of them and
    over the ones that idled: the idle, its device wait for host-tier copies (`stall`), the host
    time from the result before D to P's plan (`result_to_plan`), the plan, D's forward, and
    the launch prologue they imply (idle - stall - result_to_plan - plan + D: host time before
    P's first kernel), P's whole host launch (`launch`: its inputs built and staged, then its
    kernels or graph queued), its plan made in an earlier wait (`plan_ahead`, 0 when planned
    when due) and its inputs staged there (`stage_ahead`, 0 when staged at its launch). The
    first tenth of the steps (the queue filling) is left out."""
    if not any(r.gpu_forward_ms is not None for r in records):
        return None
    gaps = []
    for i in range(max(len(records) // 10, 2), len(records)):
        p, d, before = records[i], records[i - 1], records[i - 2]
        if p.is_decode or not d.is_decode or None in (p.gpu_idle_before_ms, d.gpu_forward_ms, before.host_done):
            continue
        stall = p.gpu_tier_stall_ms or 0.0
        result_to_plan = (p.host_start - before.host_done) * 1e3
        gaps.append({"idle": p.gpu_idle_before_ms, "stall": stall, "result_to_plan": result_to_plan,
                     "plan": p.schedule_ms, "decode_forward": d.gpu_forward_ms,
                     "prologue": p.gpu_idle_before_ms - stall - result_to_plan - p.schedule_ms + d.gpu_forward_ms,
                     "launch": p.launch_ms, "plan_ahead": p.plan_ahead_ms or 0.0,
                     "stage_ahead": p.stage_ahead_ms or 0.0})
    if not gaps:
        return {"steps": 0}
    idled = [g for g in gaps if g["idle"] > IDLE_EPS_MS]

    def medians(rows: list[dict]) -> dict:
        return {k: round(statistics.median(g[k] for g in rows), 2) for k in rows[0]} if rows else {}

    return {"steps": len(gaps), "idled": len(idled), "idle_s": round(sum(g["idle"] for g in gaps) / 1e3, 3),
            "all": medians(gaps), "where_idle": medians(idled)}


def slowest(firsts: list[FirstToken], ttft_p99: float) -> list[list]:
    """The requests at or past TTFT p99, slowest first, as [ttft ms, turn, prefetch waits]."""
    tail = sorted((f for f in firsts if f.ttft_ms >= ttft_p99), key=lambda f: -f.ttft_ms)
    return [[round(f.ttft_ms, 1), f.turn, f.prefetch_waits] for f in tail]


MOVED_TOKENS = {"prefetch": "host_prefetch_tokens", "admission": "host_admission_load_tokens",
                "write_ahead": "host_write_ahead_tokens", "eviction": "host_eviction_write_back_tokens"}


def _alloc_retries(device: torch.device) -> int:
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


def _gb_s(num_bytes: int, seconds: float) -> float | None:
    return num_bytes / seconds / 1e9 if seconds > 0 else None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tandem bench prefix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["shared", "multiturn", "standard", "samples"], default="shared")
    ap.add_argument("--preset", help="model shape with dummy weights (qwen3-0.6b, llama-3.1-8b, tiny)")
    ap.add_argument("--model", help="a model path instead of a preset (default: the built-in model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--cache", choices=["on", "off"], default="on")
    ap.add_argument("--cascade", choices=["auto", "on", "off"], default=Experiments().cascade_attention,
                    help="cascade attention (shared prefixes read once per group; default: the engine's)")
    ap.add_argument("--compare", action="store_true", help="run cache on and off, each in its own process")
    ap.add_argument("--compare-cascade", action="store_true",
                    help="run cache off, cache on + cascade off, cache on + --cascade (auto when off)")
    ap.add_argument("--host-kv-cache-gb", type=float, default=0.0, help="the prefix cache's host tier (0: off)")
    ap.add_argument("--compare-host-tier", action="store_true",
                    help="run the cache with --host-kv-cache-gb and without, each in its own process")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=2048, help="shared system prompt (first turn) length")
    ap.add_argument("--question-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--num-requests", type=int, default=256, help="standard workload size")
    ap.add_argument("--prompts", type=int, default=64, help="samples workload: distinct prompts")
    ap.add_argument("--n", type=int, default=16, help="samples workload: samples per prompt")
    ap.add_argument("--max-total-tokens", type=int)
    ap.add_argument("--max-running-requests", type=int, default=256,
                    help="concurrency cap (shared KV lets more requests fit: try 512 for shared)")
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-passes", type=int, default=0,
                    help="run the whole workload this many times before the measured run (kernel variants it "
                         "meets compiled; the row's kernel_compiles shows whether that was needed)")
    ap.add_argument("--profile-steps", type=int, nargs=2, metavar=("FIRST", "COUNT"),
                    help="profile COUNT engine steps of the measured run from step FIRST (its timings then include "
                         "the profiler's); prints the ops by device time to stderr")
    ap.add_argument("--host-profile-steps", type=int, nargs=2, metavar=("FIRST", "COUNT"),
                    help="cProfile COUNT engine steps of the measured run from step FIRST; prints the functions by "
                         "cumulative host time to stderr (where a host-bound step's time goes)")
    ap.add_argument("--step-records", metavar="PATH",
                    help="write every engine step's timeline record here (JSON lines; the warm-up passes' too)")
    ap.add_argument("--phase-timers", action="store_true",
                    help="time the host phases of every engine iteration of the measured run (planning, admission, "
                         "eviction, tier copies, launch, processing); the row's `phases`")
    ap.add_argument("--gc-census-at", type=int, metavar="STEP",
                    help="at this engine step of the measured run, count what a full collector pass walks (by type, "
                         "the biggest containers by owner) and time one; the row's `gc_census`")
    ap.add_argument("--experiment", action="append", default=[], metavar="NAME=VALUE",
                    help="an Experiments field for an A/B (repeatable; booleans on/off)")
    ap.add_argument("--json", help="write the rows here")
    return ap


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not (args.compare or args.compare_cascade or args.compare_host_tier):
        row = run_one(args).to_dict()
        print(json.dumps(row))
        _write_rows(args.json, [row])
        return 0
    gb = str(args.host_kv_cache_gb)
    if args.compare_cascade:
        configs = [("off", "off", gb), ("on", "off", gb), ("on", "auto" if args.cascade == "off" else args.cascade, gb)]
    elif args.compare_host_tier:
        configs = [("on", args.cascade, gb), ("on", args.cascade, "0")]
    else:
        configs = [("on", args.cascade, gb), ("off", args.cascade, gb)]
    rows = []
    for cache, cascade, host_gb in configs:
        cmd = [sys.executable, "-m", "tandem.bench.prefix", *_without_compare(argv), "--cache", cache,
               "--cascade", cascade, "--host-kv-cache-gb", host_gb]
        if args.step_records:  # one file per configuration
            cmd += ["--step-records", f"{args.step_records}.cache-{cache}.cascade-{cascade}.host-{host_gb}"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(format_table(rows, "host tier" if args.compare_host_tier else "cache"))
    _write_rows(args.json, rows)
    return 0


def _write_rows(path: str | None, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


_PER_CONFIG = ("--cache", "--json", "--cascade", "--host-kv-cache-gb", "--step-records")  # set per run by main


def _without_compare(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--compare", "--compare-cascade", "--compare-host-tier"):
            continue
        elif a in _PER_CONFIG:
            skip = True
        elif not a.startswith(tuple(f"{o}=" for o in _PER_CONFIG)):
            out.append(a)
    return out


def format_table(rows: list[dict], compared: str = "cache") -> str:
    cols = ["workload", "cache", "cascade", "host_kv_cache_gb", "requests", "output_tok_s", "ttft_p50_ms",
            "ttft_p90_ms", "ttft_p99_ms", "hit_rate", "gpu_hit_rate", "host_hit_rate", "load_gb_s", "write_back_gb_s",
            "host_ms_per_step", "gpu_busy", "tier_stall_s", "tier_window_ms", "moved_tokens", "cascade_steps", "kernel_compiles",
            "compile_s", "alloc_retries", "preemptions", "wall_s"]
    lines = [" | ".join(cols)]
    for r in rows:
        lines.append(" | ".join(_fmt(r.get(c)) for c in cols))
    if len(rows) == 3:  # --compare-cascade: cache off, cache on, cache on + cascade
        off, on, cascade = rows
        lines.append(f"cascade: throughput x{cascade['output_tok_s'] / off['output_tok_s']:.2f} of cache off, "
                     f"x{cascade['output_tok_s'] / on['output_tok_s']:.2f} of cache on without cascade")
        return "\n".join(lines)
    on, off = rows[0], rows[1]
    lines.append(f"{compared} on/off: throughput x{on['output_tok_s'] / off['output_tok_s']:.2f}, "
                 f"TTFT p50 x{off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f} lower, "
                 f"p99 x{off['ttft_p99_ms'] / on['ttft_p99_ms']:.2f} lower")
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
