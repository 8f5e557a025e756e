"""A step is a transaction: a plan whose launch fails (or whose planning fails) commits nothing.

Faults are injected into the runner's launch and into planning (once KV slots were taken); the
workload is the fuzzed mix of tests/workload.py (prefix reuse, chunked prefill, aborts,
sampling), and the debug books of the prefix cache are checked after every step (conftest).
"""
import os
import signal

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.engine import Engine
from tiny_models import TEST_DEVICE
from workload import assert_kv_conserved, random_specs, run_workload

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device=TEST_DEVICE, dtype="float32", max_prefill_tokens=96,
                               chunked_prefill_size=48, **kw))


class Faults:
    """Wraps a callable; the calls numbered in `at` (1-based) raise `make()` instead
    (`after=True`: once the call has run, i.e. with its effects done)."""

    def __init__(self, target: object, name: str, at: set[int], make, after: bool = False):
        self.real, self.at, self.make, self.after = getattr(target, name), at, make, after
        self.calls, self.failed_batches = 0, []
        setattr(target, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls not in self.at:
            return self.real(*args, **kwargs)
        if self.after:
            self.real(*args, **kwargs)
        elif args and hasattr(args[0], "rows"):
            self.failed_batches.append({row.req.rid for row in args[0].rows})
        raise self.make()


def _oom() -> BaseException:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


@pytest.fixture(scope="module")
def specs():
    return random_specs(60, 1000, seed=11)


@pytest.fixture(scope="module")
def reference(tiny_text_model, specs):
    return run_workload(_engine(tiny_text_model), specs)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("fault", ["interrupt-in-launch", "error-in-scheduling"])
def test_a_failed_step_commits_nothing(tiny_text_model, specs, reference, overlap, fault):
    """The caller catches the failure and steps on: every request ends exactly as in a run
    without faults (nothing half-committed), and every KV slot comes back."""
    engine = _engine(tiny_text_model, disable_overlap=not overlap)
    if fault == "interrupt-in-launch":
        faults = Faults(engine.runner, "launch", {3, 9, 10, 25, 40}, KeyboardInterrupt)
        errors = (KeyboardInterrupt,)
    else:  # the allocation happened, then planning failed: the journal gives the slots back
        faults = Faults(engine.scheduler, "_alloc", {2, 7, 30, 31, 55}, lambda: RuntimeError("injected"),
                        after=True)
        errors = (RuntimeError,)
    assert run_workload(engine, specs, step_errors=errors) == reference
    assert faults.calls > 55
    assert_kv_conserved(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_out_of_memory_in_launch_fails_only_that_steps_requests(tiny_text_model, specs, reference, overlap):
    engine = _engine(tiny_text_model, disable_overlap=not overlap)
    faults = Faults(engine.runner, "launch", {4, 20}, _oom)
    results = run_workload(engine, specs)  # step() does not raise: the engine keeps serving
    failed = set().union(*faults.failed_batches)
    assert failed and len(failed) < len(specs)
    for rid, (tokens, reason, text) in results.items():
        ref_tokens, ref_reason, ref_text = reference[rid]
        if rid in failed and reason == "error":
            assert tokens == ref_tokens[:len(tokens)]  # what it streamed before the failure was right
        else:
            assert (tokens, reason, text) == (ref_tokens, ref_reason, ref_text)
    assert sum(r[1] == "error" for r in results.values()) > 0
    assert_kv_conserved(engine)
    # The prefix cache now holds what the failed requests computed, and only that: the same
    # prompts again reuse it and give the reference outputs.
    assert engine.stats()["prefix_cache_tokens"] > 0
    assert run_workload(engine, specs) == reference


def test_failed_request_reports_the_error_and_the_engine_serves_on(tiny_text_model):
    engine = _engine(tiny_text_model)
    Faults(engine.runner, "launch", {2}, _oom)
    rid = engine.add_request([5, 6, 7], GREEDY)
    finals = []
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    (final,) = finals
    assert final.finish_reason == "error" and "out of memory" in final.error
    assert engine.output(rid).finish_reason == "error"
    engine.release(rid)
    again = engine.add_request([5, 6, 7], GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert engine.output(again).finish_reason == "length" and len(engine.output(again).token_ids) == 12
    engine.release(again)
    assert_kv_conserved(engine)


@pytest.fixture
def ctrl_c_raises():
    """Python's own SIGINT handler, as in an interactive session (a test run started in the
    background, as CI's may be, inherits SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_generate_leaves_nothing_behind(tiny_text_model, ctrl_c_raises):
    """A real SIGINT, sent from inside a launch (mid-step): generate raises KeyboardInterrupt
    at the next step boundary, cancels its requests, and the LLM works as before."""
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    prompts = [[5 + i, 6, 7, 8] for i in range(6)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    launch, calls = llm.engine.runner.launch, []

    def interrupted_launch(batch, **kwargs):
        calls.append(batch.step)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return launch(batch, **kwargs)

    llm.engine.runner.launch = interrupted_launch
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(calls) == 3  # the interrupted step completed; no step after it was launched
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    engine = llm.engine
    assert not engine.requests and not engine.has_unfinished()
    assert_kv_conserved(engine)
    llm.engine.runner.launch = launch
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    llm.close()
