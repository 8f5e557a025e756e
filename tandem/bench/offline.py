"""`tandem bench offline`: the standard offline workload (DESIGN.md §5), overlap on vs off,
with the roofline of this very run and, optionally, transformers' continuous batching.

Workload: N requests (256), input and output lengths uniform in [min, max] ([100, 1024]),
random token ids, EOS ignored, fixed seed; all requests arrive at once, greedy sampling, in
one `LLM.generate` as users call it (its progress bar shown; a preset has no tokenizer, so no text).
For each engine run: wall time from the first request added to the last token, output and
total (input + output) tokens/s, and the roofline counted from the step timeline (bytes and
FLOPs of the actual schedule over bandwidth and matmul rate measured in this process; see
tandem/bench/roofline.py), with the achieved fraction = roofline time / wall time.

`--compare-hf` then frees the engine and runs transformers' continuous batching (the
manager behind `generate_batch`, with per-request `max_new_tokens`, EOS disabled) on the
same prompts and output lengths, with the same dtype and a model built from the same config.
"""
import argparse
import gc
import json
import logging
import random
import sys
import time
import warnings
from dataclasses import asdict, dataclass

import torch

from tandem.bench.presets import preset_dir
from tandem.bench.roofline import Hardware, ModelCost, measure_hardware, model_cost, roofline
from tandem.entrypoints.llm import LLM
from tandem.options import add_engine_options, engine_config
from tandem.sampling import SamplingParams


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    seed: int

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, vocab_size: int, min_len: int = 100, max_len: int = 1024,
                  seed: int = 0, output_len: int | None = None) -> Workload:
    """Input and output lengths uniform in [min_len, max_len] (output fixed when `output_len`)."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len; got {min_len}, {max_len}")
    rng = random.Random(seed)
    in_lens = [rng.randint(min_len, max_len) for _ in range(num_requests)]
    out_lens = [output_len or rng.randint(min_len, max_len) for _ in range(num_requests)]
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in in_lens]
    return Workload(prompts, out_lens, seed)


@dataclass
class RunRow:
    engine: str  # "tandem" or "transformers"
    overlap: bool | None
    requests: int
    input_tokens: int
    output_tokens: int
    wall_s: float
    steps: int | None = None
    roofline_s: float | None = None
    roofline_decode_s: float | None = None
    roofline_prefill_s: float | None = None
    bytes: float | None = None
    flops: float | None = None
    memory_bound_steps: int | None = None
    gpu_forward_s: float | None = None  # sum of forward device times (CUDA events), when known
    gpu_busy: float | None = None
    preemptions: int | None = None
    note: str = ""

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.wall_s

    @property
    def roofline_fraction(self) -> float | None:
        return None if self.roofline_s is None else self.roofline_s / self.wall_s

    @property
    def roofline_fraction_gpu(self) -> float | None:
        """Roofline over the summed forward device time: how close the kernels themselves are."""
        return None if not self.roofline_s or not self.gpu_forward_s else self.roofline_s / self.gpu_forward_s

    def to_dict(self) -> dict:
        return {**asdict(self), "output_tok_s": self.output_tok_s, "total_tok_s": self.total_tok_s,
                "roofline_fraction": self.roofline_fraction,
                "roofline_fraction_gpu": self.roofline_fraction_gpu}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_tandem(llm: LLM, wl: Workload, overlap: bool, cost: ModelCost | None = None,
               hw: Hardware | None = None, progress: bool = True) -> RunRow:
    """All requests in one `LLM.generate`, as users run it (its progress bar and texts
    included); token counts are checked against the workload."""
    engine = llm.engine
    engine.cfg.disable_overlap = not overlap
    engine.reset_prefix_cache()  # runs repeat prompts: each computes its own
    first = len(engine.timeline.records) if engine.timeline is not None else 0
    preempt0 = engine.scheduler.num_preemptions
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in wl.output_lens]
    _sync(engine.device)
    start = time.perf_counter()
    outputs = llm.generate(wl.prompts, params, use_tqdm=progress)
    _sync(engine.device)
    wall = time.perf_counter() - start
    got = [len(o.outputs[0].token_ids) for o in outputs]
    if got != wl.output_lens:
        bad = [(i, g, n) for i, (g, n) in enumerate(zip(got, wl.output_lens)) if g != n][:5]
        raise RuntimeError(f"tandem produced the wrong number of tokens (index, got, want): {bad}")
    row = RunRow("tandem", overlap, wl.num_requests, wl.input_tokens, sum(got), wall,
                 preemptions=engine.scheduler.num_preemptions - preempt0)
    if engine.timeline is not None:
        records = engine.timeline.records[first:]
        row.steps = len(records)
        timed = [r.gpu_forward_ms for r in records if r.gpu_forward_ms is not None]
        if timed:
            row.gpu_forward_s = sum(timed) / 1e3
            row.gpu_busy = engine.timeline.summary(skip=first).get("gpu_busy_fraction")
        if cost is not None and hw is not None:
            rl = roofline(records, cost, hw)
            row.roofline_s, row.roofline_decode_s, row.roofline_prefill_s = (
                rl.time_s, rl.decode_time_s, rl.prefill_time_s)
            row.bytes, row.flops, row.memory_bound_steps = rl.bytes, rl.flops, rl.memory_bound_steps
    return row


def warm_up(llm: LLM, wl: Workload, n: int = 16) -> None:
    """A few of the workload's prompts with short outputs, both modes: kernels compiled, caches hot."""
    small = Workload(wl.prompts[:n], [min(4, x) for x in wl.output_lens[:n]], wl.seed)
    for overlap in (True, False):
        run_tandem(llm, small, overlap, progress=False)


