"""Tensor and data parallelism on one multi-GPU host, dummy weights: one process per figure.

  python3 -m tandem.bench.tp_scaling --out DIR [--budget-s 280]   (2 GPUs: nvidia-h200-x2)

Phases (each a fresh process, skipped when the budget is spent): Llama-3.1-8B shape with
TP=1 and TP=2 (batch-1 decode tok/s, then the standard offline workload: output tok/s,
roofline fraction, GPU busy of rank 0), Llama-3.1-70B shape with TP=2, and Qwen3-0.6B
served with --dp 1 and --dp 2 through `tandem bench serve`. Writes DIR/<phase>.json and
.log, prints a table.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

PHASES = [  # name, preset, tp, offline requests, seconds it needs at least
    ("8b-tp1", "llama-3.1-8b", 1, 256, 60),
    ("8b-tp2", "llama-3.1-8b", 2, 256, 60),
    ("70b-tp2", "llama-3.1-70b", 2, 64, 80),
]


def run_phase(preset: str, tp: int, requests: int, out: Path) -> None:
    from tandem.bench.latency import steady_decode
    from tandem.bench.offline import make_workload, run_tandem, warm_up
    from tandem.bench.presets import preset_dir
    from tandem.bench.roofline import measure_hardware, model_cost
    from tandem.config import EngineConfig
    from tandem.entrypoints.llm import LLM  # starts the ranks
    t0 = time.perf_counter()
    cfg = EngineConfig(model=preset_dir(preset), dummy_weights=True, timeline=True,
                       tensor_parallel_size=tp, max_running_requests=256)
    error = None
    try:
        llm = LLM.from_config(cfg)
    except Exception as exc:  # e.g. a collective that cannot be captured: measure without graphs
        error = f"{type(exc).__name__}: {exc}"
        print(f"[tp_scaling] start failed ({error}); retrying with cuda_graph=off", flush=True)
        cfg.cuda_graph = "off"
        llm = LLM.from_config(cfg)
    engine = llm.engine
    result = {"preset": preset, "tp": tp, "startup_s": time.perf_counter() - t0, "start_error": error,
              "cuda_graphs": engine.runner.graphs is not None, "kv_tokens": engine.kv_slots.count}
    try:
        b1 = steady_decode(engine, 1, True, steps=200, warmup=20, prompt_len=128)
        result["decode_b1"] = {"tok_s": b1.tokens_per_s, "step_ms": b1.step_ms,
                               "gpu_forward_ms": b1.gpu_forward_ms, "gpu_busy": b1.gpu_busy}
        out.write_text(json.dumps(result, indent=1))
        wl = make_workload(requests, engine.model_config.vocab_size, 100, 1024, 0)
        hw = measure_hardware(engine.device, engine.dtype)
        cost = model_cost(engine.model, engine.model.local_config, engine.kv_dtype)
        warm_up(llm, wl)
        row = run_tandem(llm, wl, True, cost, hw, progress=False)
        result["offline"] = row.to_dict()
        result["hardware"] = {"bandwidth_gbs": hw.bandwidth / 1e9, "matmul_tflops": hw.matmul_flops / 1e12}
        out.write_text(json.dumps(result, indent=1))
    finally:
        engine.close()


def run_dp(dp: int, out: Path, budget_s: float) -> None:
    """`tandem serve --dp N` with Qwen3-0.6B dummy weights, driven by `tandem bench serve`."""
    import httpx
    from tandem.bench.presets import preset_dir
    port = 18000 + dp
    server = subprocess.Popen([sys.executable, "-m", "tandem.server", "--model", preset_dir("qwen3-0.6b"),
                               "--dummy-weights", "--dp", str(dp), "--port", str(port), "--log-level", "warning"])
    try:
        deadline = time.monotonic() + budget_s
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server did not come up")
            time.sleep(0.5)
        subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                        "--rates", "inf", "--num-prompts", "512", "--json", str(out)], check=True,
                       timeout=max(10, deadline - time.monotonic()))
    finally:
        server.terminate()
        server.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=280)
    ap.add_argument("--phase")
    args = ap.parse_args()
    out = Path(args.out)
    if args.phase:  # child
        if args.phase.startswith("dp"):
            run_dp(int(args.phase[2:]), out / f"{args.phase}.json", args.budget_s)
            return 0
        name, preset, tp, requests, _ = next(p for p in PHASES if p[0] == args.phase)
        run_phase(preset, tp, requests, out / f"{name}.json")
        return 0
    deadline = time.monotonic() + args.budget_s
    for name, need in [(p[0], p[4]) for p in PHASES] + [("dp1", 50), ("dp2", 50)]:
        left = deadline - time.monotonic()
        if left < need:
            print(f"[tp_scaling] skip {name}: {left:.0f}s left", flush=True)
            continue
        t = time.monotonic()
        with open(out / f"{name}.log", "w") as log:
            try:
                code = subprocess.run([sys.executable, "-m", "tandem.bench.tp_scaling", "--phase", name, "--out", str(out),
                                       "--budget-s", str(left - 5)], stdout=log, stderr=subprocess.STDOUT,
                                      timeout=left - 2).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        print(f"[tp_scaling] {name}: exit {code} in {time.monotonic() - t:.0f}s", flush=True)
    print(table(out))
    return 0


def table(out: Path) -> str:
    lines = ["| run | startup s | b=1 decode tok/s | b=1 step ms | offline out tok/s | roofline | roofline (GPU time) | GPU busy r0 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda x, p="{:,.1f}": "-" if x is None else p.format(x)  # noqa: E731
    for name, *_ in PHASES:
        f = out / f"{name}.json"
        if not f.exists():
            continue
        r = json.loads(f.read_text())
        b1, off = r.get("decode_b1", {}), r.get("offline", {})
        lines.append(f"| {name} | {r['startup_s']:.0f} | {fmt(b1.get('tok_s'))} | {fmt(b1.get('step_ms'), '{:.2f}')} | "
                     f"{fmt(off.get('output_tok_s'), '{:,.0f}')} | {fmt(off.get('roofline_fraction'), '{:.1%}')} | "
                     f"{fmt(off.get('roofline_fraction_gpu'), '{:.1%}')} | {fmt(off.get('gpu_busy'), '{:.1%}')} |")
    for name in ("dp1", "dp2"):
        f = out / f"{name}.json"
        if f.exists():
            lines.append(f"{name}: {f.read_text()[:600]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
