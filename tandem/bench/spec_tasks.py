"""`tandem bench spec`: n-gram speculative decoding against plain decoding, per task, as
users run it (`LLM()` with default options, then the same with `speculative_config`).

Tasks (the issue's figures): three prompt-grounded ones, where the answer repeats text the
prompt holds (copy a passage, summarize it, edit code given in full), and free-form chat,
where it does not; four prompts each (`--prompts N`: the first N). Each prompt runs at batch
sizes B (B copies of it, greedy, or sampled at `--temperature` with a seed a row,
`--max-tokens` each) after an untimed warm-up of the same shape. A task's tok/s is its prompts'
output tokens over the sum of their median wall times (of `--repeat` timed runs). Reported:
plain and speculative tok/s and their ratio, each prompt's ratio and the first position where
the two sides' texts differ (bf16 on the GPU: the verify forward rounds differently from the
decode forward, and from there on the texts and their step counts differ), the mean acceptance
length (tokens a verify row emits), verify steps, and GPU busy from the step timeline (CUDA).
Real weights are what make acceptance meaningful: the default model is the built-in one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context

from tandem.bench.spec_prompts import ANSWER_STARTS, TASKS
from tandem.config import Experiments
from tandem.entrypoints.llm import LLM
from tandem.sampling import SamplingParams


def task_chat(task: str, prompt: int = 0) -> tuple[list[dict], dict]:
    """The messages of the task's prompt number `prompt`, and LLM.chat keywords."""
    messages = [{"role": "user", "content": TASKS[task][prompt]}]
    if task not in ANSWER_STARTS:
        return messages, {}
    messages.append({"role": "assistant", "content": ANSWER_STARTS[task]})
    return messages, {"add_generation_prompt": False, "continue_final_message": True}


@dataclass
class TaskRow:
    task: str
    batch: int
    plain_tok_s: float  # over all the task's prompts: their tokens over the sum of their median runs
    spec_tok_s: float
    speedup: float
    mean_acceptance_length: float | None
    verify_steps: int  # a run's, all its prompts together
    steps: int
    output_tokens: int
    spec_gpu_busy: float | None
    identical: bool  # every prompt's outputs equal plain decoding's (greedy; sampled: n-gram and coupled draws)
    # Each timed run's wall ms (all prompts), and the plain side's GPU busy: on the H200 (session 19) one plain
    # engine ran two tasks at half its speed on the others; these say whether a side's figure is
    # one slow run or a slow engine, and whether its GPU or its host was the slow part.
    plain_runs_ms: list[float] = field(default_factory=list)
    spec_runs_ms: list[float] = field(default_factory=list)
    plain_gpu_busy: float | None = None
    # Per prompt: plain median ms over speculative median ms, and the first output position where the
    # two sides' texts differ (None: identical). After it each side writes another text.
    prompt_speedups: list[float] = field(default_factory=list)
    first_difference: list[int | None] = field(default_factory=list)
    prompt_steps: list[list[int]] = field(default_factory=list)  # per prompt: [steps, verify steps] (speculative)
    # Per side and step kind of the timed runs (CUDA): [steps, median device forward ms]. The pause
    # rule's cost model (speculative/planner.py) in the engine's own figures: a plain step on each
    # side, a verify step with proposal slots, and one without (planned while a verify was in flight).
    plain_step_ms: dict = field(default_factory=dict)
    spec_step_ms: dict = field(default_factory=dict)


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """--model and --speculative-config, as every speculative benchmark takes them."""
    ap.add_argument("--model", help="model path (default: the built-in SmolLM2-135M-Instruct)")
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                                    '"prompt_lookup_max": 3}')


