"""What `tandem bench suite` runs: one subprocess per configuration, through the existing
benchmark commands, and the figures read back from each one's JSON.

Full sizes are the H200's (DESIGN.md's standard workload and docs/benchmarks.md's history);
`quick` shrinks every workload to the `tiny` preset for the CPU, through the same code.
Budgets are seconds of wall time per run on the H200 (process start, engine build and
warm-up included), from the durations docs/benchmarks.md records; a run past its budget is
stopped and counts as failed.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

PY = [sys.executable, "-m"]
# `tandem bench X`, as users run it (and its exit skips Triton's teardown report, which would
# otherwise fill the log tail the record keeps).
BENCH = [sys.executable, "-m", "tandem", "bench"]


@dataclass
class Figure:
    value: float | None
    unit: str
    better: str  # "higher", "lower", or "none" (reported, never a regression)

    def to_dict(self) -> dict:
        return asdict(self)


Figures = dict[str, Figure]


@dataclass
class Ctx:
    quick: bool
    device: str  # passed to the benchmarks: auto, cuda or cpu
    raw: Path  # each run's JSON and log
    tokenizer: str | None  # a saved tokenizer directory (.model/tokenizer), if there is one
    test_paths: list[str] = field(default_factory=lambda: ["tests"])
    test_workers: int | None = None  # processes for the tests' shared pass (None: from the machine)

    def model(self, preset: str) -> str:
        return "tiny" if self.quick else preset


@dataclass
class RunSpec:
    part: str
    name: str
    argv: list[str]
    budget_s: float
    figures: Callable[[Path, Path], Figures]  # (its JSON, its log) -> figures
    env: dict[str, str] = field(default_factory=dict)

    @property
    def json(self) -> str:
        return f"{self.name}.json"


def _hi(v, unit: str = "tok/s") -> Figure:
    return Figure(v, unit, "higher")


def _lo(v, unit: str = "ms") -> Figure:
    return Figure(v, unit, "lower")


def _info(v, unit: str = "") -> Figure:
    return Figure(v, unit, "none")


# The fp8 part's variants of a run: name (in its tag and figure keys) -> the flags it adds.
# fp8: FP8 weights; kvfp8: an FP8 (e4m3) KV cache with the weights in bf16.
FP8_VARIANTS = {"fp8": ["--quantization", "fp8"], "kvfp8": ["--kv-cache-dtype", "fp8"]}


# ---- offline (and its FP8 twins) ----
def offline(ctx: Ctx, preset: str, variant: str | None, overlap_off: bool, budget: float) -> RunSpec:
    model = ctx.model(preset)
    tag = f"offline-{model}" + (f"-{variant}" if variant else "")
    sizes = ["--num-requests", "8", "--min-len", "4", "--max-len", "16"] if ctx.quick else []
    argv = [*BENCH, "offline", "--preset", model, "--device", ctx.device, *sizes,
            *FP8_VARIANTS.get(variant, []), *([] if overlap_off else ["--no-overlap-off"]),
            "--json", str(ctx.raw / f"{tag}.json")]
    key = f"offline.{model}" + (f".{variant}" if variant else "")
    return RunSpec("fp8" if variant else "offline", tag, argv, budget, lambda j, _: _offline_figures(j, key))


def _offline_figures(path: Path, key: str) -> Figures:
    rows = {r["overlap"]: r for r in json.loads(path.read_text())["rows"] if r["engine"] == "tandem"}
    on = rows[True]
    figs = {f"{key}.output_tok_s": _hi(on["output_tok_s"]),
            f"{key}.roofline_fraction": _hi(on["roofline_fraction"], "fraction"),
            f"{key}.gpu_busy": _hi(on["gpu_busy"], "fraction"),
            f"{key}.wall_s": _lo(on["wall_s"], "s")}
    if False in rows:
        figs[f"{key}.overlap_off.output_tok_s"] = _hi(rows[False]["output_tok_s"])
        figs[f"{key}.overlap_on_over_off"] = _hi(on["output_tok_s"] / rows[False]["output_tok_s"], "x")
    return figs


# ---- decode latency ----
def latency(ctx: Ctx, preset: str, variant: str | None, budget: float) -> RunSpec:
    model = ctx.model(preset)
    tag = f"latency-{model}" + (f"-{variant}" if variant else "")
    sizes = (["--batch-sizes", "1,4", "--steps", "5", "--warmup", "2", "--prompt-len", "8", "--ttft-burst", "2"]
             if ctx.quick else ["--batch-sizes", "1,16,64", "--steps", "40"])
    argv = [*BENCH, "latency", "--preset", model, "--device", ctx.device, *sizes,
            *FP8_VARIANTS.get(variant, []), "--json", str(ctx.raw / f"{tag}.json")]
    key = f"latency.{model}" + (f".{variant}" if variant else "")
    return RunSpec("fp8" if variant else "latency", tag, argv, budget, lambda j, _: _latency_figures(j, key))


def _latency_figures(path: Path, key: str) -> Figures:
    report = json.loads(path.read_text())
    figs: Figures = {}
    for r in report["rows"]:
        mode = "" if r["overlap"] else ".overlap_off"
        figs[f"{key}.b{r['batch']}{mode}.tok_s"] = _hi(r["tokens_per_s"])
        if r["overlap"]:
            figs[f"{key}.b{r['batch']}.step_ms"] = _lo(r["step_ms"])
            figs[f"{key}.b{r['batch']}.gpu_busy"] = _hi(r["gpu_busy"], "fraction")
    figs[f"{key}.ttft_1024_ms"] = _lo(report["ttft_single_1024"]["first_ms"])
    return figs


def host_per_step(ctx: Ctx, preset: str, budget: float, text: str = "engine") -> RunSpec:
    """Issue 21's host target: host ms per step at 256 decode rows, each step detokenizing as
    for requests with stop strings (the saved tokenizer beside the dummy weights: its
    49,152-token vocabulary sizes the LM head). `text="caller"`: the engine only names the text's
    ids, as it does for requests without stop strings under `LLM.generate` (texts made once they
    ended) and `tandem serve` (its front end makes the text)."""
    model = ctx.model(preset)
    rows = 8 if ctx.quick else 256
    sizes = (["--steps", "5", "--warmup", "2", "--prompt-len", "8"] if ctx.quick else ["--steps", "60"])
    tok = ["--tokenizer", ctx.tokenizer, "--text", text] if ctx.tokenizer else []
    caller = bool(tok) and text == "caller"
    tag = f"host-{model}-b{rows}" + ("-caller-text" if caller else "")
    argv = [*BENCH, "latency", "--preset", model, "--device", ctx.device, "--batch-sizes", str(rows), *sizes,
            "--ttft-burst", "2", *tok, "--json", str(ctx.raw / f"{tag}.json")]
    key = f"host.{model}.b{rows}" + ((".caller_text" if caller else "") if tok else ".no_text")
    return RunSpec("latency", tag, argv, budget, lambda j, _: _host_figures(j, key))


def _host_figures(path: Path, key: str) -> Figures:
    on = next(r for r in json.loads(path.read_text())["rows"] if r["overlap"])
    figs = {f"{key}.host_ms_per_step": _lo(on["host_ms"]), f"{key}.gpu_busy": _hi(on["gpu_busy"], "fraction"),
            f"{key}.tok_s": _hi(on["tokens_per_s"])}
    for phase, ms in (on.get("phases_ms") or {}).items():
        figs[f"{key}.{phase}_ms"] = _info(ms, "ms")
    return figs


# ---- prefix cache on vs off, cascade attention on vs off: one process per configuration ----
def prefix(ctx: Ctx, preset: str, cache: str, budget: float, cascade: str | None = None) -> RunSpec:
    """`cascade` None: the engine's default (figures keyed cache_on / cache_off); a value is an
    A/B side of cascade attention (cache_on_cascade_off)."""
    model = ctx.model(preset)
    sizes = (["--groups", "2", "--per-group", "2", "--system-len", "32", "--question-len", "8", "--output-len", "8"]
             if ctx.quick else ["--max-running-requests", "512"])  # 512: docs/benchmarks.md, run 2
    argv = [*BENCH, "prefix", "--preset", model, "--device", ctx.device, "--workload", "shared",
            *sizes, "--cache", cache, *(["--cascade", cascade] if cascade else [])]
    ab = "" if cascade is None else f"_cascade_{cascade}"
    key = f"prefix.{model}.shared.cache_{cache}{ab}"
    run = f"prefix-{model}-shared-{cache}{ab.replace('_', '-')}"
    return RunSpec("prefix", run, argv, budget, lambda _, log: _prefix_figures(log, key))


def _prefix_row(log: Path) -> dict:
    """`tandem bench prefix` without --compare prints its row as the last JSON line."""
    return json.loads([s for s in log.read_text(errors="replace").splitlines() if s.startswith('{"workload"')][-1])


def _prefix_figures(log: Path, key: str) -> Figures:
    return _row_figures(_prefix_row(log), key)


def _row_figures(row: dict, key: str) -> Figures:
    return {f"{key}.output_tok_s": _hi(row["output_tok_s"]), f"{key}.ttft_p50_ms": _lo(row["ttft_p50_ms"]),
            f"{key}.ttft_p99_ms": _lo(row["ttft_p99_ms"]), f"{key}.hit_rate": _info(row["hit_rate"], "fraction"),
            f"{key}.gpu_busy": _hi(row["gpu_busy"], "fraction")}


# ---- the prefix cache's host tier: multi-turn histories beyond the GPU pool, tier on vs off ----
# Issue 23's sized run: the pool holds ~25% of the live histories; 48 GB of host tier holds them all.
TIER_WORKLOAD = ["--conversations", "64", "--turns", "8", "--system-len", "1024", "--question-len", "1024",
                 "--output-len", "128", "--max-running-requests", "12", "--max-total-tokens", "147456"]


def host_tier(ctx: Ctx, preset: str, host_gb: str, budget: float) -> RunSpec:
    model = ctx.model(preset)
    sizes = (["--conversations", "3", "--turns", "2", "--system-len", "32", "--question-len", "16",
              "--output-len", "4", "--max-running-requests", "2", "--max-total-tokens", "128"]
             if ctx.quick else TIER_WORKLOAD)
    side = "off" if float(host_gb) == 0 else "on"
    argv = [*BENCH, "prefix", "--preset", model, "--device", ctx.device, "--workload", "multiturn", *sizes,
            "--host-kv-cache-gb", host_gb]
    key = f"host_tier.{model}.tier_{side}"
    return RunSpec("host_tier", f"host-tier-{model}-{side}", argv, budget, lambda _, log: _host_tier_figures(log, key))


def _host_tier_figures(log: Path, key: str) -> Figures:
    """The prefix figures, plus where a prefill step's GPU idle goes (CUDA rows: `prefill_gaps`)
    and the tier's own device waits."""
    row = _prefix_row(log)
    figs = _row_figures(row, key)
    figs[f"{key}.prefill_plan_ms"] = _lo(row["by_kind"]["prefill"]["schedule_ms"])
    if row.get("tier_stall_s") is not None:
        figs[f"{key}.tier_stall_s"] = _lo(row["tier_stall_s"], "s")
    gaps = row.get("prefill_gaps")
    if gaps and gaps.get("steps"):
        figs[f"{key}.idle_before_prefill_s"] = _lo(gaps["idle_s"], "s")
    if row.get("gpu_idle_s_by_tenth"):
        # Seconds, beside the busy fraction: the tier's run is shorter (less prefill) with the same
        # start-up idle, so its fraction is lower at equal idle (H100, 09c9a7f: 0.178 against 0.177 s).
        figs[f"{key}.gpu_idle_s"] = _lo(sum(row["gpu_idle_s_by_tenth"]), "s")
        # After the first tenth (its first step waits for the run to start): the steady state's idle.
        figs[f"{key}.gpu_idle_after_first_tenth_s"] = _lo(round(sum(row["gpu_idle_s_by_tenth"][1:]), 3), "s")
    return figs


