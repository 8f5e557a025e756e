"""The built-in model through tandem equals transformers' own GGUF loading of it."""
import pytest
import torch
import transformers

from tandem import LLM, SamplingParams
from tandem.models.checkpoint import builtin_model_path


@pytest.mark.slow
def test_greedy_text_matches_transformers_for_32_tokens():
    path = builtin_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    llm = LLM(device="cpu", dtype="float32")
    prompt = "Once upon a time"
    ids = llm.tokenizer.encode(prompt)
    assert ids == [6403, 1980, 253, 655]
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.token_ids == ref
    assert out.text == llm.tokenizer.decode(ref, skip_special_tokens=True)
    assert out.text.startswith(", the city of Nova Haven was a thriving metropolis")