def timed_chat(llm: LLM, task: str, batch: int, max_tokens: int, warm: bool = True,
               temperature: float = 0.0, prompt: int = 0, stop_at_eos: bool = False) -> tuple[float, list, int]:
    """`batch` copies of the task's chat number `prompt`, greedy (or sampled at `temperature`, row i
    seeded i), after an untimed warm-up of the same shape (`warm`): (wall seconds, the outputs,
    the index of the timed run's first timeline record)."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=not stop_at_eos,
                             seed=i if temperature > 0 else None) for i in range(batch)]
    one, chat_kw = task_chat(task, prompt)
    messages = [one] * batch
    if warm:
        llm.chat(messages, params, use_tqdm=False, **chat_kw)
    timeline = llm.engine.timeline
    first = len(timeline.records) if timeline is not None else 0
    start = time.perf_counter()
    outs = llm.chat(messages, params, use_tqdm=False, **chat_kw)
    return time.perf_counter() - start, outs, first


def _timed(llm: LLM, task: str, batch: int, max_tokens: int, repeat: int, prompts: int,
           temperature: float = 0.0, stop_at_eos: bool = False) -> tuple[list[float], list[list[list[int]]], dict]:
    """Per prompt, the median wall time of `repeat` timed runs (these runs last ~0.3 s at batch 8:
    one run's figure moved 15 % between device calls) and the outputs; per-run step counters.
    Every prompt's warm-up runs first, so the GPU busy covers the timed runs only."""
    engine = llm.engine
    before = engine.stats()
    prompt_steps = []
    for prompt in range(prompts):  # each prompt's untimed warm-up, and its step counts (a run's)
        counts = _step_counts(engine)
        timed_chat(llm, task, batch, max_tokens, warm=False, temperature=temperature, prompt=prompt,
                   stop_at_eos=stop_at_eos)
        prompt_steps.append([b - a for a, b in zip(counts, _step_counts(engine))])
    first = len(engine.timeline.records) if engine.timeline is not None else 0  # the timed runs' records
    walls = [[] for _ in range(prompts)]
    outputs = []
    for i in range(repeat):
        for prompt in range(prompts):
            wall, outs, _ = timed_chat(llm, task, batch, max_tokens, warm=False, temperature=temperature,
                                       prompt=prompt, stop_at_eos=stop_at_eos)
            walls[prompt].append(wall)
            if i == 0:
                outputs.append([o.outputs[0].token_ids for o in outs])
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in after if k.startswith("spec_decode_num") and
             isinstance(after[k], int)}
    delta["runs_ms"] = [round(sum(w[i] for w in walls) * 1e3, 2) for i in range(repeat)]
    delta["steps"] = (after["steps"] - before["steps"]) // (repeat + 1)  # the warm-ups ran too
    delta["verify_steps"] = (after.get("spec_decode_verify_steps", 0)
                             - before.get("spec_decode_verify_steps", 0)) // (repeat + 1)
    delta["prompt_steps"] = prompt_steps  # per prompt: [steps, verify steps] of one run
    if engine.timeline is not None:
        delta["gpu_busy"] = engine.timeline.summary(skip=first).get("gpu_busy_fraction")
        delta["step_ms"] = forward_ms_by_kind(engine.timeline.records[first:])
    return [statistics.median(w) for w in walls], outputs, delta


def forward_ms_by_kind(records: list) -> dict[str, list]:
    """{kind: [steps, median device forward ms or None]} over step records, by kind: prefill,
    decode (plain), verify (with proposal slots), verify_empty (verify-shaped, no proposal)."""
    kinds: dict[str, list[float | None]] = {}
    for r in records:
        if r.verify_k is not None:
            kind = "verify" if r.verify_k else "verify_empty"
        else:
            kind = "decode" if r.is_decode else "prefill"
        kinds.setdefault(kind, []).append(r.gpu_forward_ms)
    return {kind: [len(ms), _median_or_none([m for m in ms if m is not None])] for kind, ms in kinds.items()}


