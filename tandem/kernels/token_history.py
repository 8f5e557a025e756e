"""Append each plain step's sampled token to its request's device history in one launch.

Speculative decoding keeps every request's tokens on the device (`SpecState.history`, read by
the n-gram search) and their count (`SpecState.length`). A plain decode step of a speculating
engine appends one token a row. As torch ops that was a gather, two adds, a cast and two
indexed stores: ~6 launches and ~0.1 ms of host time a step (H200, session 15), enough to make
a 135M model's decode steps host-bound. Here one program per row stores the token after the
row's input position and the new length.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _append_sampled_kernel(History, stride_h, Length, Slots, InputPositions, Tokens):
    i = tl.program_id(0)
    slot = tl.load(Slots + i).to(tl.int64)
    at = tl.load(InputPositions + i).to(tl.int64) + 1  # the sampled token follows its input
    token = tl.load(Tokens + i)
    tl.store(History + slot * stride_h + at, token.to(History.dtype.element_ty))
    tl.store(Length + slot, (at + 1).to(Length.dtype.element_ty))


def append_sampled(history: torch.Tensor, length: torch.Tensor, slots: torch.Tensor,
                   input_positions: torch.Tensor, tokens: torch.Tensor) -> None:
    """history[slots, input_positions + 1] = tokens; length[slots] = input_positions + 2.
    Rows have distinct slots; fixed shapes and no host read (graph-capturable)."""
    n = slots.shape[0]
    assert input_positions.shape == (n,) and tokens.shape == (n,) and history.stride(1) == 1
    if n == 0:
        return
    _append_sampled_kernel[(n,)](history, history.stride(0), length, slots, input_positions, tokens, num_warps=1)
