"""H200 checks of the memory budget and of close() (run through the device tool):

    TANDEM_TEST_DEVICE=cuda python -m pytest -q -s tests/test_gpu_memory.py -p no:cacheprovider

Each test prints its figures (a line starting with "memory:") for docs/benchmarks.md.
"""
import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.bench.presets import preset_dir
from tandem.memory.kv_cache import KVCache

pytestmark = [pytest.mark.gpu, pytest.mark.whole_gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GiB = 2**30


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _short_workload(llm: LLM, n: int = 64) -> None:
    """The standard workload's shape (input and output uniform in [100, 1024], ignore EOS), fewer requests."""
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(100, 1024), temperature=0, ignore_eos=True) for _ in range(n)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]


@pytest.fixture(scope="module")
def qwen3():
    return preset_dir("qwen3-0.6b")


def test_close_gives_memory_back_and_a_second_engine_gets_the_same_pool(qwen3):
    torch.zeros(1, device="cuda")  # the CUDA context is not the engine's
    torch.cuda.empty_cache()
    allocated, used = torch.cuda.memory_allocated(), _used()
    llm = LLM(qwen3, device="cuda", dummy_weights=True)
    first = llm.engine.kv_slots.count
    print("\nmemory: first engine", llm.engine.stats()["memory"], "KV tokens", first)
    _short_workload(llm, 16)
    llm.close()
    del llm
    print(f"memory: after close allocated +{(torch.cuda.memory_allocated() - allocated) / GiB:.3f} GiB, "
          f"device used +{(_used() - used) / GiB:.3f} GiB")
    assert torch.cuda.memory_allocated() - allocated < GiB
    assert _used() - used < GiB
    with LLM(qwen3, device="cuda", dummy_weights=True) as again:
        second = again.engine.kv_slots.count
        print("memory: second engine KV tokens", second)
        assert abs(second - first) <= 0.01 * first


def test_pool_is_sized_around_40_gib_held_elsewhere(qwen3):
    with LLM(qwen3, device="cuda", dummy_weights=True) as llm:
        alone = llm.engine.kv_slots.count
    mc = llm.engine.model_config
    per_token = KVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, llm.engine.dtype)
    held = torch.empty(40 * GiB, dtype=torch.uint8, device="cuda")
    try:
        with LLM(qwen3, device="cuda", dummy_weights=True) as llm:
            beside = llm.engine.kv_slots.count
            print("\nmemory: beside 40 GiB", llm.engine.stats()["memory"], "KV tokens", beside, "alone", alone)
            # The pool shrinks by what is held, within the profiling noise.
            assert abs((alone - beside) * per_token - 40 * GiB) < 0.5 * GiB
            _short_workload(llm)  # no OOM at the pool's size
    finally:
        del held
