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
from tandem.config import EngineConfig, Experiments
from tandem.engine import Engine
from tiny_models import TEST_DEVICE, make_tiny_model
from workload import Spec, assert_kv_conserved, random_specs, run_workload

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
        elif args and hasattr(args[0], "batch"):  # a launched step (runner.sample)
            self.failed_batches.append({row.req.rid for row in args[0].batch.rows})
        elif args and hasattr(args[0], "rid"):  # one request's token (engine._take_token, _token_output)
            self.failed_batches.append({args[0].rid})
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


def _assert_only_failed_differ(results: dict, reference: dict, failed: set[str]) -> None:
    """The failed requests end with 'error' after a correct beginning; all others are
    token-identical to the fault-free run."""
    assert failed
    for rid, (tokens, reason, text) in results.items():
        ref_tokens, ref_reason, ref_text = reference[rid]
        if rid in failed and reason == "error":
            assert tokens == ref_tokens[:len(tokens)]
        else:
            assert (tokens, reason, text) == (ref_tokens, ref_reason, ref_text), rid
    assert any(results[rid][1] == "error" for rid in failed)


def _serves_next_100(engine: Engine) -> None:
    specs = random_specs(100, 1000, seed=99)
    results = run_workload(engine, specs)
    assert all(reason in ("length", "stop", "abort") for _, reason, _ in results.values())
    assert_kv_conserved(engine)


@pytest.mark.parametrize("phase", ["_take_token", "_token_output", "_plain_token_output"])
@pytest.mark.parametrize("overlap", [True, False])
def test_a_fault_while_processing_a_token_fails_only_its_request(tiny_text_model, specs, reference, overlap, phase):
    """The fault fires inside the processing of step N, i.e. after step N+1 was launched with
    overlap on: step N+1 stays in flight and is processed normally. Any phase: taking the
    token (its outputs, its grammar, its finish), making its text, or both for a token that
    only joins its request (`Engine._read_result`'s inline path)."""
    engine = _engine(tiny_text_model, disable_overlap=not overlap)
    faults = Faults(engine, phase, {5, 60, 61, 200, 333}, lambda: RuntimeError("injected"))
    results = run_workload(engine, specs)
    delattr(engine, phase)  # the class's method again: the next workload runs without faults
    _assert_only_failed_differ(results, reference, set().union(*faults.failed_batches))
    assert_kv_conserved(engine)
    _serves_next_100(engine)


def _grammar_specs(specs: list) -> list:
    """The fuzzed workload with every third request constrained (regex or choice)."""
    constraints = [dict(regex="[a-z ]{2,30}"), dict(choice=["alpha", "beta gamma", "delta"])]
    return [s if i % 3 else Spec(s.rid, s.prompt, s.params.clone(**constraints[i % 2]), s.abort_after)
            for i, s in enumerate(specs)]


@pytest.fixture(scope="module")
def grammar_specs(specs):
    pytest.importorskip("xgrammar")
    return _grammar_specs(specs)


def _grammar_engine(path, specs: list, **kw) -> Engine:
    """Grammars compiled before the run: a cached compilation is ready at the next step, so
    every run admits the constrained requests at the same steps."""
    engine = _engine(path, **kw)
    kinds = {s.params.constraint: s.params for s in specs if s.params.constraint is not None}
    run_workload(engine, [Spec(f"compile{i}", [5, 6], p.clone(max_tokens=1)) for i, p in enumerate(kinds.values())])
    return engine


@pytest.fixture(scope="module")
def grammar_reference(tiny_text_model, grammar_specs):
    return run_workload(_grammar_engine(tiny_text_model, grammar_specs), grammar_specs)


@pytest.mark.parametrize("phase", ["start_masks", "finish_masks"])
@pytest.mark.parametrize("overlap", [True, False])
def test_a_fault_while_filling_masks_rolls_the_step_back(tiny_text_model, grammar_specs, grammar_reference,
                                                         overlap, phase):
    """The masks of step N+1 are filled after its forward was queued and step N's tokens were
    taken: a failure as the fill starts, or as it is joined (where an error of the fill thread
    surfaces), undoes step N+1 (synchronized, rolled back), the caller steps on, and every
    request ends exactly as without the fault."""
    engine = _grammar_engine(tiny_text_model, grammar_specs, disable_overlap=not overlap)
    faults = Faults(engine.grammar, phase, {2, 9, 10, 30}, lambda: RuntimeError("injected"))
    assert run_workload(engine, grammar_specs, step_errors=(RuntimeError,)) == grammar_reference
    assert faults.calls > 30
    assert_kv_conserved(engine)


