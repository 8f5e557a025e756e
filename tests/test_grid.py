"""Host grid arithmetic (`tandem.kernels.grid`) equals Triton's, which it replaces on the
launch path (Triton's are constexpr functions, microseconds a host call)."""
import pytest

from tandem.kernels.grid import cdiv, next_power_of_2


def test_host_grid_arithmetic_matches_triton():
    triton = pytest.importorskip("triton")
    assert all(next_power_of_2(n) == triton.next_power_of_2(n) for n in range(0, 5000))
    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 300) for b in range(1, 40))
