"""Experiments.fused_rope_attention in the engine: greedy tokens identical with the experiment on
and off. On the CPU the engine runs the Triton backend in the interpreter (attention_backend=
"triton"), so the decode kernel with RoPE, q/k norm and the K/V store inside is what runs."""
import random

import pytest

from tandem.config import EngineConfig, Experiments
from tandem.engine import Engine
from tandem.sampling import SamplingParams
from tiny_models import TEST_DEVICE, make_tiny_model
from workload import Spec, assert_kv_conserved, run_workload

pytest.importorskip("triton")


def _specs(seed: int) -> list[Spec]:
    rng = random.Random(seed)
    return [Spec(f"r{i}", [rng.randrange(3, 1000) for _ in range(rng.randint(3, 40))],
                 SamplingParams(max_tokens=rng.randint(6, 12), temperature=0.0, ignore_eos=True))
            for i in range(4)]


@pytest.mark.parametrize("variant", ["qwen3", "llama"])  # q/k norm and 2 KV heads; none, and 4 KV heads
def test_fused_rope_attention_same_greedy_tokens(tmp_path, builtin_tokenizer, monkeypatch, variant):
    from tandem.attention.triton_backend import TritonAttention
    path = make_tiny_model(tmp_path, variant, vocab_size=len(builtin_tokenizer), eos_token_id=2, hidden_size=64,
                           intermediate_size=128)
    builtin_tokenizer.save_pretrained(path)
    fused_calls = []
    forward_unrotated = TritonAttention.forward_unrotated

    def counted(self, u, *args, **kwargs):
        fused_calls.append(self.rope_in_attention(args[2]))
        return forward_unrotated(self, u, *args, **kwargs)

    monkeypatch.setattr(TritonAttention, "forward_unrotated", counted)
    runs = {}
    for on in (False, True):
        engine = Engine(EngineConfig(model=str(path), device=TEST_DEVICE, dtype="float32", attention_backend="triton",
                                     experiments=Experiments(fused_rope_attention=on)))
        assert engine.backend.fused_rope_attention == on
        runs[on] = run_workload(engine, _specs(5), arrive_per_step=64)
        assert_kv_conserved(engine)
        if not on:
            assert not fused_calls, "the experiment off never hands the backend unrotated rows"
    assert runs[True] == runs[False]
    assert len(fused_calls) > 10 and all(fused_calls)  # every decode step's layers took the fused path
