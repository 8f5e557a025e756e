"""The host tier inside the overlap loop: its copy window beside the awaited step, failures
and aborts there, and admissions or prefills planned ahead while copies run."""
import random

import pytest

from tandem.sampling import SamplingParams
from host_tier import assert_tiers_conserved, chat_specs, make_engine, run_chats, small_tiered_engine
from workload import Spec, assert_kv_conserved, run_workload


@pytest.mark.parametrize("before_wait", [True, False])
def test_the_tier_window_runs_while_the_previous_step_is_awaited(tiny_text_model, before_wait):
    """Default: after step S + 1 is launched, the tier window runs before step S's result is
    waited for and processed (its host work fills that wait, not the gap before the next plan);
    the experiment's other side processes S first. Outputs are the same either way."""
    from tandem.config import Experiments
    rounds = chat_specs(conversations=6, turns=3, seed=8)
    want = run_chats(make_engine(tiny_text_model, max_total_tokens=20000), rounds)
    engine = small_tiered_engine(tiny_text_model, experiments=Experiments(host_kv_window_before_wait=before_wait))
    order: list[tuple[str, int]] = []
    # Processing the step in flight (before a plan or launch that needs S's result) processes S early: not the case here.
    processing = ["process"]
    window, process, in_flight = engine._move_between_tiers, engine._process, engine._process_in_flight
    engine._move_between_tiers = lambda: order.append(("window", engine.pending.batch.step)) or window()
    engine._process = lambda pending: order.append((processing[0], pending.batch.step)) or process(pending)

    def in_flight_marked(outputs):
        processing[0] = "in flight"
        in_flight(outputs)
        processing[0] = "process"

    engine._process_in_flight = in_flight_marked
    assert run_chats(engine, rounds) == want
    at = {entry: i for i, entry in enumerate(order)}
    pairs = [(at[("window", s + 1)], i) for (what, s), i in at.items()
             if what == "process" and ("window", s + 1) in at]
    assert len(pairs) > 20, order[:20]
    assert all((w < p) == before_wait for w, p in pairs), order[:20]
    assert_kv_conserved(engine)
    engine.close()


def test_a_failing_tier_window_loses_no_output(tiny_text_model):
    """The window runs before step S is processed. When it fails (here after its prefetch loads
    were queued), S is processed all the same: the step raises, S's outputs come with the next
    step, and every request's greedy tokens equal a run without the fault."""
    rounds = chat_specs(conversations=10, turns=4, seed=3)  # prefetch loads here (test above)
    want = run_chats(make_engine(tiny_text_model, max_total_tokens=20000), rounds)
    engine = small_tiered_engine(tiny_text_model)
    prefetch, fired = engine.prefix_cache.prefetch, []

    def prefetch_then_fail(*args, **kwargs):
        queued = prefetch(*args, **kwargs)
        if queued and len(fired) < 3:
            fired.append(queued)
            raise RuntimeError("injected: the tier window failed after queuing its loads")
        return queued

    engine.prefix_cache.prefetch = prefetch_then_fail
    got = {}
    for specs in rounds:
        got.update(run_workload(engine, specs, arrive_per_step=6, step_errors=(RuntimeError,)))
    assert len(fired) == 3
    assert got == want
    assert_kv_conserved(engine)
    engine.close()


