"""Host arithmetic for kernel grids and block sizes.

Triton's own `triton.cdiv` and `triton.next_power_of_2` are constexpr functions in the Tritons
tandem runs on, and a host call of one costs microseconds (~4 us on the CPU with Triton 3.9);
an eager step computes a few per launch, ~5 launches a decoder layer. Measured on the H200
(session 22, docs/benchmarks.md): with these and the norm's flat path, an eager prefill step
of the Qwen3-0.6B shape launched ~0.8 ms faster (TTFT 0.93-0.94x, warm process).
"""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, as `triton.cdiv`."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as `triton.next_power_of_2`."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
