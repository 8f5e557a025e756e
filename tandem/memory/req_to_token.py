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

    def write_prefixes_on_device(self, req_slots: torch.Tensor, lengths: torch.Tensor,
                                 locs: torch.Tensor, total: int) -> None:
        """table[req_slots[i], 0:lengths[i]] = the next lengths[i] entries of `locs`: rows that
        reuse cached prefixes. `total` (the host's sum of lengths) sizes the expansion, so
        nothing waits for a device value."""
        rows = torch.repeat_interleave(req_slots, lengths, output_size=total)
        starts = torch.cumsum(lengths, 0) - lengths
        positions = torch.arange(total, device=locs.device) - torch.repeat_interleave(
            starts, lengths, output_size=total)
        self.table[rows, positions] = locs.to(torch.int32)
