"""GPU checks of the grammar mask path (run on the H200 through the device tool)."""
import json

import jsonschema
import pytest
import torch

from tandem import LLM, SamplingParams
from workload import step_without_host_syncs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}


def test_grammar_path_adds_no_host_sync(tiny_text_model):
    """Under sync-debug "error" the constrained loop (mask fill, pinned H2D on the schedule
    stream, the forward stream's wait on the mask event, masked sampling in graph and eager
    decode, mixed with unconstrained rows) raises on any implicit host sync; the mask adds
    only a device-side wait."""
    llm = LLM(str(tiny_text_model), device="cuda", dtype="float32", enable_mixed_batch=True,
              chunked_prefill_size=16)
    engine = llm.engine
    assert engine.runner.graphs is not None
    warm = [SamplingParams(max_tokens=8, temperature=0.8, json_schema=SCHEMA),
            SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, logprobs=2, ignore_eos=True)]
    llm.generate([[5, 6, 7, 8] * 10] * 2, warm, use_tqdm=False)  # compile, allocate the rings
    for i in range(16):
        p = (SamplingParams(max_tokens=40, temperature=0.8 * (i % 2), seed=i, json_schema=SCHEMA,
                            logprobs=1, presence_penalty=0.5) if i % 4 else
             SamplingParams(max_tokens=24, temperature=0.8, top_k=20, ignore_eos=True))
        engine.add_request([5 + i, 6, 7, 8] * (3 + i), p, request_id=f"g{i}")
    while engine.grammar.compiling:  # compiled off the loop; keep compilation out of the guard
        engine.grammar.compiling[0][1].result()
        engine.step()
    step_without_host_syncs(engine)
    assert engine.grammar.masked_steps > 0
    for i in range(16):
        out = engine.output(f"g{i}")
        if i % 4:
            assert out.finish_reason == "stop"
            jsonschema.validate(json.loads(out.text), SCHEMA)
        else:
            assert len(out.token_ids) == 24


def test_graph_and_eager_constrained_decode_agree(tiny_text_model):
    prompts = [[5 + i, 6, 7] * (2 + i) for i in range(12)]
    params = [SamplingParams(max_tokens=40, temperature=0.9, seed=i, json_schema=SCHEMA) for i in range(12)]
    runs = []
    for graph in ("on", "off"):
        llm = LLM(str(tiny_text_model), device="cuda", dtype="float32", cuda_graph=graph)
        runs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]
