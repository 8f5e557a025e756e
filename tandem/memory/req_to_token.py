"""The request -> token table: row r lists the KV slots of request r's tokens in order."""
import torch


class ReqToTokenTable:
    """A device table [max_reqs + 1, max_context] int32.

    Row 0 is the padding row. The host owns the truth (each request's `kv_slots`); rows are
    updated on the device with the forward batch's own `out_cache_loc` (a device scatter, see
    `write_on_device`)."""

    def __init__(self, max_reqs: int, max_context: int, device: torch.device):
        self.max_context = max_context
        self.table = torch.zeros((max_reqs + 1, max_context), dtype=torch.int32, device=device)

    def write_on_device(self, req_slots: torch.Tensor, positions: torch.Tensor,
                        locs: torch.Tensor) -> None:
        """table[req_slot, position] = loc for every new token (device scatter, stream-ordered
        before the attention that reads the table)."""
        self.table[req_slots, positions] = locs.to(torch.int32)
