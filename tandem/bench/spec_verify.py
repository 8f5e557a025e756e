"""`tandem bench spec-verify`: what a speculative verify step costs against a decode step.

A verify forward scores each row's last token and its k proposals: k + 1 query tokens per
row over the row's cached context, and logits at every position. Two layouts are timed: a
decode batch of one row per query (`forward_batch.query_rows_batch`, the "verify" columns)
and the extend layout (k + 1 new tokens after the row's cache, one extend attention launch
a layer: `forward_batch.fixed_extend_batch`). The engine's graphed verify steps use the
extend layout up to `Experiments.verify_extend_max_rows` rows, the other above.
Speculation pays when (accepted + 1) tokens per verify outweigh its cost over one decode
step, so this ratio is the break-even acceptance, per batch size (issue 20 asks for <= 1.15x
at batch 1 on the Llama-3.1-8B shape with k + 1 = 5).

Both forwards run on the engine's own model, KV pool and attention backend, with every
row's table filled for `--context` cached tokens. On CUDA each is captured in a CUDA graph
and replayed (`--iters` times, CUDA events), so the figure is device time, not launch
overhead; eager timings are reported beside them. A check first: the verify's logits at the
first position equal the decode's (same token, same context).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace

import torch

from tandem.bench.presets import preset_dir
from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.forward_batch import ForwardBatch
from tandem.forward_batch import fixed_extend_batch, query_rows_batch


@dataclass
class VerifyRow:
    batch: int
    k: int
    context: int
    decode_ms: float  # graph replay on CUDA, eager elsewhere
    verify_ms: float  # a decode row per query (the engine's layout above verify_extend_max_rows)
    verify_extend_ms: float  # the extend layout (the engine's up to verify_extend_max_rows rows)
    decode_eager_ms: float
    verify_eager_ms: float
    first_position_max_diff: float  # |verify logits[pos 0] - decode logits|, the layout check
    layouts_max_diff: float  # |verify logits - extend layout's|, every position
    plans: str = "tuned"  # the small-M GEMM plans: as tuned, or "fused@M" (--force-fused)
    # --kernels: per forward ("decode", "verify"), [kernel, launches, self device us] a replay
    kernels: dict | None = None

    @property
    def ratio(self) -> float:
        return self.verify_ms / self.decode_ms


class Shapes:
    """Static inputs for B rows at `context` cached tokens: one decode token, or k + 1."""

    def __init__(self, engine: Engine, batch: int, k: int, context: int):
        dev, table = engine.device, engine.table
        self.engine, self.batch, self.k, self.context = engine, batch, k, context
        span = context + k + 1
        slots = torch.arange(1, batch + 1, dtype=torch.int64, device=dev)
        locs = 1 + torch.arange(batch * span, dtype=torch.int64, device=dev).view(batch, span)
        for row in range(batch):  # KV slots [1 + row * span, ...): distinct per row
            table.table[row + 1, :span] = locs[row].to(table.table.dtype)
        tokens = torch.randint(0, engine.model_config.vocab_size, (batch, k + 1), device=dev)
        q = k + 1
        self.decode = ForwardBatch(
            input_ids=tokens[:, 0].contiguous(), positions=torch.full((batch,), context, device=dev),
            out_cache_loc=locs[:, context].contiguous(), req_slots=slots,
            seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=dev),
            prefix_lens=torch.full((batch,), context, dtype=torch.int32, device=dev),
            qo_indptr=torch.arange(batch + 1, dtype=torch.int32, device=dev), req_to_token=table.table,
            host_req_slots=list(range(1, batch + 1)), host_seq_lens=[context + 1] * batch,
            host_extend_lens=[1] * batch, is_decode=True, max_seq_len=context + 1)
        positions = (context + torch.arange(q, device=dev)).repeat(batch)
        self.verify = query_rows_batch(tokens.flatten(), positions, locs[:, context:context + q].flatten(),
                                       slots.repeat_interleave(q), table.table, context + q)
        self.verify_extend = fixed_extend_batch(tokens.flatten(), positions, locs[:, context:context + q].flatten(),
                                                slots, q, table.table, context + q)

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        model, engine = self.engine.model, self.engine
        return model.compute_logits(model(fb, engine.kv, engine.backend))


def _time_eager(fn, iters: int, device: torch.device) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the host clock after a synchronize: all queued work done
    return (time.perf_counter() - start) / iters * 1e3


def kernel_table(fn, replays: int = 10) -> list[list]:
    """[kernel name, launches, self device us] per replay of `fn` captured in a CUDA graph,
    slowest first (torch.profiler). With PDL on (the default) a kernel starts before the one
    ahead of it finishes and its time includes that wait: the counts hold, the times need
    TANDEM_PDL=0."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = [[ev.key, ev.count / replays, ev.self_device_time_total / replays]
            for ev in prof.key_averages() if ev.self_device_time_total > 0]
    graph.reset()
    return sorted(rows, key=lambda r: -r[2])