def test_abort_during_a_load_then_reuse_and_close(tiny_text_model):
    """A request whose prefix is being loaded back is aborted after its first step: the loaded
    prefix stays cached (on the GPU), every slot is accounted for, a later request reuses it
    with exact outputs; reset empties both tiers; close() lets the host pool go."""
    import gc
    import weakref
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = [random.Random(7).randrange(3, 1000) for _ in range(150)]
    follow_up = prompt + list(range(40, 60))
    want = run_workload(make_engine(tiny_text_model), [Spec("ref", follow_up, greedy)])["ref"]
    engine = make_engine(tiny_text_model, max_total_tokens=300, host_kv_cache_gb=0.01)
    run_workload(engine, [Spec("first", prompt, greedy)])
    tree = engine.prefix_cache.tree
    tree.evict(tree.evictable_tokens)  # all of it to the host tier
    assert tree.host_tokens >= 150 and engine.kv_slots.num_free == engine.kv_slots.count
    engine.add_request(follow_up, greedy, request_id="aborted")
    engine.step()  # admitted: the load and the forward reading it are queued
    assert engine.stats()["host_cache_hit_tokens"] == 150
    engine.abort("aborted")
    while engine.has_unfinished():
        engine.step()
    assert engine.output("aborted").num_cached_tokens == 150  # usage's cached_tokens counts host hits
    engine.release("aborted")
    assert_kv_conserved(engine)
    again = run_workload(engine, [Spec("again", follow_up, greedy)])["again"]
    assert again == want
    assert engine.stats()["host_cache_hit_tokens"] == 150  # the second one hit the GPU copy
    assert engine.stats()["prefix_cache_hit_tokens"] >= 300
    engine.reset_prefix_cache()
    host = engine.kv_tier.host
    assert host.host_slots.num_free == host.host_slots.count and engine.stats()["host_cache_tokens"] == 0
    pool = weakref.ref(host.data)
    del host, tree  # the test's own references
    engine.close()
    gc.collect()
    assert pool() is None, "close() must let the host pool's memory go"


def test_admissions_beside_leaving_requests_change_no_output(tiny_text_model):
    """Multi-turn chats at a running limit of 3 through a small pool and a host tier, with
    aborts: admitting a prompt in place of a request whose last sample is launched (the
    default) plans more prefill steps in the wait than admitting after its finish, gives the
    same tokens, and every request slot, GPU and host slot comes back."""
    from tandem.config import Experiments
    rounds = chat_specs(conversations=8, turns=3, seed=7)
    runs, ahead = {}, {}
    for beside in (True, False):
        engine = small_tiered_engine(tiny_text_model, max_running_requests=3,
                                     experiments=Experiments(admit_beside_leaving=beside))
        runs[beside] = run_chats(engine, rounds)
        s = engine.stats()
        ahead[beside] = s["steps_planned_ahead"]
        assert_tiers_conserved(engine, s)
        assert engine.req_slots.num_free == engine.num_request_slots
        engine.close()
    assert runs[True] == runs[False]
    assert ahead[True] > ahead[False], ahead


@pytest.mark.parametrize("overlap", [True, False])
def test_prefill_steps_planned_ahead_change_no_output(tiny_text_model, overlap):
    """Multi-turn chats through a small pool and a host tier, with aborts: planning each
    prefill step in the wait for the step before its decode (the default), and staging its
    inputs there too, give the tokens of planning and staging it when due, and every GPU and
    host slot comes back. Without overlap there is no wait to plan in."""
    from tandem.config import Experiments
    rounds = chat_specs(conversations=6, turns=3, seed=5)
    runs = {}
    for plan, stage in ((True, True), (True, False), (False, False)):
        engine = small_tiered_engine(tiny_text_model, disable_overlap=not overlap, timeline=True,
                                     experiments=Experiments(plan_prefill_ahead=plan, stage_prefill_ahead=stage))
        runs[plan, stage] = run_chats(engine, rounds)
        s = engine.stats()
        assert (s["steps_planned_ahead"] > 0) == (plan and overlap), s["steps_planned_ahead"]
        assert (s["steps_staged_ahead"] > 0) == (stage and overlap), s["steps_staged_ahead"]
        assert s["steps_staged_ahead"] <= s["steps_planned_ahead"]  # an aborted plan's staging is dropped
        staged = [r for r in engine.timeline.records if r.stage_ahead_ms is not None]
        assert len(staged) == s["steps_staged_ahead"] and all(r.plan_ahead_ms is not None for r in staged)
        assert_tiers_conserved(engine, s)
        engine.close()
    assert runs[True, True] == runs[True, False] == runs[False, False]
