"""`tandem bench soak`: thousands of fuzzed requests through the OpenAI server, checked.

Starts two servers on the same model: the target (overlap on, prefix cache on: the
defaults, plus `--server-args`) and a reference (`--reference-args`, by default
`--disable-overlap --no-prefix-caching`: the plain loop with every prompt computed from
scratch, the simplest path to a token). Drives `--requests` fuzzed requests at the target
with `--concurrency` in flight (`tandem.bench.soak_cases`: both endpoints, streamed and
not, n > 1, stop strings, shared prefixes, clients that disconnect or abort, and bad inputs
that must get a 4xx), sampling the resident memory of its front end and engine process.
Then drops the prefix cache and waits for the target to settle: KV usage must be back to 0.
Last, sends every distinct greedy request that completed to the reference, one at a time
per key, and compares each choice's text and finish reason; for a mismatch it asks the
reference where the texts diverged and how close that greedy pick was (a near-tie in the
logits, which other batch shapes may round the other way, or a real difference).

Beside the traffic a canary streams one long greedy answer after another
(`tandem.bench.soak_canary`); its longest wait between two chunks must stay under
`--canary-max-gap`: no request may stall the others.

Passes (exit 0) with no mismatch, no 5xx, no error event in a stream, no malformed answer,
no bad input accepted, no KV left in use and the canary never stalled. Prints a table; `--out` gets the full report
(results.json), every request with its outcome (requests.jsonl) and the servers' logs.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

import httpx

import tandem
from tandem.bench.launch import ServerProcess, rss_mib, running_servers, settled
from tandem.bench.soak_canary import Canary, CanaryReport
from tandem.bench.soak_cases import Case, Planner
from tandem.bench.soak_client import Outcome, send
from tandem.bench.soak_triage import NEAR_TIE, divergence

DEFAULT_REFERENCE = "--disable-overlap --no-prefix-caching"
TINY_POOL = 65536  # KV slots of the default tiny model's servers (so a leak is counted in slots)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument("--bad-fraction", type=float, default=0.1, help="share of bad inputs")
    p.add_argument("--sampled-fraction", type=float, default=0.25,
                   help="share of well-formed requests sampled (temperature > 0) instead of greedy; on "
                        "the CPU keep it small: a step with one sampled row draws noise for every row")
    p.add_argument("--model", default=None, help="model path (default: a tiny random Llama with the built-in "
                   "model's tokenizer, written to OUT/model)")
    p.add_argument("--tokenizer", default=None, help="for the tiny model: a saved HF tokenizer directory "
                   "(default: the built-in model's)")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-request-bytes", type=int, default=1 << 20)
    p.add_argument("--server-args", default="", help="more options for the target server (one string)")
    p.add_argument("--reference-args", default=DEFAULT_REFERENCE, help="options of the reference server")
    p.add_argument("--rss-interval", type=float, default=2.0, help="seconds between RSS samples")
    p.add_argument("--canary-max-gap", type=float, default=2.0,
                   help="seconds the canary stream may wait between two chunks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="soak-out", help="folder for results.json, the servers' logs, the model")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or tiny_model(out / "model", args.tokenizer, args.seed)
    common = ["--max-model-len", str(args.max_model_len), "--max-request-bytes", str(args.max_request_bytes),
              "--log-level", "warning"]
    if args.model is None:
        common += ["--max-total-tokens", str(TINY_POOL)]
    env = {"PYTHONPATH": str(Path(tandem.__file__).resolve().parents[1])}  # the servers run this tree
    if args.device == "cpu" or args.model is None:
        env["OMP_NUM_THREADS"] = "1"  # tiny models: one thread is fastest, and the cores are shared
    _log(f"starting target and reference servers on {model}")
    servers = [(model, out / "target.log", common + shlex.split(args.server_args)),
               (model, out / "reference.log", common + shlex.split(args.reference_args))]
    with running_servers(*servers, device=args.device, env=env) as (target, reference):
        report = asyncio.run(soak(args, Path(model), target, reference))
    report["config"] = {**vars(args), "model": str(model), "commit": _commit()}
    (out / "results.json").write_text(json.dumps(report, indent=1))
    print(format_table(report))
    print(f"full results: {out / 'results.json'}")
    return 0 if report["passed"] else 1


async def soak(args: argparse.Namespace, model: Path, target: ServerProcess, reference: ServerProcess) -> dict:
    name = httpx.get(target.url + "/v1/models").json()["data"][0]["id"]
    vocab = await asyncio.to_thread(_vocab_size, model)
    planner = Planner(args.seed, name, vocab, args.max_model_len, args.max_request_bytes)
    cases = planner.plan(args.requests, args.bad_fraction, args.sampled_fraction)
    sampler = RssSampler({"front_end": target.proc.pid, "engine": target.engine_pid}, args.rss_interval)
    sampler.sample()
    task = asyncio.create_task(sampler.run())
    canary, canary_stop = Canary(target.url, name), asyncio.Event()
    canary_task = asyncio.create_task(canary.run(canary_stop))
    start = time.monotonic()
    outcomes = await drive(target.url, cases, args.concurrency, "soak")
    soak_s = time.monotonic() - start
    canary_stop.set()
    await canary_task
    httpx.post(target.url + "/reset_prefix_cache", timeout=30)
    reached, after = await asyncio.to_thread(settled, target.url, 0.0, 60.0)
    task.cancel()
    sampler.sample()
    start = time.monotonic()
    compared, mismatches, ref_errors = await compare_with_reference(reference.url, cases, outcomes,
                                                                   args.concurrency)
    with open(Path(args.out) / "requests.jsonl", "w") as f:  # every request and what it got
        for case, o in zip(cases, outcomes):
            f.write(json.dumps({"path": case.path, "stream": case.stream, "leave": case.leave, "greedy": case.greedy,
                                "body": case.body[:2000].decode(errors="replace"), **dataclasses.asdict(o)}) + "\n")
    report = summarize(cases, outcomes, compared, mismatches, ref_errors, reached, after, sampler,
                       soak_s, time.monotonic() - start, TINY_POOL if args.model is None else None)
    return with_canary(report, canary.report, args.canary_max_gap)


def with_canary(report: dict, canary: CanaryReport, max_gap: float) -> dict:
    """The canary's figures, and its verdict: it ran, never failed, and never waited too long."""
    ok = canary.streams > 0 and canary.failed == 0 and canary.longest_gap_s <= max_gap
    return {**report, "passed": report["passed"] and ok,
            "canary": {**canary.to_dict(), "max_gap_s": max_gap, "passed": ok}}


