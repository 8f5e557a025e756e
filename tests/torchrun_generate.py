"""One torchrun rank of a two-rank tensor-parallel LLM (test_torchrun.py): ranks > 0 serve
inside `LLM(...)` and end there; rank 0 writes its greedy tokens as JSON to argv[2]."""
import json
import sys

from tandem import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [200, 3, 17]]
OPTS = dict(device="cpu", dtype="float32", max_total_tokens=4096, max_running_requests=16)

if __name__ == "__main__":
    with LLM(sys.argv[1], tensor_parallel_size=2, **OPTS) as llm:  # rank > 0 ends the process here
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    with open(sys.argv[2], "w") as f:
        json.dump([o.token_ids for o in outs], f)
