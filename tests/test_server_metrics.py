"""`/metrics` counters from the engine's running totals: each update adds the growth since the
last one; after an engine restart (totals back to 0) nothing is lost or subtracted."""
from prometheus_client import generate_latest

from tandem.server.metrics import Metrics
from tandem.server.protocol import Stats


def _values(metrics: Metrics) -> dict[str, float]:
    out = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _stats(queried: int, hits: int, drafts: int, per_pos: list[int]) -> Stats:
    return Stats(0, 0, 0.0, prefix_cache_queried_tokens=queried, prefix_cache_hit_tokens=hits,
                 spec_decode_num_drafts=drafts, spec_decode_num_draft_tokens=4 * drafts,
                 spec_decode_num_accepted_tokens=sum(per_pos), spec_decode_num_accepted_tokens_per_pos=per_pos)


def test_counters_add_the_totals_growth_across_an_engine_restart():
    m = Metrics()
    m.set_stats(_stats(100, 40, 10, [6]))
    m.set_stats(_stats(150, 70, 12, [8, 3]))  # a position appears
    m.set_stats(_stats(20, 5, 1, [1]))  # the engine restarted: its totals start from 0 again
    m.set_stats(_stats(50, 25, 3, [2, 1]))
    v = _values(m)
    assert v["tandem_prefix_cache_queries_total"] == 150 + 30
    assert v["tandem_prefix_cache_hits_total"] == 70 + 20
    assert v["tandem_spec_decode_num_drafts_total"] == 12 + 2
    assert v["tandem_spec_decode_num_draft_tokens_total"] == 48 + 8
    assert v["tandem_spec_decode_num_accepted_tokens_total"] == 11 + 2
    assert v['tandem_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == 8 + 1
    assert v['tandem_spec_decode_num_accepted_tokens_per_pos_total{position="1"}'] == 3 + 1


def test_host_tier_figures_reach_metrics():
    m = Metrics()
    m.set_stats(Stats(0, 0, 0.0, host_cache_hit_tokens=30, host_cache_tokens=500, host_load_bytes=3000,
                      host_load_seconds=0.5, host_write_back_bytes=7000, host_write_back_seconds=1.0))
    m.set_stats(Stats(0, 0, 0.0, host_cache_hit_tokens=40, host_cache_tokens=200, host_load_bytes=4000,
                      host_load_seconds=0.75, host_write_back_bytes=7000, host_write_back_seconds=1.0))
    v = _values(m)
    assert v["tandem_host_cache_hits_total"] == 40 and v["tandem_host_cache_tokens"] == 200
    assert v['tandem_host_kv_copy_bytes_total{direction="load"}'] == 4000
    assert v['tandem_host_kv_copy_bytes_total{direction="write_back"}'] == 7000
    assert v['tandem_host_kv_copy_seconds_total{direction="load"}'] == 0.75
