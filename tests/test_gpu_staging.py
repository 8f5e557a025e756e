"""GPU check of a prefill step's inputs staged in the wait (`ModelRunner.stage_ahead`, run on
the H200): its copy goes into the ring slot of the step in flight, so it must wait on the
device for that step's last read (`consumed`), not on the host."""
import time

import pytest
import torch

from tandem.config import EngineConfig, Experiments
from tandem.engine import Engine
from tandem.sampling import SamplingParams
from tiny_models import make_cycling_model
from workload import assert_kv_conserved

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
SLEEP_S = 0.02  # before every decode step's forward; _sleep counts cycles (the H200: <= 1.98 GHz)


@pytest.fixture(scope="module")
def cycling_model(tmp_path_factory):
    """A wrong position or KV slot in a step's inputs changes its greedy tokens."""
    return make_cycling_model(tmp_path_factory.mktemp("cycling"), sharpness=0.3, layer_scale=1.0)


def _run(path, stage_ahead: bool) -> tuple[dict, Engine, list[float]]:
    """A stream decodes while prompts arrive, each its own prefill step after a decode step;
    every decode step's forward starts SLEEP_S late on the device, so when the next prefill is
    staged in the wait, the step whose ring slot it takes has not read its inputs yet."""
    engine = Engine(EngineConfig(model=str(path), device="cuda", dtype="float32", max_prefill_tokens=64,
                                 chunked_prefill_size=64, experiments=Experiments(stage_prefill_ahead=stage_ahead)))
    runner, launch, stage = engine.runner, engine.runner.launch, engine.runner.stage_ahead
    staging_s = []

    def late_decode(batch, **kw):
        if batch.is_decode:
            with torch.cuda.stream(engine.streams.forward):
                torch.cuda._sleep(int(SLEEP_S * 2e9))
        return launch(batch, **kw)

    def timed_stage(batch):
        started = time.perf_counter()
        stage(batch)
        staging_s.append(time.perf_counter() - started)
    runner.launch, runner.stage_ahead = late_decode, timed_stage
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ids = [engine.add_request([5, 6, 7], greedy, request_id="stream")]
    while len(engine.requests["stream"].output_token_ids) < 2:
        engine.step()
    for i in range(6):
        ids.append(engine.add_request([(11 * i + j) % 250 + 3 for j in range(60)], greedy, request_id=f"p{i}"))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    return {rid: engine.requests[rid].output_token_ids for rid in ids}, engine, staging_s


def test_a_prefill_staged_in_the_wait_waits_on_the_device_for_the_slots_last_reader(cycling_model):
    tokens, engine, staging_s = _run(cycling_model, stage_ahead=True)
    want, _, _ = _run(cycling_model, stage_ahead=False)
    assert engine.stats()["steps_staged_ahead"] >= 3
    assert tokens == want
    assert max(staging_s) < SLEEP_S / 2, staging_s  # queued behind the device's wait, not the host's
    assert_kv_conserved(engine)
    engine.close()
