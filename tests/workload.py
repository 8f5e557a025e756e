"""A mixed, reproducible workload driven through Engine.step(), for equivalence tests."""
import random
from dataclasses import dataclass

from tandem.engine import Engine
from tandem.sampling import SamplingParams


@dataclass
class Spec:
    rid: str
    prompt: list[int]
    params: SamplingParams
    abort_after: int | None = None  # abort once this many tokens were seen


def random_specs(n: int, vocab: int, seed: int, stop_pool: list[str] = (),
                 stop_id_pool: list[int] = ()) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 80))]
        kind = rng.random()
        params = dict(max_tokens=rng.randint(1, 40), temperature=0.0 if kind < 0.5 else 0.8,
                      top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([-1, 20]), seed=rng.randrange(1000))
        if stop_pool and rng.random() < 0.3:
            params["stop"] = [rng.choice(stop_pool)]
        if stop_id_pool and rng.random() < 0.3:
            params["stop_token_ids"] = [rng.choice(stop_id_pool)]
        abort = rng.randint(0, 10) if rng.random() < 0.1 else None
        specs.append(Spec(f"r{i}", prompt, SamplingParams(**params), abort))
    return specs


def run_workload(engine: Engine, specs: list[Spec], arrive_per_step: int = 8,
                 step_errors: tuple[type[BaseException], ...] = ()) -> dict:
    """Requests arrive a few per step; aborts fire when a request has seen `abort_after`
    tokens (token counts, not step numbers, so overlap on and off abort at the same place).
    A step that raises one of `step_errors` is stepped past, as a caller that caught it would."""
    pending, results, seen = list(specs), {}, {}
    by_rid = {s.rid: s for s in specs}
    while pending or engine.has_unfinished():
        for spec in pending[:arrive_per_step]:
            engine.add_request(spec.prompt, spec.params, request_id=spec.rid)
            seen[spec.rid] = 0
            if spec.abort_after == 0:
                engine.abort(spec.rid)
        pending = pending[arrive_per_step:]
        try:
            outs = engine.step()
        except step_errors:
            continue
        for out in outs:
            seen[out.request_id] += len(out.new_token_ids)
            limit = by_rid[out.request_id].abort_after
            if not out.finished and limit is not None and seen[out.request_id] >= limit:
                engine.abort(out.request_id)
    for spec in specs:
        o = engine.output(spec.rid)
        results[spec.rid] = (o.token_ids, o.finish_reason, o.text)
        engine.release(spec.rid)
    return results


def assert_same_tokens(plain: dict, spec: dict, specs: list[Spec]) -> None:
    """Every request's tokens and finish reason in `spec` equal `plain`'s; an aborted one may
    have seen more tokens before its abort (a verify step emits several), so the shorter is a
    prefix of the longer."""
    for s in specs:
        (a, ra, _), (b, rb, _) = plain[s.rid], spec[s.rid]
        if "abort" in (ra, rb):
            n = min(len(a), len(b))
            assert a[:n] == b[:n], s.rid
        else:
            assert (a, ra) == (b, rb), s.rid


def assert_kv_conserved(engine: Engine) -> None:
    """Nothing runs any more: every KV slot is free or held by the prefix cache alone."""
    s = engine.stats()
    assert s["kv_free_tokens"] + s["prefix_cache_tokens"] == s["kv_capacity_tokens"], s
    assert engine.prefix_cache.tree.locked_tokens == 0
    assert engine.req_slots.num_free == engine.req_slots.count


def step_without_host_syncs(engine: Engine) -> None:
    """Step until nothing is left, with CUDA's sync debug mode on: any host sync inside the
    loop (other than the one sanctioned completion wait) raises."""
    import torch
    torch.cuda.set_sync_debug_mode("error")
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