# ---- structured output ----
def grammar(ctx: Ctx, preset: str, budget: float) -> RunSpec:
    model = ctx.model(preset)
    sizes = (["--num-requests", "2", "--prompt-len", "8", "--max-tokens", "24", "--grammar-threads", "1",
              "--no-overlap-off"]  # a 49,152-token vocabulary on the CPU: few steps
             if ctx.quick else ["--num-requests", "128"])  # the engine's grammar threads, as users run it
    tok = ["--tokenizer", ctx.tokenizer] if ctx.tokenizer else []
    argv = [*BENCH, "grammar", "--preset", model, "--device", ctx.device, *sizes, *tok,
            "--json", str(ctx.raw / f"grammar-{model}.json")]
    return RunSpec("grammar", f"grammar-{model}", argv, budget, lambda j, _: _grammar_figures(j, f"grammar.{model}"))


def _grammar_figures(path: Path, key: str) -> Figures:
    report = json.loads(path.read_text())
    rows = {(r["constrained"], r["overlap"], r["mask_overlap"]): r for r in report["rows"]}
    c, u, early = rows[(True, True, True)], rows[(False, True, True)], rows.get((True, True, False))
    figs = {f"{key}.constrained.output_tok_s": _hi(c["output_tok_s"]),
            f"{key}.unconstrained.output_tok_s": _hi(u["output_tok_s"]),
            f"{key}.constrained_over_unconstrained": _hi(c["output_tok_s"] / u["output_tok_s"], "x"),
            f"{key}.constrained.gpu_busy": _hi(c["gpu_busy"], "fraction"),
            f"{key}.constrained.grammar_ms_per_step": _lo(c["grammar_ms_per_step"]),
            f"{key}.valid_fraction": _info(c["valid"] / c["requests"], "fraction")}
    if early is not None:
        figs[f"{key}.masks_before_forward.output_tok_s"] = _hi(early["output_tok_s"])
    return figs