async def drive(base: str, cases: list[Case], concurrency: int, label: str) -> list[Outcome]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    done, start = 0, time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as http:
        async def one(case: Case) -> Outcome:
            nonlocal done
            async with gate:
                out = await send(http, base, case)
            done += 1
            if done % 500 == 0 or done == len(cases):
                _log(f"{label}: {done}/{len(cases)} in {time.monotonic() - start:.0f} s")
            return out
        return list(await asyncio.gather(*(one(c) for c in cases)))


async def compare_with_reference(base: str, cases: list[Case], outcomes: list[Outcome], concurrency: int
                                 ) -> tuple[int, list[dict], list[dict]]:
    """(greedy answers compared, mismatches, reference failures): each distinct greedy request
    that completed is sent once to the reference, not streamed, and every answer to it must
    have the same text and finish reason per choice."""
    by_key: dict[str, list[int]] = collections.defaultdict(list)
    for case, out in zip(cases, outcomes):
        if case.greedy and out.result == "completed":
            by_key[case.key].append(case.index)
    firsts = [dataclasses.replace(cases[ids[0]], body=_unstreamed(cases[ids[0]].body), stream=False,
                                  leave="complete") for ids in by_key.values()]
    refs = await drive(base, firsts, concurrency, "reference")
    mismatches, errors = [], []
    for ids, ref in zip(by_key.values(), refs):
        if ref.result != "completed":
            errors.append({"index": ids[0], "result": ref.result, "status": ref.status, "error": ref.error})
            continue
        mismatches += find_mismatches([outcomes[i] for i in ids], ref, cases[ids[0]].key)
    await _triage(base, cases, mismatches[:50])
    return sum(len(ids) for ids in by_key.values()), mismatches, errors


