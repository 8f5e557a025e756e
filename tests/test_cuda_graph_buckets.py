"""The decode graph buckets: every decode batch up to the captured maximum replays a graph."""
import pytest

from tandem.config import EngineConfig
from tandem.cuda_graph import default_buckets


def test_buckets_fine_up_to_256_then_every_32():
    buckets = default_buckets(512)
    assert buckets[:5] == [1, 2, 4, 8, 16]
    assert [b for b in buckets if 16 <= b <= 256] == list(range(16, 257, 16))
    assert [b for b in buckets if b > 256] == list(range(288, 513, 32))


@pytest.mark.parametrize("max_batch", [1, 3, 16, 100, 256, 300, 512, 777])
def test_every_batch_up_to_the_maximum_has_a_bucket(max_batch):
    buckets = default_buckets(max_batch)
    assert buckets[-1] == max_batch
    assert buckets == sorted(set(buckets))
    for rows in range(1, max_batch + 1):
        bucket = next(b for b in buckets if b >= rows)
        # Padding past 16 rows stays within one step of the grid (16 up to 256, then 32).
        assert bucket - rows < (16 if rows <= 256 else 32)


def test_default_captures_512_rows_when_512_run():
    cfg = EngineConfig(model="x")
    assert cfg.cuda_graph_max_batch == 512
    # The running limit caps it (Engine._graph_buckets): 256 running capture 256.
    assert default_buckets(min(cfg.cuda_graph_max_batch, 256))[-1] == 256