def _median_or_none(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _step_counts(engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats["steps"], stats.get("spec_decode_verify_steps", 0)


def _side(kw: dict, config: dict | None, tasks: list[str], batches: list[int], max_tokens: int,
          repeat: int, prompts: int, temperature: float = 0.0,
          stop_at_eos: bool = False) -> dict[tuple[str, int], tuple]:
    """One side of the comparison (plain or speculative): every task and batch size, one engine."""
    llm = LLM(**kw, speculative_config=config)
    try:
        return {(task, b): _timed(llm, task, b, max_tokens, repeat, _prompt_count(task, prompts), temperature,
                                  stop_at_eos)
                for task in tasks for b in batches}
    finally:
        llm.close()


def _prompt_count(task: str, prompts: int | None) -> int:
    return len(TASKS[task]) if prompts is None else min(prompts, len(TASKS[task]))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's length if one is a
    prefix of the other); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _earliest_difference(plain_rows: list[list[int]], spec_rows: list[list[int]]) -> int | None:
    """A prompt's first difference: the earliest over its rows."""
    found = [i for i in map(first_difference, plain_rows, spec_rows) if i is not None]
    return min(found) if found else None


def run(model: str | None, spec: dict, tasks: list[str], batches: list[int], max_tokens: int,
        device: str, dtype: str, repeat: int = 3, same_process: bool = False,
        experiments: Experiments | None = None, temperature: float = 0.0,
        prompts: int | None = None, stop_at_eos: bool = False) -> list[TaskRow]:
    """Each side runs in a fresh process (`same_process`: one after the other in this one, plain
    first, as before session 15: the A/B). On the H200 a speculating engine created second in
    its process launched its plain decode steps in 0.93 ms against the first (plain) engine's
    0.66 ms, its whole host path uniformly slower; whether the order or the engine did it is
    what the A/B tells. `prompts`: the first this many of each task's prompts (None: all)."""
    kw = {"device": device, "dtype": dtype, "timeline": device != "cpu"}
    if experiments is not None:  # both sides (a speculation-only switch leaves the plain side as it is)
        kw["experiments"] = experiments
    if model is not None:
        kw["model"] = model
    sides = [(kw, config, tasks, batches, max_tokens, repeat, prompts, temperature, stop_at_eos)
             for config in (None, spec)]
    if same_process:
        plain, speculative = (_side(*args) for args in sides)
    else:
        plain, speculative = (_in_fresh_process(_side, args) for args in sides)
    return [_row(task, b, plain[(task, b)], speculative[(task, b)]) for (task, b) in plain]


def _row(task: str, batch: int, plain: tuple, speculative: tuple) -> TaskRow:
    """Rates are tokens over time: with `--stop-at-eos` the two sides' texts (bf16) may end at
    different lengths."""
    (plain_s, plain_ids, p), (spec_s, spec_ids, d) = plain, speculative
    plain_counts = [sum(map(len, rows)) for rows in plain_ids]  # per prompt
    spec_counts = [sum(map(len, rows)) for rows in spec_ids]
    plain_rate, spec_rate = sum(plain_counts) / sum(plain_s), sum(spec_counts) / sum(spec_s)
    drafts, accepted = d.get("spec_decode_num_drafts", 0), d.get("spec_decode_num_accepted_tokens", 0)
    differences = [_earliest_difference(a, b) for a, b in zip(plain_ids, spec_ids)]
    by_prompt = [round((n / t) / (m / u), 3) for n, t, m, u in zip(spec_counts, spec_s, plain_counts, plain_s)]
    return TaskRow(task, batch, plain_rate, spec_rate, spec_rate / plain_rate,
                   1 + accepted / drafts if drafts else None, d["verify_steps"], d["steps"], sum(spec_counts),
                   d.get("gpu_busy"), plain_ids == spec_ids, p["runs_ms"], d["runs_ms"], p.get("gpu_busy"),
                   by_prompt, differences, d["prompt_steps"], p.get("step_ms", {}), d.get("step_ms", {}))


def _in_fresh_process(fn, args: tuple):
    """fn(*args) in a new process (spawned: CUDA is not forked), its result returned."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tandem bench spec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of: {','.join(TASKS)}")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per row (the median is reported)")
    ap.add_argument("--prompts", type=int, default=None,
                    help=f"the first N of each task's prompts (default all, {len(TASKS['copy'])} a task)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature, row i with seed i (default greedy); 'same' then says "
                         "whether the sampled tokens are plain decoding's (coupled draws, n-gram)")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="rows end at the end-of-sequence token (default: it is ignored and every row writes "
                         "--max-tokens: past its answer the built-in model writes new, made-up turns, which the "
                         "prompt does not hold)")
    ap.add_argument("--same-process", action="store_true",
                    help="the A/B: both sides in this process, plain first (before session 15)")
    ap.add_argument("--experiment", action="append", default=[], metavar="NAME=VALUE",
                    help="an Experiments switch for both sides, e.g. spec_verify_min_match=1 (repeatable)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        ap.error(f"unknown task(s) {unknown}; known: {', '.join(TASKS)}")
    rows = run(args.model, json.loads(args.speculative_config), tasks,
               [int(b) for b in args.batch_sizes.split(",")], args.max_tokens, args.device, args.dtype, args.repeat,
               args.same_process, Experiments.from_overrides(args.experiment), args.temperature, args.prompts,
               args.stop_at_eos)
    print(f"{'task':10} {'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'x':>6} {'accept len':>10} "
          f"{'verify/steps':>13} {'gpu busy (plain / spec)':>23} same  {'x by prompt':>23}  first difference  "
          f"runs ms (plain / spec)")
    for r in rows:
        acc = f"{r.mean_acceptance_length:.2f}" if r.mean_acceptance_length else "-"
        busy = " / ".join(f"{b:.3f}" if b is not None else "-" for b in (r.plain_gpu_busy, r.spec_gpu_busy))
        runs = " / ".join(",".join(f"{w:.0f}" for w in side) for side in (r.plain_runs_ms, r.spec_runs_ms))
        by_prompt = ",".join(f"{x:.2f}" for x in r.prompt_speedups)
        differences = ",".join("-" if i is None else str(i) for i in r.first_difference)
        print(f"{r.task:10} {r.batch:5d} {r.plain_tok_s:12,.0f} {r.spec_tok_s:11,.0f} {r.speedup:6.2f} {acc:>10} "
              f"{r.verify_steps:6d}/{r.steps:<6d} {busy:>23} {r.identical!s:5} {by_prompt:>23}  {differences:16}  "
              f"{runs}")
    for r in rows:
        if r.spec_step_ms:
            kinds = "; ".join(f"{side} {kind} {n} x {ms} ms" for side, by_kind in (("plain", r.plain_step_ms),
                              ("spec", r.spec_step_ms)) for kind, (n, ms) in by_kind.items())
            print(f"{r.task:10} {r.batch:5d} device ms a step: {kinds}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"speculative_config": json.loads(args.speculative_config), "max_tokens": args.max_tokens,
                       "repeat": args.repeat, "prompts": args.prompts, "same_process": args.same_process,
                       "experiments": args.experiment,
                       "temperature": args.temperature, "stop_at_eos": args.stop_at_eos,
                       "rows": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