@pytest.mark.parametrize("phase", ["_take_token", "_token_output"])
def test_a_fault_in_a_token_of_a_step_before_masks_fails_only_its_request(tiny_text_model, grammar_specs,
                                                                          grammar_reference, phase):
    """Before a masked step's sampling, step N's tokens are taken and its text is made after
    the masks: a token failing in either phase ends only its request, and every other request
    (constrained or not) ends exactly as without the fault."""
    engine = _grammar_engine(tiny_text_model, grammar_specs)
    faults = Faults(engine, phase, {7, 40, 41, 150}, lambda: RuntimeError("injected"))
    results = run_workload(engine, grammar_specs)
    _assert_only_failed_differ(results, grammar_reference, set().union(*faults.failed_batches))
    assert_kv_conserved(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_out_of_memory_in_deferred_sampling_fails_only_that_steps_requests(
        tiny_text_model, grammar_specs, grammar_reference, overlap):
    """Out of memory while queueing a constrained step's sampling (after its forward was
    queued): like out of memory in launch, only that step's requests end with 'error'."""
    engine = _grammar_engine(tiny_text_model, grammar_specs, disable_overlap=not overlap)
    faults = Faults(engine.runner, "sample", {6, 25}, _oom)
    results = run_workload(engine, grammar_specs)
    _assert_only_failed_differ(results, grammar_reference, set().union(*faults.failed_batches))
    assert_kv_conserved(engine)
    _serves_next_100(engine)


class _StalledFailingForward:
    """The model, except that its first call stalls the forward stream, then copies the staged
    input ids it would read (queued behind the stall), then fails with out of memory: the
    failed launch leaves device work queued that still reads the staging ring slot."""

    def __init__(self, model, captured: torch.Tensor):
        self.model, self.captured, self.calls = model, captured, 0

    def __getattr__(self, name):  # everything else (compute_logits, ...) is the model's
        return getattr(self.model, name)

    def __call__(self, batch, kv, backend):
        self.calls += 1
        if self.calls > 1:
            return self.model(batch, kv, backend)
        torch.cuda._sleep(500_000_000)  # about a quarter second of GPU time on the forward stream
        self.captured.copy_(batch.input_ids[:len(self.captured)])
        raise _oom()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_failed_launch_fences_its_staging_slot_before_the_retry_overwrites_it(tiny_text_model):
    """The retry of a failed step number stages into the same ring slot. Its inputs must not
    land before the failed attempt's queued reads ran: the stalled reader sees the failed
    step's own prompt, not the retry's (fails without the write-after-read fence)."""
    engine = Engine(EngineConfig(model=str(tiny_text_model), device="cuda", dtype="float32", cuda_graph="off",
                                 warm_up="off"))
    first, retry = list(range(10, 74)), list(range(500, 564))
    captured = torch.full((len(first),), -1, dtype=torch.int64, device="cuda")
    engine.runner.model = _StalledFailingForward(engine.runner.model, captured)
    failed = engine.add_request(first, GREEDY)
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(failed, "error")]
    again = engine.add_request(retry, GREEDY)
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    assert captured.tolist() == first
    assert engine.output(again).finish_reason == "length"
    engine.close()


@pytest.fixture(scope="module")
def decode_model(tmp_path_factory):
    """Short prompts for its vocabulary: most steps of the workload decode."""
    return make_tiny_model(tmp_path_factory.mktemp("decode"), "llama", vocab_size=1000)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [None, "ngram", "draft"])
def test_a_step_failing_after_its_device_writes_is_undone(decode_model, spec):
    """The fault comes once the step's sampling is queued: its tokens are stashed for the next
    step, penalty counts and (speculating) the device lengths and history advanced, its result
    copy queued. The retry must find the state the failed attempt read: every request ends as
    in a run without faults. With a draft, greedy rows are compared (its sampled rows follow
    the target's distribution, not plain decoding's tokens)."""
    specs = random_specs(40, 1000, seed=12)
    for s in specs[::3]:
        s.params = s.params.clone(frequency_penalty=0.7)  # counts the failed attempt advanced
    reference = run_workload(_engine(decode_model), specs)
    config = {None: None, "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
              "draft": {"model": str(decode_model), "num_speculative_tokens": 3}}[spec]
    # Any match verifies: this workload's random tokens seldom repeat two in a row (the default rule).
    engine = _engine(decode_model, speculative_config=config, experiments=Experiments(spec_verify_min_match=1))
    state = {"decode": False, "copies": 0, "failed": 0}
    launch, copy = engine.runner.launch, engine.runner.copier.copy

    def tracked_launch(batch, **kw):
        state["decode"] = batch.is_decode  # decode and verify steps: their inputs come from the device
        return launch(batch, **kw)

    def failing_copy(*args, **kw):  # the last call of a step's queueing, after its device writes
        result = copy(*args, **kw)
        if state["decode"]:
            state["copies"] += 1
            if state["copies"] in (3, 9, 10, 17, 24):
                state["failed"] += 1
                raise KeyboardInterrupt
        return result

    engine.runner.launch, engine.runner.copier.copy = tracked_launch, failing_copy
    results = run_workload(engine, specs, step_errors=(KeyboardInterrupt,))
    assert state["failed"] == 5
    compared = [s.rid for s in specs if spec != "draft" or s.params.temperature == 0]
    assert {r: results[r] for r in compared} == {r: reference[r] for r in compared}
    if spec is not None:
        assert engine.stats()["spec_decode_num_drafts"] > 0
    assert_kv_conserved(engine)