@torch.no_grad()
def measure(engine: Engine, batch: int, k: int, context: int, iters: int, kernels: bool = False) -> VerifyRow:
    shapes = Shapes(engine, batch, k, context)
    # Fill the context's KV once (a prefill of `context` random tokens is not needed: any KV
    # values time the same), then check the layout on the verify's first position.
    decode_logits = shapes.run(shapes.decode).clone()
    verify_logits = shapes.run(shapes.verify).clone()
    layouts = float((verify_logits - shapes.run(shapes.verify_extend)).abs().max())
    first = verify_logits.view(batch, k + 1, -1)[:, 0]
    diff = float((first - decode_logits).abs().max())
    dev = engine.device
    batches = (shapes.decode, shapes.verify, shapes.verify_extend)
    eager = [_time_eager(lambda fb=fb: shapes.run(fb), iters, dev) for fb in batches]
    if dev.type == "cuda":
        from tandem.kernels.gemm_tuner import graph_time_ms  # imports Triton: CUDA only
        timed = [graph_time_ms(lambda _, fb=fb: shapes.run(fb), 1, iters) for fb in batches]
    else:
        timed = eager
    tables = None
    if kernels and dev.type == "cuda":
        tables = {name: kernel_table(lambda fb=fb: shapes.run(fb)) for name, fb in
                  (("decode", shapes.decode), ("verify", shapes.verify))}
    return VerifyRow(batch, k, context, timed[0], timed[1], timed[2], eager[0], eager[1], diff, layouts,
                     kernels=tables)


@torch.no_grad()
def force_fused(engine: Engine, bucket: int) -> int:
    """Give every normed projection (qkv, gate/up) and gated one (down) a fused-prologue plan
    at M bucket `bucket`: the fastest fused candidate, even where the startup tuner timed it
    slower than the norm or SiLU-mul launch plus the GEMM. The A/B behind it (H200, session
    19): the tuner, timing each shape alone, keeps the launches apart at M = 8, yet a 5-row
    verify forward of the built-in shape ran 10% faster with them fused (PDL on). CUDA only.
    Returns how many plans it set."""
    from tandem.kernels.gemm_tuner import candidates  # imports Triton: CUDA only
    from tandem.models.linear import Linear
    sms = torch.cuda.get_device_properties(engine.device).multi_processor_count
    chosen: dict[tuple, object] = {}
    count = 0
    for layer in (m for m in engine.model.modules() if isinstance(m, Linear)):
        for kind, plan in (("norm", layer.norm_plan if layer.normed else None),
                           ("silu_mul", layer.silu_plan if layer.gated else None)):
            if plan is None:
                continue
            n, k = layer.weight.shape
            key = (n, k, layer.weight.dtype, kind)
            if key not in chosen:
                chosen[key] = _fastest_fused(layer, kind, bucket, engine.dtype, candidates(n, k, bucket, sms))
            if chosen[key] is not None:
                plan[bucket] = chosen[key]
                count += 1
    return count