# ---- serving ----
def serve(ctx: Ctx, preset: str, mode: str, budget: float) -> RunSpec:
    model = ctx.model(preset)
    sizes = (["--num-prompts", "8", "--input-len", "4:16", "--output-len", "4:16", "--token-id-range", "3:500"]
             if ctx.quick else ["--num-prompts", "200", "--input-len", "100:1024", "--output-len", "100:1024"])
    rates = ["--rates", "16,128"] if mode == "server" else ["--rates", "128"]  # the engine: the comparison rate
    argv = [*PY, "tandem.bench.suite_serve", mode, "--preset", model, *sizes, *rates,
            "--json", str(ctx.raw / f"serve-{mode}-{model}.json")]
    key = f"serve.{model}" + ("" if mode == "server" else ".engine")
    return RunSpec("serve", f"serve-{mode}-{model}", argv, budget, lambda j, _: _serve_figures(j, key))


def _serve_figures(path: Path, key: str) -> Figures:
    report = json.loads(path.read_text())
    figs = {f"{key}.startup_s": _lo(report["startup_s"], "s")} if "startup_s" in report else {}
    if "kernel_builds_while_serving" in report:  # after the warm-up: 0 expected (each stalled a step)
        figs[f"{key}.kernel_builds_while_serving"] = _lo(len(report["kernel_builds_while_serving"]), "builds")
    for r in report["rates"]:
        k = f"{key}.rate{float(r['request_rate']):g}"
        figs.update({f"{k}.output_tok_s": _hi(r["output_token_throughput"]),
                     f"{k}.ttft_p50_ms": _lo(r["ttft_ms"]["p50"]), f"{k}.ttft_p99_ms": _lo(r["ttft_ms"]["p99"]),
                     f"{k}.tpot_p50_ms": _lo(r["tpot_ms"]["p50"]), f"{k}.tpot_p99_ms": _lo(r["tpot_ms"]["p99"]),
                     f"{k}.failed": _info(r["failed"], "requests")})
        if r.get("gpu_busy"):  # the gauge stays 0 without CUDA (no device events)
            figs[f"{k}.gpu_busy"] = _hi(r["gpu_busy"], "fraction")
        # Where a TTFT went: the server's own (to its front end) and the client's event-loop lag.
        for q in ("p50", "p99"):  # the server's own TTFT (its tail: where the client's p99 comes from)
            if (server_ttft := (r.get("server_ttft_ms") or {}).get(q)) is not None:
                figs[f"{k}.server_ttft_{q}_ms"] = _info(server_ttft, "ms")
        if (lag := (r.get("client_lag_ms") or {}).get("p99")) is not None:
            figs[f"{k}.client_lag_p99_ms"] = _info(lag, "ms")
        if r.get("front_end_cpu_share") is not None:
            figs[f"{k}.front_end_cpu_share"] = _info(r["front_end_cpu_share"], "cores")
    return figs