async def _triage(base: str, cases: list[Case], mismatches: list[dict]) -> None:
    """Adds to each mismatch where its first differing choice left the reference, and how
    close that greedy pick was (`tandem.bench.soak_triage`)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as http:
        for m in mismatches:
            got, want = m["got"], m["want"]
            pairs = list(zip(got["texts"], want["texts"], got["finish"], want["finish"]))
            choice = next((i for i, (a, b, fa, fb) in enumerate(pairs) if (a, fa) != (b, fb)), 0)
            case = cases[m["index"]]
            m["choice"] = choice
            m["divergence"] = await divergence(http, base, case.path, _unstreamed(case.body), choice,
                                               got["texts"][choice] if got["texts"] else "")


def find_mismatches(answers: list[Outcome], ref: Outcome, key: str) -> list[dict]:
    """The answers whose choices differ from the reference's in text or finish reason."""
    return [{"index": a.index, "request": key[:500], "got": {"texts": a.texts, "finish": a.finish},
             "want": {"texts": ref.texts, "finish": ref.finish}}
            for a in answers if (a.texts, a.finish) != (ref.texts, ref.finish)]


def _unstreamed(body: bytes) -> bytes:
    d = json.loads(body)
    d.pop("stream", None)
    d.pop("stream_options", None)
    return json.dumps(d).encode()


class RssSampler:
    """VmRSS of named processes every `interval` seconds (MiB; None once a process is gone)."""

    def __init__(self, pids: dict[str, int], interval: float):
        self.pids, self.interval, self.start = pids, interval, time.monotonic()
        self.samples: list[dict] = []

    def sample(self) -> None:
        self.samples.append({"t": round(time.monotonic() - self.start, 1),
                             **{name: rss_mib(pid) for name, pid in self.pids.items()}})

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.sample()

    def span(self, name: str) -> dict:
        values = [s[name] for s in self.samples if s[name] is not None]
        return {"start": values[0], "peak": max(values), "end": values[-1]} if values else {}


def summarize(cases: list[Case], outcomes: list[Outcome], compared: int, mismatches: list[dict],
              ref_errors: list[dict], reached: bool, after: dict, sampler: RssSampler, soak_s: float,
              ref_s: float, pool: int | None) -> dict:
    results = collections.Counter(o.result for o in outcomes)
    good = [o for o, c in zip(outcomes, cases) if c.kind == "good"]
    bad = [o for o, c in zip(outcomes, cases) if c.kind != "good"]
    refused = collections.Counter(str(o.status) for o in bad if o.result == "refused")
    usage = after.get("tandem_kv_cache_usage", float("nan"))
    problems = [o for o in outcomes if o.result in ("server_error", "stream_error", "broken")]
    counts = {
        "sent": len(cases), "good": len(good), "bad": len(bad),
        "completed": results["completed"], "disconnected": results["disconnected"], "aborted": results["aborted"],
        "good_refused": sum(o.result == "refused" for o in good),
        "bad_refused": sum(refused.values()), "bad_refused_by_status": dict(sorted(refused.items())),
        "bad_accepted": sum(o.result == "completed" for o in bad),
        "server_errors_5xx": results["server_error"], "stream_errors": results["stream_error"],
        "broken": results["broken"], "greedy_compared": compared, "mismatches": len(mismatches),
        "mismatches_near_tie": sum(1 for m in mismatches if (m.get("divergence") or {}).get("top2_gap") is not None
                                   and m["divergence"]["top2_gap"] < NEAR_TIE),
        "reference_errors": len(ref_errors), "settled": reached, "kv_usage_after_reset": usage,
        "leaked_kv_slots": round(usage * pool) if pool else None,
    }
    passed = (counts["mismatches"] == 0 and not problems and counts["bad_accepted"] == 0 and reached
              and usage == 0 and not ref_errors)
    bad_kinds = collections.defaultdict(collections.Counter)
    for c, o in zip(cases, outcomes):
        if c.kind != "good":
            bad_kinds[c.kind][str(o.status)] += 1
    return {
        "passed": passed, "counts": counts, "soak_s": soak_s, "reference_s": ref_s,
        "rss_mib": {name: sampler.span(name) for name in sampler.pids}, "rss_samples": sampler.samples,
        "bad_by_kind": {k: dict(v) for k, v in sorted(bad_kinds.items())},
        "problems": [dataclasses.asdict(o) for o in problems[:200]], "mismatches": mismatches[:200],
        "reference_errors": ref_errors[:200], "metrics_after": after,
    }