def _fastest_fused(layer, kind: str, bucket: int, dtype: torch.dtype, configs: list):
    """The fastest of `configs` for `layer`'s fused prologue `kind` at M = `bucket`, timed in a
    CUDA graph; None when no tile fits its K (the tiny preset's K = 64): its tuned plan stays."""
    if not configs:
        return None
    from tandem.kernels.gemm_tuner import graph_time_ms
    from tandem.kernels.small_m_gemm import NormInput, small_m_gemm, small_m_gemm_add_norm
    w, scale = layer.weight, layer.weight_scale
    k = w.shape[1]
    x = torch.randn(bucket, 2 * k if kind == "silu_mul" else k, device=w.device, dtype=dtype)
    norm = NormInput(torch.ones(k, device=w.device, dtype=dtype), 1e-6, torch.randn_like(x))

    # Copies of the weight past the L2 (192 MiB, as the tuner streams them): decode
    # never finds a layer's weight in cache.
    ws = [w] + [w.clone() for _ in range(min(63, (192 << 20) // (w.numel() * w.element_size())))]

    def launch(cfg):
        if kind == "silu_mul":
            return lambda i: small_m_gemm(x, ws[i], None, scale, cfg, silu_mul=True)
        return lambda i: small_m_gemm_add_norm(x, norm, ws[i], None, scale, cfg)
    timed = {cfg: graph_time_ms(launch(cfg), len(ws)) for cfg in configs}
    return min(timed, key=timed.get)


def _print_tuning(results: dict, row_counts: set[int]) -> None:
    """The startup tuner's choices (`gemm_tuner.tune_model`'s results) for launches of these row
    counts, a line a shape: what the captured forwards run (a Triton config, or the baseline:
    cuBLAS or the two launches)."""
    from tandem.kernels.gemm_tuner import plan_summary
    from tandem.models.linear import m_bucket
    buckets = {m_bucket(rows) for rows in row_counts}
    print("small-M GEMM plans:", plan_summary(results))
    for (n, k, wdt, m, fused), (cfg, ms, base_ms) in sorted(results.items(), key=lambda kv: (kv[0][3], str(kv[0]))):
        if m in buckets:
            print(f"  M={m} N={n} K={k} {str(wdt).replace('torch.', '')} {fused or 'plain'}: "
                  f"{cfg if cfg is not None else 'baseline'} {ms * 1e3:.1f} us (baseline {base_ms * 1e3:.1f} us)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench spec-verify", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--k", type=int, default=4, help="proposals per row (a verify scores k + 1 tokens)")
    ap.add_argument("--context", type=int, default=512, help="cached tokens per row")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--force-fused", type=int, metavar="M",
                    help="then measure again with every fused norm / SiLU-mul prologue plan forced at M "
                         "bucket M (1, 2, 4, 8 or 16; CUDA): the A/B of the tuner's choice there")
    ap.add_argument("--kernels", action="store_true",
                    help="also each forward's CUDA kernels a replay (counts; times are real with TANDEM_PDL=0)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.batch_sizes.split(",") if s]
    if args.force_fused is not None and args.force_fused not in (1, 2, 4, 8, 16):
        ap.error(f"--force-fused takes an M bucket (1, 2, 4, 8 or 16), got {args.force_fused}")
    span = args.context + args.k + 1
    engine = Engine(EngineConfig(model=str(preset_dir(args.preset)), dummy_weights=True, device=args.device,
                                 dtype=args.dtype, cuda_graph="off", warm_up="off", max_model_len=span,
                                 max_running_requests=max(sizes) + 1,
                                 max_total_tokens=max(sizes) * span + 1))
    try:
        if args.force_fused is not None and engine.device.type != "cuda":
            ap.error("--force-fused needs CUDA (the small-M GEMM plans are CUDA's)")
        rows = [measure(engine, b, args.k, args.context, args.iters, args.kernels) for b in sizes]
        if args.force_fused is not None:
            forced = force_fused(engine, args.force_fused)
            print(f"forced {forced} fused prologue plans at M bucket {args.force_fused}")
            rows += [replace(measure(engine, b, args.k, args.context, args.iters, args.kernels),
                             plans=f"fused@{args.force_fused}") for b in sizes]
    finally:
        engine.close()
    print(f"verify of k + 1 = {args.k + 1} tokens per row vs one decode step, {args.preset}, "
          f"{args.context} cached tokens per row ({'CUDA graphs' if engine.device.type == 'cuda' else 'eager'}):")
    print("| plans | batch | decode ms | verify ms | verify / decode | extend layout ms | extend / decode | "
          "eager decode ms | eager verify ms | check | layouts |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.plans} | {r.batch} | {r.decode_ms:.3f} | {r.verify_ms:.3f} | {r.ratio:.3f} | "
              f"{r.verify_extend_ms:.3f} | {r.verify_extend_ms / r.decode_ms:.3f} | {r.decode_eager_ms:.3f} | "
              f"{r.verify_eager_ms:.3f} | {r.first_position_max_diff:.2g} | {r.layouts_max_diff:.2g} |")
    if engine.gemm_tuning:  # which kernel each shape runs at the decode's and the verify's M
        _print_tuning(engine.gemm_tuning, {1, min(16, args.k + 1)})
    for r in rows:
        for name, table in (r.kernels or {}).items():
            print(f"{r.plans} batch {r.batch} {name}: {sum(n for _, n, _ in table):.0f} kernels a replay, "
                  f"{sum(us for _, _, us in table):.1f} us of kernel time")
            for kernel, n, us in table[:12]:
                print(f"  {us:9.1f} us {n:6.1f}x  {kernel[:90]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": [{**asdict(r), "ratio": r.ratio} for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
