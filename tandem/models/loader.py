"""Build a DecoderModel on its device and fill it from a checkpoint (or randomly)."""
import torch

from tandem.config import ModelConfig
from tandem.models.checkpoint import Checkpoint
from tandem.models.decoder import DecoderModel


def load_model(ckpt: Checkpoint, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int, dummy_weights: bool) -> DecoderModel:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DecoderModel(cfg, max_positions)
    finally:
        torch.set_default_dtype(previous)
    if dummy_weights:
        _random_init(model)
    else:
        with torch.no_grad():
            model.load_weights(ckpt.tensors())
    model.eval().requires_grad_(False)
    return model


@torch.no_grad()
def _random_init(model: DecoderModel) -> None:
    """Small random weights: logits stay finite and varied, norms stay at one."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