# ---- transformers ----
def build_hf_model(config_path: str, dtype: torch.dtype, device: torch.device, attn: str):
    """Random weights from the same config.json: speed does not depend on the values."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(config_path)
    torch.manual_seed(0)
    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore", FutureWarning)  # 5.23+: the `paged|` prefix is deprecated
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    return model.to(device).eval().requires_grad_(False)


def run_hf(model, wl: Workload, device: torch.device, timeout_s: float | None = None,
           cb_kwargs: dict | None = None) -> RunRow:
    """transformers' continuous batching: the manager `generate_batch` uses (same warm-up,
    same workload hints), but each request with its own `max_new_tokens`, EOS disabled."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                           max_new_tokens=max(wl.output_lens))
    if cb_kwargs is None and device.type == "cpu":
        # Its defaults size static buffers from host memory (tens of seconds to fill): keep small.
        total = max(len(p) + n for p, n in zip(wl.prompts, wl.output_lens))
        cb_kwargs = {"num_blocks": max(16, (wl.input_tokens + wl.output_tokens) // 128 + 8),
                     "max_batch_tokens": max(256, min(2048, total))}
    cb = ContinuousBatchingConfig(**(cb_kwargs or {}))
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in wl.prompts),
                          max_generated_length=max(wl.output_lens), num_requests=wl.num_requests)
    got: dict[str, int] = {}
    with warnings.catch_warnings(), model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   block=True, timeout=5, warmup=True,
                                                   workload_hints=hints) as manager:
        warnings.simplefilter("ignore", FutureWarning)
        attn = model.config._attn_implementation  # as switched by the manager, for the report
        _sync(device)
        start = time.perf_counter()
        for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens)):
            manager.add_request(p, request_id=f"hf-{i}", max_new_tokens=n, eos_token_id=-1)
        while len(got) < wl.num_requests:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers request {result.request_id} failed: {result.error}")
                got[result.request_id] = len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped unexpectedly")
            if timeout_s is not None and time.perf_counter() - start > timeout_s:
                for i in range(wl.num_requests):  # let its loop stop now rather than finish
                    if f"hf-{i}" not in got:
                        manager.cancel_request(f"hf-{i}")
                raise TimeoutError(f"transformers did not finish in {timeout_s:.0f} s "
                                   f"({len(got)}/{wl.num_requests} requests done)")
        _sync(device)
        wall = time.perf_counter() - start
    counts = [got[f"hf-{i}"] for i in range(wl.num_requests)]
    note = "" if counts == wl.output_lens else "output lengths differ from the workload"
    return RunRow("transformers", None, wl.num_requests, wl.input_tokens, sum(counts), wall,
                  note=f"continuous batching, {attn}"
                       + (f"; {note}" if note else ""))


