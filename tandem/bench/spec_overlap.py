"""`tandem bench spec-overlap`: speculative decoding at a model shape, overlap on vs off.

Dummy weights at a preset's shape (or a model directory), token-id prompts: B requests decode
`--max-tokens` greedily with the given speculative_config, timed after their prefills, with
overlap on and off on the same engine. Reports tokens/s, GPU busy (forward time over forward
time plus the gaps between forwards, from the step timeline's CUDA events), the mean
acceptance length and the share of verify steps. A model drafting for itself
(`{"model": SAME_DIR}`) accepts nearly every proposal: the overlap of the longest verify
steps the shape has, whatever the weights.
"""
from __future__ import annotations

import argparse
import json
import random
import time

from tandem.bench.presets import preset_dir
from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.sampling import SamplingParams


def timed_decode(engine: Engine, batch: int, overlap: bool, max_tokens: int, prompt_len: int,
                 seed: int = 0) -> dict:
    engine.cfg.disable_overlap = not overlap
    engine.reset_prefix_cache()  # runs repeat prompts: each computes its own
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rids = [engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params,
                               request_id=f"so-{batch}-{overlap}-{i}") for i in range(batch)]
    while any(engine.requests[r].num_scheduled_samples == 0 for r in rids):
        engine.step()  # prefill everything first
    before = {r: len(engine.requests[r].output_token_ids) for r in rids}
    stats0, first = engine.stats(), len(engine.timeline.records)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    tokens = sum(len(engine.output(r).token_ids) - before[r] for r in rids)
    stats, summary = engine.stats(), engine.timeline.summary(skip=first)
    for r in rids:
        engine.release(r)
    drafts = stats.get("spec_decode_num_drafts", 0) - stats0.get("spec_decode_num_drafts", 0)
    accepted = stats.get("spec_decode_num_accepted_tokens", 0) - stats0.get("spec_decode_num_accepted_tokens", 0)
    verify = stats.get("spec_decode_verify_steps", 0) - stats0.get("spec_decode_verify_steps", 0)
    steps = len(engine.timeline.records) - first
    return {"batch": batch, "overlap": overlap, "tok_s": tokens / wall, "gpu_busy": summary.get("gpu_busy_fraction"),
            "gpu_forward_ms": summary.get("mean_gpu_forward_ms"), "steps": steps, "verify_steps": verify,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench spec-overlap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model path (default: --preset with dummy weights)")
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}',
                    help='JSON; "model": "self" drafts with the target itself')
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    model = args.model or str(preset_dir(args.preset))
    spec = json.loads(args.speculative_config)
    if spec.get("model") == "self":
        spec["model"] = model
    sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    rows = []
    for speculative in (None, spec):
        engine = Engine(EngineConfig(model=model, dummy_weights=args.model is None, timeline=True,
                                     speculative_config=speculative, max_running_requests=max(64, max(sizes))))
        for b in sizes:
            for overlap in (True, False):
                rows.append({"spec": speculative is not None,
                             **timed_decode(engine, b, overlap, args.max_tokens, args.prompt_len)})
        engine.close()
    print(f"{'spec':5} {'batch':>5} {'overlap':>7} {'tok/s':>9} {'gpu busy':>8} {'fwd ms':>7} {'accept':>6} verify/steps")
    for r in rows:
        acc = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "-"
        busy = f"{r['gpu_busy']:.3f}" if r["gpu_busy"] is not None else "-"
        fwd = f"{r['gpu_forward_ms']:.2f}" if r["gpu_forward_ms"] is not None else "-"
        print(f"{str(r['spec']):5} {r['batch']:>5} {str(r['overlap']):>7} {r['tok_s']:>9,.0f} {busy:>8} {fwd:>7} "
              f"{acc:>6} {r['verify_steps']}/{r['steps']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "speculative_config": spec, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    main()
