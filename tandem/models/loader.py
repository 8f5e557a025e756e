"""Build a DecoderModel on its device and fill it from a checkpoint (or randomly)."""
from typing import Iterator

import torch

from tandem.config import ModelConfig
from tandem.distributed.group import SINGLE, TPGroup
from tandem.models.checkpoint import Checkpoint
from tandem.models.decoder import DecoderModel, hf_pieces


def load_model(ckpt: Checkpoint, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int, dummy_weights: bool, tp: TPGroup = SINGLE) -> DecoderModel:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DecoderModel(cfg, max_positions, tp)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        model.load_weights(_random_tensors(cfg, dtype, device) if dummy_weights else ckpt.tensor_slices())
    model.eval().requires_grad_(False)
    return model


def _random_tensors(cfg: ModelConfig, dtype: torch.dtype, device: torch.device
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Small random weights of the unsharded model, one full tensor at a time in parameter
    order (logits stay finite and varied, norms stay at one): every rank draws the same
    numbers and keeps its slice, so a sharded model equals the unsharded one."""
    with torch.device("meta"):
        full = DecoderModel(cfg, 1)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in full.named_parameters():
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if "norm" in name:
            t.fill_(1.0)
        elif name.endswith("bias"):
            t.zero_()
        else:
            t.normal_(0.0, 0.02, generator=gen)
        yield from hf_pieces(name, t, cfg)
