"""Sampling: the validated per-request `SamplingParams` and the batched device sampler.

The split matters for the overlap loop: everything that decides *which* kernels
run (greedy only? any top-k? penalties?) is computed on the host from the
params at schedule time (`SamplingInputs.build`). `Sampler.sample` then only
queues device work; it never reads a device value, so the CPU can stay one
step ahead.

Randomness is counter-based: the noise for token v of a row is a hash of
(seed, output_index, v), so a request's draws do not depend on which other
requests share its batch, on its row, or on any global generator, and the
overlap and plain loops produce the same tokens.
"""
from tandem.sampling.inputs import SampleOutput, SamplingInputs, seed_to_int64
from tandem.sampling.noise import (
    _mix32,
    gumbel_argmax,
    gumbel_argmax_torch,
    gumbel_argmax_triton,
    gumbel_kernel,
    gumbel_noise,
    row_keys,
    row_keys_host,
    seed_key,
)
from tandem.sampling.params import MAX_LOGPROBS, SamplingParams
from tandem.sampling.sampler import Sampler

__all__ = ["MAX_LOGPROBS", "SampleOutput", "Sampler", "SamplingInputs", "SamplingParams",
           "gumbel_argmax", "gumbel_argmax_torch", "gumbel_argmax_triton", "gumbel_kernel", "gumbel_noise",
           "row_keys", "row_keys_host", "seed_key", "seed_to_int64", "_mix32"]
