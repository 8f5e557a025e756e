"""`tandem bench spec`: n-gram speculative decoding against plain decoding, per task, as
users run it (`LLM()` with default options, then the same with `speculative_config`).

Tasks (the issue's figures): three prompt-grounded ones, where the answer repeats text the
prompt holds (copy a passage, summarize it, edit code given in full), and free-form chat,
where it does not. Each runs at batch sizes B (B copies of the task's prompt, greedy, or
sampled at `--temperature` with a seed a row, `--max-tokens` each) after an untimed warm-up of the same shape; tok/s is output tokens over
the median wall time of `--repeat` timed runs. Reported: plain and speculative tok/s and their ratio, the mean acceptance length
(tokens a verify row emits), verify steps, and GPU busy from the step timeline (CUDA). Real
weights are what make acceptance meaningful: the default model is the built-in one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context

from tandem.config import Experiments
from tandem.entrypoints.llm import LLM
from tandem.sampling import SamplingParams

PASSAGE = (
    "The lighthouse stood at the end of a narrow spit of rock, and for forty years the same "
    "keeper had climbed its iron stairs every evening to light the lamp. Ships passing in the "
    "night saw its beam sweep across the water every twelve seconds, steady as a heartbeat. "
    "When the keeper finally retired, the town installed an automatic lamp, and the stairs "
    "gathered dust. But on stormy nights the fishermen still swore they could see a figure at "
    "the top of the tower, watching the sea, making sure the light never failed.\n\n"
    "Years later a young engineer came to inspect the automatic lamp. She found it in perfect "
    "order, its gears oiled and its lens polished, though no one in the town admitted to "
    "climbing the stairs. In the logbook on the keeper's desk, the last entry was dated the "
    "week he retired, but beneath it, in the same careful handwriting, someone had added a "
    "single line for every storm since: the date, the wind, and the words all ships safe. The "
    "engineer closed the book, put it back where she had found it, and wrote in her report "
    "that the lighthouse needed nothing at all.")
CODE = '''def moving_average(values, window):
    """Return the moving averages of `values` over `window` items."""
    averages = []
    for i in range(len(values) - window + 1):
        total = 0
        for j in range(i, i + window):
            total += values[j]
        averages.append(total / window)
    return averages


def moving_average_spread(values, window):
    """Return the largest minus the smallest moving average."""
    averages = moving_average(values, window)
    if not averages:
        return 0
    return max(averages) - min(averages)


def main():
    data = [3, 5, 7, 2, 8, 10, 11, 65, 72, 81, 99, 100, 150]
    print(moving_average(data, 3))
    print(moving_average_spread(data, 3))
'''
TASKS = {
    "copy": f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
    "summarize": f"Summarize the following passage in a few sentences, reusing its wording:\n\n{PASSAGE}",
    "edit_code": f"Rename the function moving_average to rolling_mean everywhere in this code and "
                 f"return the whole code:\n\n```python\n{CODE}```",
    "chat": "Write a short story about a robot who learns to paint. Be creative.",
}
GROUNDED = ("copy", "summarize", "edit_code")
# The answer's first words, given as the start of the assistant's turn (continue_final_message).
# Asked to edit plainly, the built-in 135M model echoed the instruction and went on to free
# chat (no code at all, 35 of 234 steps verified on the H200): opened as a code block, its
# answer is the edited code.
ANSWER_STARTS = {"edit_code": "```python\n"}


def task_chat(task: str) -> tuple[list[dict], dict]:
    """The task's messages and LLM.chat keywords."""
    messages = [{"role": "user", "content": TASKS[task]}]
    if task not in ANSWER_STARTS:
        return messages, {}
    messages.append({"role": "assistant", "content": ANSWER_STARTS[task]})
    return messages, {"add_generation_prompt": False, "continue_final_message": True}


@dataclass
class TaskRow:
    task: str
    batch: int
    plain_tok_s: float
    spec_tok_s: float
    speedup: float
    mean_acceptance_length: float | None
    verify_steps: int
    steps: int
    output_tokens: int
    spec_gpu_busy: float | None
    identical: bool  # outputs equal plain decoding's (greedy; sampled: n-gram and coupled draws)
    # Each timed run's wall ms, and the plain side's GPU busy: on the H200 (session 19) one plain
    # engine ran two tasks at half its speed on the others; these say whether a side's figure is
    # one slow run or a slow engine, and whether its GPU or its host was the slow part.
    plain_runs_ms: list[float] = field(default_factory=list)
    spec_runs_ms: list[float] = field(default_factory=list)
    plain_gpu_busy: float | None = None


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """--model and --speculative-config, as every speculative benchmark takes them."""
    ap.add_argument("--model", help="model path (default: the built-in SmolLM2-135M-Instruct)")
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                                    '"prompt_lookup_max": 3}')


