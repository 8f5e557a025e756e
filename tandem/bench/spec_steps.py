"""`tandem bench spec-steps`: where a speculative step's time goes, by step kind.

One task of `tandem bench spec` (B copies of its prompt, greedy) runs twice through `LLM()`
with the step timeline on, plain and with `--speculative-config`; after an untimed warm-up of
the same shape, the timed run's steps are grouped by kind (verify steps with proposals,
verify steps whose rows all have k = 0, plain decode steps) and each group's medians are
printed: GPU ms of the forward span, host ms to plan, launch and process a step, the host's
wait, the CPU's lead over the GPU. Then the step-kind sequence (V verify, 0 verify without
proposals, d decode, p prefill). `--kernels` adds torch.profiler's CUDA kernel table of a
third run. CUDA only (the timeline's GPU figures need CUDA events).
"""
from __future__ import annotations

import argparse
import json
import statistics

from tandem.bench.spec_prompts import TASKS
from tandem.bench.spec_tasks import add_model_args, timed_chat
from tandem.diagnostics.profile import host_profile
from tandem.entrypoints.llm import LLM

FIELDS = ("gpu_forward_ms", "gpu_idle_before_ms", "schedule_ms", "launch_ms", "process_ms", "host_wait_ms",
          "cpu_lead_ms")
KINDS = {"verify": lambda r: (r.verify_k or 0) > 0, "verify_k0": lambda r: r.verify_k == 0,
         "decode": lambda r: r.verify_k is None and r.is_decode}


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def _kind_letter(r) -> str:
    if (r.verify_k or 0) > 0:
        return "V"
    if r.verify_k == 0:
        return "0"
    return "d" if r.is_decode else "p"


def profile(model: str | None, spec: dict | None, task: str, batch: int, max_tokens: int,
            kernels: bool, host: bool = False) -> dict:
    kw = {"timeline": True, "speculative_config": spec}
    if model is not None:
        kw["model"] = model
    llm = LLM(**kw)
    try:
        _, _, first = timed_chat(llm, task, batch, max_tokens)
        records = list(llm.engine.timeline.records)[first:]
        out: dict = {"kinds": "".join(_kind_letter(r) for r in records), "groups": {}}
        for name, select in KINDS.items():
            group = [r for r in records if select(r)]
            if group:
                out["groups"][name] = {"steps": len(group), **{f: _median([getattr(r, f) for r in group])
                                                               for f in FIELDS},
                                       "proposed": sum(r.proposed or 0 for r in group),
                                       "accepted": sum(r.accepted or 0 for r in group)}
        if kernels:
            import torch
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                timed_chat(llm, task, batch, max_tokens, warm=False)
                torch.cuda.synchronize()
            out["kernel_table"] = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30,
                                                            max_name_column_width=60)
        if host:  # after the timed run: the profiler slows the host several times over
            out["host_profile"] = host_profile(lambda: timed_chat(llm, task, batch, max_tokens, warm=False))
        return out
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench spec-steps", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--task", default="copy", choices=sorted(TASKS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--kernels", action="store_true", help="also print the CUDA kernel table of each")
    ap.add_argument("--host-profile", action="store_true",
                    help="also print a cProfile of one more run of each (where a step's host time goes)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    spec = json.loads(args.speculative_config)
    results = {label: profile(args.model, config, args.task, args.batch, args.max_tokens, args.kernels,
                              args.host_profile)
               for label, config in (("plain", None), ("spec", spec))}
    for label, res in results.items():
        for kind, g in res["groups"].items():
            figures = " ".join(f"{f.removesuffix('_ms')} {g[f]}" for f in FIELDS)
            print(f"{label:5} {kind:9} steps {g['steps']:4d}  {figures}  accepted/proposed "
                  f"{g['accepted']}/{g['proposed']}")
        print(f"{label:5} kinds {res['kinds']}")
        if "kernel_table" in res:
            print(res["kernel_table"])
        if "host_profile" in res:
            print(res["host_profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
