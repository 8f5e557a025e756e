"""`tandem bench grammar`: structured output at batch 128, and what the mask overlap buys.

Model: a preset shape (default Qwen3-0.6B) with dummy weights and a real tokenizer's
vocabulary (the built-in model's, 49152 tokens; the config's vocab_size is set to it), so
the grammar masks are those of a real BPE vocabulary. Workload: N requests (128) at once,
random prompts, sampled at temperature 1 with fixed seeds, each constrained by a ~10-field
JSON schema. Then the same requests unconstrained, each with max_tokens = its constrained
output length and EOS ignored, so both runs produce the same number of tokens. Both with
overlap on and off, and with the overlap on but the masks filled before the forward is
queued (`Experiments(grammar_overlap=False)`): what hiding the mask work under the forward buys.
Each configuration runs `--repeat` times (default 3), the configurations interleaved (c, u, c,
u, ...), and its median run (by tok/s) is reported with every run's tok/s: one run lasts 0.5-0.8
s on the H100, and the one-run ratio moved 0.78-0.91 between device calls (session 35).

Per run: output tok/s, host ms per step (engine step time minus the one sanctioned wait)
split into grammar (mask fill + copy, matcher advance) and other, GPU busy (forward and
sampling time over device time, mask stalls counted as idle; CUDA only), and how many
constrained outputs parse and validate.
"""
import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tandem.bench.presets import PRESETS, load_tokenizer, preset_dir
from tandem.config import EngineConfig, Experiments
from tandem.engine import Engine
from tandem.sampling import SamplingParams

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["id", "name", "age", "email", "active", "country", "tags", "rating", "joined", "note"],
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,10}\\.(com|org|net)$"},
        "active": {"type": "boolean"},
        "country": {"enum": ["US", "DE", "FR", "JP", "BR", "IN", "CN", "GB"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "joined": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 32}]},
    },
}


