"""Warm start: the start-up warm-up leaves no trace but compiled kernels."""
import pytest

from tandem import LLM, SamplingParams
from tandem.warmup import warm_up_lengths
from tiny_models import TEST_DEVICE
from workload import assert_kv_conserved


def test_warm_up_lengths_cover_triton_integer_classes():
    lengths = warm_up_lengths(8192, 4096)
    assert {1, 16, 17, 4099} <= set(lengths)  # one, a multiple of 16, neither, a chunked prompt
    assert max(warm_up_lengths(200, 4096)) <= 196


def test_warm_up_leaves_no_state_and_changes_no_token(tiny_text_model):
    prompts = [[5, 6, 7, 8], list(range(10, 60))]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    cold = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", max_model_len=256, warm_up="off")
    warm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", max_model_len=256, warm_up="on",
               timeline=True)
    engine = warm.engine
    assert engine.warm_up_s > 0 and cold.engine.warm_up_s == 0
    s = engine.stats()
    assert s["prefix_cache_tokens"] == 0 and s["prefix_cache_queried_tokens"] == 0
    assert s["num_preemptions"] == 0 and s["steps_planned_ahead"] == 0 and s["steps_staged_ahead"] == 0
    assert engine.requests == {} and len(engine.timeline.records) == 0
    assert_kv_conserved(engine)
    assert [o.token_ids for o in warm.generate(prompts, greedy, use_tqdm=False)] == \
        [o.token_ids for o in cold.generate(prompts, greedy, use_tqdm=False)]


def test_bad_warm_up_mode_is_refused(tiny_text_model):
    with pytest.raises(ValueError, match="warm_up must be auto, on or off"):
        LLM(str(tiny_text_model), device=TEST_DEVICE, warm_up="yes")


def test_the_warm_up_cascade_step_is_not_counted(tiny_text_model):
    """With cascade attention forced on, the warm-up runs a grouped step: stats start at zero."""
    from tandem.config import Experiments
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", max_model_len=256, warm_up="on",
              experiments=Experiments(cascade_attention="on"))
    s = llm.engine.stats()
    assert s["cascade_steps"] == s["cascade_rows"] == 0
    llm.close()


def test_a_kernel_built_after_the_warm_up_is_counted_and_said(tiny_text_model, caplog):
    """Triton's build hooks (called by its launcher on a cache miss; the CPU's interpreter
    builds nothing, so the hooks are called here as the launcher calls them): a build after the
    warm-up is counted in stats and logged; after close() the hooks are Triton's own again."""
    knobs = pytest.importorskip("triton.knobs")
    before = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", max_model_len=256, warm_up="on")
    cold = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", max_model_len=256, warm_up="off")
    assert llm.engine.stats()["kernel_builds_while_serving"] == 0
    knobs.runtime.jit_cache_hook()
    knobs.runtime.jit_post_compile_hook(fn=type("F", (), {"name": "tandem.kernels.x._extend_attention"})())
    assert llm.engine.stats()["kernel_builds_while_serving"] == 1
    assert cold.engine.stats()["kernel_builds_while_serving"] == 0  # no warm-up: builds are expected
    assert "built kernel _extend_attention while serving" in caplog.text
    llm.close()
    cold.close()
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before


def test_the_warm_up_runs_prefill_steps_just_past_the_largest_prefill_graph():
    from tandem.warmup import eager_prefill_steps
    steps = eager_prefill_steps(6656, 8192, 4096, 256)
    assert [sum(s) for s in steps] == [6672, 6673] and all(max(s) <= 4096 for s in steps)
    assert [sum(s) for s in eager_prefill_steps(6656, 6672, 4096, 256)] == [6672]  # the budget caps it
    assert eager_prefill_steps(8192, 8192, 4096, 256) == []  # graphs cover the budget: nothing eager
    assert [len(s) for s in eager_prefill_steps(2048, 8192, 252, 256)] == [9, 9]  # short model: more prompts
    assert eager_prefill_steps(2048, 8192, 252, 8) == []  # more prompts than one step holds


def test_the_warm_up_runs_its_eager_prefill_steps_and_leaves_no_state(tiny_text_model):
    """Prefill graphs up to 256 tokens (run as their fixed-shape work on the CPU): the warm-up's
    steps include one of 272 and one of 273 tokens past them, eager, and leave nothing behind."""
    from tandem.engine import Engine
    from tandem.config import EngineConfig, Experiments
    from tandem.warmup import warm_up
    from test_prefill_graphs import _with_prefill_graphs
    # On CUDA the engine captures its own graphs: capped at 256 tokens, as on the CPU.
    engine = Engine(EngineConfig(model=str(tiny_text_model), device=TEST_DEVICE, dtype="float32", max_model_len=256,
                                 attention_backend="triton", warm_up="off",
                                 experiments=Experiments(prefill_graph_max_tokens=256)))
    graphs = _with_prefill_graphs(engine)
    assert graphs.buckets[-1].tokens == 256
    launched, launch = [], engine.runner.launch
    engine.runner.launch = lambda batch, **kw: launched.append(batch) or launch(batch, **kw)
    warm_up(engine)
    prefill_tokens = {b.num_tokens for b in launched if b.has_prefill}
    assert {272, 273} <= prefill_tokens and graphs.replays > 0
    assert engine.requests == {} and engine.stats()["prefix_cache_tokens"] == 0
    assert_kv_conserved(engine)
    engine.close()
