"""`tandem bench host-steps`: the host time of steady decode steps, on the CPU, on the GPU's path.

Issue 21 counts the host time of a 256-row decode step (schedule, launch, process less its
wait). On a GPU the decode step is a CUDA-graph replay; on the CPU the engine runs eagerly, so
its launch would be the forward's time. Here a stub stands in for the decode graphs (`replay`
returns a small logits buffer, no forward) and for the sampler (random ids, see `RandomIds`):
the step takes the graphed path (`_decode_metadata`, the graph bucket, plain-greedy sampling)
and the host's own work is all that is timed. The stubs' time is taken out of the launch.

Run it on both sides of a change, alternating (the CPU box drifts by tens of percent between
runs): per round it prints the mean ms per step of each phase, the collector's time among them,
then the rounds' medians.
"""
import argparse
import gc
import json
import random
import time

import torch

from tandem.bench.presets import load_tokenizer, preset_dir
from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.sampling import SamplingParams
from tandem.sampling.inputs import SampleOutput


class StubGraphs:
    """`DecodeGraphs`' interface without a forward, one bucket of `max_batch` rows."""

    def __init__(self, max_batch: int):
        self.logits = torch.zeros(max_batch, 1)  # `RandomIds` reads only its row count
        self.buckets, self.max_batch = [max_batch], max_batch

    def bucket(self, batch_size: int) -> int:
        return self.max_batch

    def has_cascade(self, bucket: int) -> bool:
        return False

    def replay(self, bucket: int, ring: int, req_slots: torch.Tensor, cascade: bool = False) -> torch.Tensor:
        return self.logits[:bucket]

    def close(self) -> None:
        pass  # nothing captured


class RandomIds:
    """The sampler's `sample`: seeded random ids, uniform over `pool` ids drawn once from the
    vocabulary (0: all of it). A dummy-weight model's argmax wanders over the vocabulary (the
    Qwen3 shape with 2 layers on the CPU: ~1,000 distinct ids in 1,920 samples), so its text is
    learned id by id and many ids end inside a character; a real model's is mostly looked up."""

    def __init__(self, vocab: int, pool: int, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.pool = torch.randperm(vocab, generator=self.gen)[:pool] if pool else None

    def __call__(self, logits: torch.Tensor, inputs, bitmask=None, extra_counts=None) -> SampleOutput:
        n = logits.shape[0]
        if self.pool is None:
            return SampleOutput(token_ids=torch.randint(self.vocab, (n,), generator=self.gen))
        return SampleOutput(token_ids=self.pool[torch.randint(len(self.pool), (n,), generator=self.gen)])


class _Clock:
    """Seconds spent in the wrapped callables (the stubs), and in the collector while `on`."""

    def __init__(self):
        self.stub_s = self.gc_s = 0.0
        self.on, self._gc_start = False, 0.0
        gc.callbacks.append(self._note_gc)

    def timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.stub_s += time.perf_counter() - start
        return wrapper

    def _note_gc(self, phase: str, info: dict) -> None:
        if self.on and phase == "start":
            self._gc_start = time.perf_counter()
        elif self.on:
            self.gc_s += time.perf_counter() - self._gc_start

    def close(self) -> None:
        gc.callbacks.remove(self._note_gc)


def build(batch: int, tokenizer: str | None, pool: int, preset: str = "tiny") -> tuple[Engine, _Clock]:
    """A CPU engine of `preset` (with the tokenizer's vocabulary, if any) on the stubs."""
    tok = load_tokenizer(None if tokenizer == "builtin" else tokenizer) if tokenizer else None
    engine = Engine(EngineConfig(model=preset_dir(preset, tok), dummy_weights=True, device="cpu", timeline=True,
                                 max_running_requests=batch))
    clock = _Clock()
    stub = StubGraphs(batch)
    stub.replay = clock.timed(stub.replay)
    engine.runner.graphs = stub
    engine.sampler.sample = clock.timed(RandomIds(engine.model_config.vocab_size, pool))
    return engine, clock


def steady_round(engine: Engine, clock: _Clock, batch: int, steps: int, warmup: int, detokenize: bool,
                 tag: str) -> dict[str, float]:
    """Mean host ms a step of `steps` steady decode steps at `batch` rows, by phase."""
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=warmup + steps + 8, temperature=0, ignore_eos=True)
    rids = [engine.add_request([rng.randrange(vocab) for _ in range(128)], params, request_id=f"{tag}-{i}",
                               detokenize=detokenize) for i in range(batch)]
    while any(engine.requests[r].num_scheduled_samples == 0 for r in rids):
        engine.step()
    for _ in range(warmup):
        engine.step()
    first = len(engine.timeline.records)
    clock.stub_s = clock.gc_s = 0.0
    clock.on = True
    for _ in range(steps):
        engine.step()
    clock.on = False
    stub_ms = clock.stub_s * 1e3 / steps
    engine.step()  # the last timed step's result is processed here
    records = engine.timeline.records[first:first + steps]
    engine.cancel(rids)
    while engine.has_unfinished():
        engine.step()
    for rid in rids:
        engine.requests.pop(rid, None)
    n = len(records)
    out = {k: sum(getattr(r, f"{k}_ms") for r in records) / n for k in ("schedule", "launch", "process", "host_wait")}
    out["launch"] -= stub_ms  # the stubs stand for device work
    out["process"] -= out.pop("host_wait")
    out["host"] = out["schedule"] + out["launch"] + out["process"]
    out["gc"] = clock.gc_s * 1e3 / steps
    return {k: round(v, 4) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench host-steps", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--preset", default="tiny", help="the model shape (its forward never runs)")
    ap.add_argument("--tokenizer", metavar="DIR", help="a saved tokenizer ('builtin': the built-in model's); "
                    "without it no text is made")
    ap.add_argument("--text", default="engine", choices=["engine", "caller"],
                    help="with --tokenizer, who makes the text (as `tandem bench latency --text`)")
    ap.add_argument("--pool", type=int, default=4096, help="sampled ids: uniform over this many (0: the vocabulary)")
    ap.add_argument("--json", help="write the rounds and their medians here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    engine, clock = build(args.batch, args.tokenizer, args.pool, args.preset)
    rounds = []
    for i in range(args.rounds):
        rounds.append(steady_round(engine, clock, args.batch, args.steps, args.warmup, args.text == "engine", f"r{i}"))
        print(json.dumps(rounds[-1]), flush=True)
    clock.close()
    engine.close()
    median = {k: sorted(r[k] for r in rounds)[len(rounds) // 2] for k in rounds[0]}
    print("median", json.dumps(median))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds, "median": median}, f, indent=1)
    return 0
