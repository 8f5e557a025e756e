"""`tandem bench truncated-draft`: a draft model cut from a checkpoint, its first N layers.

The figures of draft-model speculation need a draft with the target's tokenizer; where no
trained small sibling is at hand (the H200 carries only the built-in model), the target's
own first layers with its final norm and head make one: an early-exit draft, untrained for
the job, so its acceptance is a floor. Written as an HF directory (config.json with
num_hidden_layers = N, model.safetensors, the tokenizer) that `speculative_config={"model":
DIR}` loads.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from tandem.models.checkpoint import builtin_model_path, open_checkpoint

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def write_truncated(model: str | None, layers: int, out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    ckpt = open_checkpoint(model if model is not None else builtin_model_path())
    total = int(ckpt.config["num_hidden_layers"])
    if not 1 <= layers <= total:
        raise ValueError(f"--layers must be in [1, {total}], got {layers}")
    kept = {}
    for name, tensor in ckpt.tensors():
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) < layers:
            kept[name] = tensor.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    # The loaded (dequantized) tensors, in one dtype (bf16 keeps the file small).
    save_file({n: t.to(dtype) for n, t in kept.items()}, out / "model.safetensors")
    config = {**ckpt.config, "num_hidden_layers": layers, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=1, default=str))
    tokenizer = ckpt.load_tokenizer()
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tandem bench truncated-draft", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the checkpoint to cut (default: the built-in SmolLM2-135M-Instruct)")
    ap.add_argument("--layers", type=int, required=True, help="decoder layers kept, from the first")
    ap.add_argument("--out", required=True, help="the HF directory to write")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args(argv)
    path = write_truncated(args.model, args.layers, Path(args.out), getattr(torch, args.dtype))
    print(f"wrote {path} ({args.layers} layers)")


if __name__ == "__main__":
    main()
