"""Logits and greedy tokens of each family match transformers on tiny random configs."""
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.attention import TorchAttention
from tandem.config import ModelConfig
from tandem.forward_batch import ForwardBatch
from tandem.memory.kv_cache import KVCache
from tandem.models.checkpoint import open_checkpoint
from tandem.models.loader import load_model
from tiny_models import VARIANTS, load_hf, make_tiny_model

DECODE_STEPS = 8


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


def _forward(model, kv, table, slot, start, ids):
    """One request's new tokens through our model with the torch backend; returns last logits."""
    n = len(ids)
    locs = torch.arange(1 + start, 1 + start + n)  # slot 0 is the dummy slot
    table[slot, start:start + n] = locs.to(torch.int32)
    fb = ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(start, start + n), out_cache_loc=locs,
        req_slots=torch.tensor([slot]), seq_lens=torch.tensor([start + n]),
        prefix_lens=torch.tensor([start]), qo_indptr=torch.tensor([0, n]), req_to_token=table,
        host_req_slots=[slot], host_seq_lens=[start + n], host_extend_lens=[n],
        is_decode=n == 1, max_seq_len=start + n)
    return model.compute_logits(model(fb, kv, TorchAttention())[-1:])[0]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_greedy_match_transformers(tiny_root, variant):
    path = make_tiny_model(tiny_root, variant)
    ckpt = open_checkpoint(path)
    cfg = ModelConfig.from_hf(ckpt.config)
    ours = load_model(ckpt, cfg, torch.float32, torch.device("cpu"), 512, dummy_weights=False)
    hf = load_hf(path)
    kv = KVCache(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    table = torch.zeros(2, 64, dtype=torch.int32)
    prompt = [5, 17, 99, 3, 42, 250, 7, 64, 128, 9, 33]
    seq = list(prompt)
    with torch.no_grad():
        logits = _forward(ours, kv, table, 1, 0, prompt)
        for step in range(DECODE_STEPS + 1):
            ref = hf(torch.tensor([seq])).logits[0, -1]
            assert _rel_err(logits, ref) <= 1e-4, f"step {step}"
            token = int(ref.argmax())
            assert int(logits.argmax()) == token
            seq.append(token)
            logits = _forward(ours, kv, table, 1, len(seq) - 1, [token])


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_engine_greedy_equals_transformers_generate(tiny_root, variant):
    path = make_tiny_model(tiny_root, variant, seed=1)
    hf = load_hf(path)
    prompts = [[5, 17, 99, 3], [42, 250, 7, 64, 128, 9, 33, 1, 77]]
    llm = LLM(str(path), device="cpu")
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref


def test_unsupported_architecture_is_refused(tiny_root):
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})