def format_table(report: dict) -> str:
    c, rss = report["counts"], report["rss_mib"]
    by_status = ", ".join(f"{k}: {v}" for k, v in c["bad_refused_by_status"].items())
    leaked = c["leaked_kv_slots"] if c["leaked_kv_slots"] is not None else "?"
    rows = [
        ("requests sent (good / bad)", f"{c['sent']} ({c['good']} / {c['bad']})"),
        ("completed", c["completed"]),
        ("disconnected mid-stream / aborted", f"{c['disconnected']} / {c['aborted']}"),
        ("good requests refused", c["good_refused"]),
        ("bad inputs refused (by status)", f"{c['bad_refused']} ({by_status})"),
        ("bad inputs accepted", c["bad_accepted"]),
        ("5xx / error events / malformed", f"{c['server_errors_5xx']} / {c['stream_errors']} / {c['broken']}"),
        ("greedy answers compared", c["greedy_compared"]),
        ("mismatches vs reference (near-ties)", f"{c['mismatches']} ({c['mismatches_near_tie']})"),
        ("KV in use after reset (slots)", f"{c['kv_usage_after_reset']} ({leaked})"),
        ("soak / reference time (s)", f"{report['soak_s']:.0f} / {report['reference_s']:.0f}"),
    ]
    rows += [(f"RSS {name} MiB start / peak / end", " / ".join(f"{span[k]:.0f}" for k in ("start", "peak", "end")))
             for name, span in rss.items() if span]
    if "canary" in report:
        k = report["canary"]
        rows.append(("canary streams (failed) / longest gap s", f"{k['streams']} ({k['failed']}) / "
                     f"{k['longest_gap_s']:.3f} (limit {k['max_gap_s']})"))
        rows.append(("canary longest wait for a first chunk s", f"{k['longest_first_chunk_s']:.2f}"))
    rows.append(("result", "PASS" if report["passed"] else "FAIL"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def tiny_model(path: Path, tokenizer_dir: str | None, seed: int) -> Path:
    """A 2-layer random Llama (hidden 64, untied, peaked logits) with a real tokenizer."""
    import torch
    import transformers

    from tandem.bench.presets import load_tokenizer

    if (path / "config.json").is_file():
        return path
    tokenizer = load_tokenizer(tokenizer_dir)
    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=4096, initializer_range=0.2, rms_norm_eps=1e-6,
                                   tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                                   eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _vocab_size(model: str | Path) -> int:
    """Token ids a well-formed prompt may use: the model's and the tokenizer's vocabulary both."""
    from tandem.models.checkpoint import open_checkpoint

    ckpt = open_checkpoint(Path(model), config_only=True)
    return min(int(ckpt.config["vocab_size"]), len(ckpt.load_tokenizer()))


def _commit() -> str:
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(tandem.__file__).parent).stdout.strip()
    except OSError:
        return "?"


def _log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