def timed_chat(llm: LLM, task: str, batch: int, max_tokens: int, warm: bool = True,
               temperature: float = 0.0) -> tuple[float, list, int]:
    """`batch` copies of the task's chat, greedy (or sampled at `temperature`, row i seeded i),
    after an untimed warm-up of the same shape (`warm`): (wall seconds, the outputs, the index
    of the timed run's first timeline record)."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                             seed=i if temperature > 0 else None) for i in range(batch)]
    one, chat_kw = task_chat(task)
    messages = [one] * batch
    if warm:
        llm.chat(messages, params, use_tqdm=False, **chat_kw)
    timeline = llm.engine.timeline
    first = len(timeline.records) if timeline is not None else 0
    start = time.perf_counter()
    outs = llm.chat(messages, params, use_tqdm=False, **chat_kw)
    return time.perf_counter() - start, outs, first


def _timed(llm: LLM, task: str, batch: int, max_tokens: int, repeat: int,
           temperature: float = 0.0) -> tuple[float, list[list[int]], dict]:
    """The median wall time of `repeat` timed runs (these runs last ~0.3 s at batch 8: one run's
    figure moved 15 % between device calls), the outputs, and per-run step counters."""
    engine = llm.engine
    before = engine.stats()
    walls, first = [], None
    for i in range(repeat):
        wall, outs, start = timed_chat(llm, task, batch, max_tokens, warm=i == 0, temperature=temperature)
        walls.append(wall)
        first = start if first is None else first
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in after if k.startswith("spec_decode_num") and
             isinstance(after[k], int)}
    delta["runs_ms"] = [round(w * 1e3, 2) for w in walls]
    delta["steps"] = (after["steps"] - before["steps"]) // (repeat + 1)  # the warm-up ran too
    delta["verify_steps"] = (after.get("spec_decode_verify_steps", 0)
                             - before.get("spec_decode_verify_steps", 0)) // (repeat + 1)
    if engine.timeline is not None:
        delta["gpu_busy"] = engine.timeline.summary(skip=first).get("gpu_busy_fraction")
    return statistics.median(walls), [o.outputs[0].token_ids for o in outs], delta


def _side(kw: dict, config: dict | None, tasks: list[str], batches: list[int], max_tokens: int,
          repeat: int, temperature: float = 0.0) -> dict[tuple[str, int], tuple]:
    """One side of the comparison (plain or speculative): every task and batch size, one engine."""
    llm = LLM(**kw, speculative_config=config)
    try:
        return {(task, b): _timed(llm, task, b, max_tokens, repeat, temperature) for task in tasks for b in batches}
    finally:
        llm.close()


def run(model: str | None, spec: dict, tasks: list[str], batches: list[int], max_tokens: int,
        device: str, dtype: str, repeat: int = 3, same_process: bool = False,
        experiments: Experiments | None = None, temperature: float = 0.0) -> list[TaskRow]:
    """Each side runs in a fresh process (`same_process`: one after the other in this one, plain
    first, as before session 15: the A/B). On the H200 a speculating engine created second in
    its process launched its plain decode steps in 0.93 ms against the first (plain) engine's
    0.66 ms, its whole host path uniformly slower; whether the order or the engine did it is
    what the A/B tells."""
    kw = {"device": device, "dtype": dtype, "timeline": device != "cpu"}
    if experiments is not None:  # both sides (a speculation-only switch leaves the plain side as it is)
        kw["experiments"] = experiments
    if model is not None:
        kw["model"] = model
    sides = [(kw, config, tasks, batches, max_tokens, repeat, temperature) for config in (None, spec)]
    if same_process:
        plain, speculative = (_side(*args) for args in sides)
    else:
        plain, speculative = (_in_fresh_process(_side, args) for args in sides)
    results = {key: [plain[key], speculative[key]] for key in plain}
    rows = []
    for (task, b), ((plain_s, plain_ids, p), (spec_s, spec_ids, d)) in results.items():
        tokens = sum(len(t) for t in spec_ids)
        drafts, accepted = d.get("spec_decode_num_drafts", 0), d.get("spec_decode_num_accepted_tokens", 0)
        rows.append(TaskRow(task, b, sum(len(t) for t in plain_ids) / plain_s, tokens / spec_s,
                            plain_s / spec_s, 1 + accepted / drafts if drafts else None, d["verify_steps"],
                            d["steps"], tokens, d.get("gpu_busy"), plain_ids == spec_ids,
                            p["runs_ms"], d["runs_ms"], p.get("gpu_busy")))
    return rows


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
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature, row i with seed i (default greedy); 'same' then says "
                         "whether the sampled tokens are plain decoding's (coupled draws, n-gram)")
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
               args.same_process, Experiments.from_overrides(args.experiment), args.temperature)
    print(f"{'task':10} {'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'x':>6} {'accept len':>10} "
          f"{'verify/steps':>13} {'gpu busy (plain / spec)':>23} same  runs ms (plain / spec)")
    for r in rows:
        acc = f"{r.mean_acceptance_length:.2f}" if r.mean_acceptance_length else "-"
        busy = " / ".join(f"{b:.3f}" if b is not None else "-" for b in (r.plain_gpu_busy, r.spec_gpu_busy))
        runs = " / ".join(",".join(f"{w:.0f}" for w in side) for side in (r.plain_runs_ms, r.spec_runs_ms))
        print(f"{r.task:10} {r.batch:5d} {r.plain_tok_s:12,.0f} {r.spec_tok_s:11,.0f} {r.speedup:6.2f} {acc:>10} "
              f"{r.verify_steps:6d}/{r.steps:<6d} {busy:>23} {r.identical!s:5} {runs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"speculative_config": json.loads(args.speculative_config), "max_tokens": args.max_tokens,
                       "repeat": args.repeat, "same_process": args.same_process, "experiments": args.experiment,
                       "temperature": args.temperature,
                       "rows": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
