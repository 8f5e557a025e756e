"""Issue-2 figure: built-in model, bf16, on the CPU: 32 prompts x 128 new tokens through
tandem's LLM.generate and through transformers' batched generate, in one run.

    PYTHONPATH=. python bench/cpu_vs_transformers.py [--dtype bfloat16] [--prompts 32] [--new 128]
"""
import argparse
import time

import torch
import transformers

from tandem import LLM, SamplingParams
from tandem.models.checkpoint import builtin_model_path

PROMPTS = ["Once upon a time", "The capital of France is", "Write a haiku about the sea.",
           "Explain photosynthesis to a child.", "List three prime numbers:", "def fibonacci(n):",
           "The best way to learn a language is", "In 1969, astronauts"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} (#{i})" for i in range(args.prompts)]
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}")

    llm = LLM(dtype=args.dtype, device="cpu")
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    tandem_s = time.perf_counter() - t
    tandem_tokens = sum(len(o.token_ids) for o in outs)

    path = builtin_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    batch = tok(prompts, return_tensors="pt", padding=True)
    model.generate(**tok(prompts[:2], return_tensors="pt", padding=True), max_new_tokens=4)  # warm-up
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
    hf_s = time.perf_counter() - t
    hf_tokens = (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)

    print("| engine | new tokens | seconds | tok/s |\n|---|---:|---:|---:|")
    print(f"| tandem LLM.generate | {tandem_tokens} | {tandem_s:.1f} | {tandem_tokens / tandem_s:.1f} |")
    print(f"| transformers generate (batched) | {hf_tokens} | {hf_s:.1f} | {hf_tokens / hf_s:.1f} |")
    print(f"ratio tandem / transformers: {(tandem_tokens / tandem_s) / (hf_tokens / hf_s):.2f}")


if __name__ == "__main__":
    main()