# ---- report ----
def format_table(rows: list[RunRow], hw: Hardware | None) -> str:
    fmt = lambda x, p="{:.3f}": "n/a" if x is None else p.format(x)
    lines = [("| engine | overlap | requests | input tok | output tok | wall s | output tok/s | total tok/s | "
              "roofline s | achieved / roofline | roofline / GPU fwd | GPU busy | steps |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ov = "n/a" if r.overlap is None else ("on" if r.overlap else "off")
        lines.append(f"| {r.engine} | {ov} | {r.requests} | {r.input_tokens:,} | {r.output_tokens:,} | "
                     f"{r.wall_s:.2f} | {r.output_tok_s:,.0f} | {r.total_tok_s:,.0f} | {fmt(r.roofline_s)} | "
                     f"{fmt(r.roofline_fraction, '{:.1%}')} | {fmt(r.roofline_fraction_gpu, '{:.1%}')} | "
                     f"{fmt(r.gpu_busy, '{:.1%}')} | {fmt(r.steps, '{}')} |")
    out = ["\n".join(lines)]
    by = {(r.engine, r.overlap): r for r in rows}
    on, off, hf = by.get(("tandem", True)), by.get(("tandem", False)), by.get(("transformers", None))
    if on and off:
        out.append(f"overlap on / off (output tok/s): {on.output_tok_s / off.output_tok_s:.2f}x")
    if on and hf:
        out.append(f"tandem (overlap on) / transformers continuous batching (output tok/s): "
                   f"{on.output_tok_s / hf.output_tok_s:.2f}x  [{hf.note}]")
    if hw is not None:
        where = "CPU figures" if hw.device == "cpu" else "CUDA events"
        out.append(f"measured ({where}): copy bandwidth {hw.bandwidth / 1e9:,.1f} GB/s "
                   f"({hw.copy_bytes >> 20} MiB, read+write), {hw.dtype} matmul "
                   f"{hw.matmul_flops / 1e12:,.2f} TFLOP/s ({hw.matmul_n}^3)")
    if on and on.roofline_s is not None:
        out.append(f"roofline (overlap on run): {on.bytes / 1e9:,.1f} GB moved, {on.flops / 1e12:,.1f} TFLOP; "
                   f"decode {on.roofline_decode_s:.3f} s + prefill {on.roofline_prefill_s:.3f} s; "
                   f"{on.memory_bound_steps}/{on.steps} steps memory-bound")
    return "\n".join(out)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench offline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-0.6b", help="the model when --model is not given (dummy weights)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, help="fix every output length (e.g. 562) instead of uniform")
    ap.add_argument("--no-overlap-off", action="store_true", help="skip the overlap-off run")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--compare-hf", action="store_true",
                    help="also run transformers' continuous batching on the same workload")
    ap.add_argument("--hf-attn", default="paged|sdpa", help="attn_implementation for transformers")
    ap.add_argument("--hf-timeout", type=float, help="give up on transformers after this many seconds")
    ap.add_argument("--json", help="write results here")
    add_engine_options(ap)  # the engine as users configure it; --seed also seeds the workload
    args = ap.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)

    cfg = engine_config(args)
    if cfg.model is None:
        cfg.model, cfg.dummy_weights = preset_dir(args.preset), True
    cfg.timeline = cfg.timeline or True  # the roofline is counted from the step timeline
    t0 = time.perf_counter()
    llm = LLM.from_config(cfg)  # --tp: starts the ranks
    engine = llm.engine
    device, dtype = engine.device, engine.dtype
    _log(f"engine ready in {time.perf_counter() - t0:.1f} s ({device}, {dtype}, KV {engine.kv_dtype})")
    wl = make_workload(args.num_requests, engine.model_config.vocab_size, args.min_len, args.max_len,
                       args.seed, args.output_len)
    _log(f"workload: {wl.num_requests} requests, {wl.input_tokens:,} input + {wl.output_tokens:,} output tokens")
    hw = measure_hardware(device, dtype)
    cost = model_cost(engine.model, engine.model.local_config, engine.kv_dtype)  # this rank's share
    _log(f"measured: {hw.bandwidth / 1e9:,.1f} GB/s copy, {hw.matmul_flops / 1e12:,.2f} TFLOP/s {hw.dtype}")
    if not args.no_warmup:
        warm_up(llm, wl)
    rows = []
    for overlap in (True,) if args.no_overlap_off else (True, False):
        rows.append(run_tandem(llm, wl, overlap, cost, hw))
        _log(f"tandem overlap {'on' if overlap else 'off'}: {rows[-1].wall_s:.2f} s, "
             f"{rows[-1].output_tok_s:,.0f} output tok/s")
    engine_info = {"max_model_len": engine.max_model_len, "kv_tokens": engine.kv_slots.count,
                   "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
                   "cuda_graphs": engine.runner.graphs is not None}
    report = {"args": vars(args), "versions": _versions(), "device_name": _device_name(device),
              "engine": engine_info, "hardware": asdict(hw), "model_cost": asdict(cost),
              "workload": {"requests": wl.num_requests, "input_tokens": wl.input_tokens,
                           "output_tokens": wl.output_tokens, "seed": wl.seed,
                           "min_len": args.min_len, "max_len": args.max_len, "output_len": args.output_len}}
    _write(args.json, report, rows)  # the tandem figures are kept even if transformers fails
    status = 0
    engine.close()  # tensor-parallel workers
    if args.compare_hf:
        del engine, llm
        _free(device)
        if device.type == "cuda":
            _log(f"free for transformers: {torch.cuda.mem_get_info(device)[0] / 2**30:.1f} GiB")
        model = build_hf_model(cfg.model, dtype, device, args.hf_attn)
        try:
            rows.append(run_hf(model, wl, device, args.hf_timeout))
            _log(f"transformers: {rows[-1].wall_s:.2f} s, {rows[-1].output_tok_s:,.0f} output tok/s")
        except (RuntimeError, TimeoutError) as e:
            _log(f"transformers failed: {e}")
            report["hf_error"] = str(e)
            status = 1
        del model
        _free(device)
        _write(args.json, report, rows)
    print(format_table(rows, hw))
    return status


def _write(path: str | None, report: dict, rows: list[RunRow]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({**report, "rows": [r.to_dict() for r in rows]}, f, indent=1)


def _log(msg: str) -> None:
    print(f"[offline] {msg}", file=sys.stderr, flush=True)


def _versions() -> dict:
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    raise SystemExit(main())