# ---- derived figures: ratios across runs of one part ----
def derived(figs: Figures) -> Figures:
    out: Figures = {}
    for name, fig in figs.items():
        for pattern, other, ratio in _RATIOS:
            if name.endswith(pattern) and fig.value:
                base = figs.get(name[: -len(pattern)] + other)
                if base is not None and base.value:
                    out[name[: -len(pattern)] + ratio] = _hi(fig.value / base.value, "x")
    # FP8 over bf16: offline.M.fp8.X over offline.M.X (-> offline.M.fp8_over_bf16.X), and
    # likewise kvfp8 (-> kvfp8_over_bf16).
    for name, fig in figs.items():
        for kind in ("offline", "latency"):
            for variant in FP8_VARIANTS:
                tag = f".{variant}."
                if name.startswith(f"{kind}.") and tag in name and name.endswith("tok_s") and fig.value:
                    base = figs.get(name.replace(tag, ".", 1))
                    if base is not None and base.value:
                        out[name.replace(tag, f".{variant}_over_bf16.", 1)] = _hi(fig.value / base.value, "x")
    return out


_RATIOS = [  # (suffix of a figure, suffix of its baseline, suffix of the ratio)
    (".shared.cache_on.output_tok_s", ".shared.cache_off.output_tok_s", ".shared.cache_on_over_off"),
    # issue 22: the default (cascade auto) over cache on without cascade (>= 1.8x asked)
    (".shared.cache_on.output_tok_s", ".shared.cache_on_cascade_off.output_tok_s", ".shared.cascade_over_off"),
    (".rate128.output_tok_s", ".engine.rate128.output_tok_s", ".rate128.serve_over_engine"),
    (".tier_on.output_tok_s", ".tier_off.output_tok_s", ".tier_on_over_off"),
    (".tier_on.gpu_busy", ".tier_off.gpu_busy", ".gpu_busy_tier_on_over_off"),  # issue 23: >= 1
]