@dataclass
class GrammarRow:
    constrained: bool
    overlap: bool
    mask_overlap: bool
    requests: int
    output_tokens: int
    wall_s: float
    steps: int
    host_ms_per_step: float
    grammar_ms_per_step: float
    accept_ms_per_step: float  # of grammar: advancing matchers (the rest fills and copies masks)
    gpu_busy: float | None
    valid: int | None  # constrained outputs that parse and validate
    runs_tok_s: list[float] = field(default_factory=list)  # every repeat's, this row the median's

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def other_ms_per_step(self) -> float:
        return self.host_ms_per_step - self.grammar_ms_per_step

    def to_dict(self) -> dict:
        return {**asdict(self), "output_tok_s": self.output_tok_s, "other_ms_per_step": self.other_ms_per_step}


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], overlap: bool,
        tag: str, mask_overlap: bool = True) -> tuple[GrammarRow, list[list[int]]]:
    engine.cfg.disable_overlap, engine.cfg.experiments.grammar_overlap = not overlap, mask_overlap
    engine.reset_prefix_cache()  # runs repeat prompts: each computes its own
    first = len(engine.timeline.records)
    g = engine.grammar
    grammar0, accept0, steps0 = g.fill_s + g.accept_s, g.accept_s, engine.step_id
    rids = [engine.add_request(p, sp, request_id=f"{tag}-{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    while engine.grammar.compiling:  # grammars compile before the clock starts (cached after warm-up)
        engine.grammar.compiling[0][1].result()
        engine.step()
    _sync(engine.device)
    start, step_s = time.perf_counter(), 0.0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        step_s += time.perf_counter() - t0
    _sync(engine.device)
    wall = time.perf_counter() - start
    records = engine.timeline.records[first:]
    steps = engine.step_id - steps0
    wait_s = sum(r.host_wait_ms for r in records) / 1e3
    outs = [engine.output(r) for r in rids]
    constrained = params[0].json_schema is not None
    valid = sum(_valid(o.text) for o in outs) if constrained else None
    for r in rids:
        engine.release(r)
    row = GrammarRow(constrained, overlap, mask_overlap, len(rids), sum(len(o.token_ids) for o in outs), wall,
                     steps, (step_s - wait_s) * 1e3 / max(steps, 1),
                     (g.fill_s + g.accept_s - grammar0) * 1e3 / max(steps, 1),
                     (g.accept_s - accept0) * 1e3 / max(steps, 1),
                     engine.timeline.summary(skip=first).get("gpu_busy_fraction"), valid)
    return row, [o.token_ids for o in outs]


def median_row(runs: list[GrammarRow]) -> GrammarRow:
    """The run of median tok/s (the lower middle one of an even count), with every run's tok/s."""
    ordered = sorted(runs, key=lambda r: r.output_tok_s)
    middle = ordered[(len(ordered) - 1) // 2]
    middle.runs_tok_s = [round(r.output_tok_s, 1) for r in runs]
    return middle


def _valid(text: str) -> bool:
    try:
        import jsonschema
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except Exception:  # any parse or validation failure counts as invalid
        return False


def format_table(rows: list[GrammarRow]) -> str:
    lines = ["| requests | overlap | output tok | wall s | output tok/s | host ms/step | grammar ms/step | "
             "of which accept | other ms/step | GPU busy | steps | valid | runs tok/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        busy = "n/a" if r.gpu_busy is None else f"{r.gpu_busy:.1%}"
        valid = "n/a" if r.valid is None else f"{r.valid}/{r.requests}"
        mode = ("on" if r.mask_overlap else "on, masks before forward") if r.overlap else "off"
        lines.append(f"| {'json_schema' if r.constrained else 'unconstrained'} | {mode} | "
                     f"{r.output_tokens:,} | {r.wall_s:.2f} | {r.output_tok_s:,.0f} | {r.host_ms_per_step:.2f} | "
                     f"{r.grammar_ms_per_step:.2f} | {r.accept_ms_per_step:.2f} | {r.other_ms_per_step:.2f} | "
                     f"{busy} | {r.steps} | {valid} | {', '.join(f'{t:,.0f}' for t in r.runs_tok_s)} |")
    out = ["\n".join(lines)]
    by = {(r.constrained, r.overlap): r for r in rows if r.mask_overlap}
    for overlap in (True, False):
        c, u = by.get((True, overlap)), by.get((False, overlap))
        if c and u:
            out.append(f"overlap {'on' if overlap else 'off'}: constrained / unconstrained output tok/s = "
                       f"{c.output_tok_s / u.output_tok_s:.1%}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench grammar", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-0.6b", choices=list(PRESETS))
    ap.add_argument("--tokenizer", help="a saved HF tokenizer directory (default: the built-in model's)")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--cuda-graph", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--grammar-threads", type=int, default=EngineConfig.grammar_threads,
                    help="the engine's grammar threads (default: EngineConfig's, as users run it)")
    ap.add_argument("--no-overlap-off", action="store_true", help="skip the overlap-off runs")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs a configuration (the median is reported)")
    ap.add_argument("--experiment", action="append", default=[], metavar="NAME=VALUE",
                    help="an Experiments switch for every run (A/B of the engine's internals)")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)

    tokenizer = load_tokenizer(args.tokenizer)
    cfg = EngineConfig(model=preset_dir(args.preset, tokenizer), dummy_weights=True, device=args.device,
                       dtype=args.dtype, timeline=True, max_running_requests=max(args.num_requests, 1),
                       cuda_graph=args.cuda_graph, grammar_threads=args.grammar_threads,
                       max_model_len=args.prompt_len + args.max_tokens + 8,
                       experiments=Experiments.from_overrides(args.experiment))
    engine = Engine(cfg)
    _log(f"engine ready ({engine.device}, {engine.dtype}, vocab {engine.model_config.vocab_size})")
    rng = random.Random(args.seed)
    vocab = len(tokenizer)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    constrained = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=args.seed + i,
                                  json_schema=SCHEMA) for i in range(args.num_requests)]
    warm = min(8, args.num_requests)  # kernels, graphs, rings and the schema's compilation
    for overlap in (True, False):
        run(engine, prompts[:warm], [p.clone(max_tokens=16) for p in constrained[:warm]], overlap, f"warm-{overlap}")
    rows, tokens = [], {}
    for overlap in (True,) if args.no_overlap_off else (True, False):
        runs: dict[str, list[GrammarRow]] = {"c": [], "u": [], "m": []}
        for _ in range(args.repeat):  # interleaved: drift on the machine reaches every configuration alike
            row, tokens[overlap] = run(engine, prompts, constrained, overlap, f"c-{overlap}")
            runs["c"].append(row)
            plain = [SamplingParams(max_tokens=len(t), temperature=1.0, seed=args.seed + i, ignore_eos=True)
                     for i, t in enumerate(tokens[overlap])]
            runs["u"].append(run(engine, prompts, plain, overlap, f"u-{overlap}")[0])
            if overlap:
                runs["m"].append(run(engine, prompts, constrained, True, "m-off", mask_overlap=False)[0])
        c, u = median_row(runs["c"]), median_row(runs["u"])
        rows += [c, u]
        _log(f"overlap {'on' if overlap else 'off'}: constrained {c.output_tok_s:,.0f} tok/s, "
             f"unconstrained {u.output_tok_s:,.0f} tok/s")
        if overlap:
            rows.append(median_row(runs["m"]))
            _log(f"masks before forward: constrained {rows[-1].output_tok_s:,.0f} tok/s")
    report = {"args": vars(args), "device_name": torch.cuda.get_device_name(engine.device)
              if engine.device.type == "cuda" else "cpu", "rows": [r.to_dict() for r in rows]}
    if len(tokens) == 2:
        report["constrained_tokens_identical_overlap_on_off"] = tokens[True] == tokens[False]
    print(format_table(rows))
    if "constrained_tokens_identical_overlap_on_off" in report:
        print(f"constrained tokens identical with overlap on and off: "
              f"{report['constrained_tokens_identical_overlap_on_off']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _log(msg: str) -> None:
    print(f"[grammar] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