# ---- tests ----
def tests(ctx: Ctx, budget: float) -> RunSpec:
    """Both passes of the test part (tandem/bench/suite_tests.py's driver); its summary is tests.json."""
    from tandem.bench.suite_tests import default_workers
    argv = [*PY, "tandem.bench.suite_tests", *ctx.test_paths, "--raw", str(ctx.raw),
            "--workers", str(ctx.test_workers or default_workers(ctx.device))]
    env = {"TANDEM_TEST_DEVICE": "cpu" if ctx.device == "cpu" else "cuda"}
    if ctx.tokenizer:
        env["TANDEM_TEST_TOKENIZER"] = ctx.tokenizer
    return RunSpec("tests", "tests", argv, budget, lambda _, log: _test_figures(ctx.raw), env)


def _test_figures(raw: Path) -> Figures:
    from tandem.bench.suite_tests import read_summary
    s = read_summary(raw)
    return {f"tests.{k}": _info(getattr(s, k), "tests") for k in ("passed", "failed", "errors", "skipped")}


def plan(ctx: Ctx) -> list[RunSpec]:
    """Every run, in the order they go (tests first: they gate the record). The 8B standard
    workload is the big one (~14 s of generation after a ~16 s start on the H200). Quick mode
    keeps one run per part where the full suite has two of a kind (process start-up is most of
    a tiny run's time), so every section is there at the least cost."""
    if ctx.quick:
        return [tests(ctx, 60), offline(ctx, "tiny", None, True, 60), latency(ctx, "tiny", None, 60),
                serve(ctx, "tiny", "server", 90), serve(ctx, "tiny", "engine", 60),
                prefix(ctx, "tiny", "on", 60), grammar(ctx, "tiny", 60), offline(ctx, "tiny", "fp8", False, 60),
                host_tier(ctx, "tiny", "0.01", 60)]
    # tests: 285 s on the H100 at 0d81c5e, 420 s (its budget, both passes complete) at c37153d
    return [tests(ctx, 560),  # H100, session 41: shared pass 349 s + whole-GPU pass ~95 s + start-ups > 480
            offline(ctx, "qwen3-0.6b", None, True, 90),  # 54.5 s at a48f9fc, past 60 at a14d1c1
            offline(ctx, "llama-3.1-8b", None, False, 70),
            latency(ctx, "qwen3-0.6b", None, 45),
            host_per_step(ctx, "qwen3-0.6b", 45),
            host_per_step(ctx, "qwen3-0.6b", 45, text="caller"),
            serve(ctx, "qwen3-0.6b", "server", 90),
            serve(ctx, "qwen3-0.6b", "engine", 50),
            prefix(ctx, "qwen3-0.6b", "on", 40),
            prefix(ctx, "qwen3-0.6b", "off", 45),
            prefix(ctx, "qwen3-0.6b", "on", 45, cascade="off"),  # issue 22: cascade's own share
            grammar(ctx, "qwen3-0.6b", 50),
            # A first run on a fresh H100 (session 53) passed 45 / 70 s: the 8B at 64% of its requests.
            latency(ctx, "qwen3-0.6b", "fp8", 60),
            offline(ctx, "llama-3.1-8b", "fp8", False, 90),
            offline(ctx, "qwen3-0.6b", "kvfp8", False, 60),  # issue 21: 1.10x bf16 in session 44
            host_tier(ctx, "qwen3-0.6b", "48", 150),
            host_tier(ctx, "qwen3-0.6b", "0", 100)]


PARTS = ("tests", "offline", "latency", "prefix", "grammar", "fp8", "serve", "host_tier")
