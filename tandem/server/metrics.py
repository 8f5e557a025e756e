"""Prometheus metrics of one server, in a registry of its own (no process-global collectors)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tandem.server.protocol import Stats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    def __init__(self, replicas: int = 1) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("tandem_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("tandem_requests_waiting", "Requests in the waiting queue", registry=r)
        self.host_ms = Gauge("tandem_host_ms_per_step", "Mean host time per engine step outside the "
                             "one completion wait, recent steps", registry=r)
        self.gpu_busy = Gauge("tandem_gpu_busy_fraction", "Forward time / (forward time + device gaps "
                              "between forwards), recent steps (CUDA)", registry=r)
        self.cpu_lead = Gauge("tandem_cpu_lead_ms", "How far ahead of the GPU the host queued each "
                              "step, recent steps (CUDA)", registry=r)
        self.engine_up = Gauge("tandem_engine_up", "1 while the engine process serves, 0 once it is gone",
                               registry=r)
        self.engine_restarts = Counter("tandem_engine_restarts", "Engine processes started again after "
                                       "one died (--restart-engine)", registry=r)
        self.kv_cache_usage = Gauge("tandem_kv_cache_usage", "Fraction of KV cache slots in use (0..1)",
                                    registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of accepted requests",
                                     registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter("tandem_requests_finished", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.cache_queries = Counter("tandem_prefix_cache_queries", "Prompt tokens looked up in the "
                                     "prefix cache", registry=r)
        self.cache_hits = Counter("tandem_prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                  registry=r)
        self.cache_tokens = Gauge("tandem_prefix_cache_tokens", "KV slots held only by the prefix cache "
                                  "(evictable)", registry=r)
        self.host_hits = Counter("tandem_host_cache_hits", "Prompt tokens admissions read from loads "
                                 "out of the prefix cache's host tier", registry=r)
        self.host_tokens = Gauge("tandem_host_cache_tokens", "Tokens the prefix cache's host tier holds",
                                 registry=r)
        self.host_copy_bytes = Counter("tandem_host_kv_copy_bytes", "Bytes copied between the KV pool and "
                                       "its host tier", ["direction"], registry=r)
        self.host_copy_seconds = Counter("tandem_host_kv_copy_seconds", "Device time of completed copies "
                                         "between the KV pool and its host tier", ["direction"], registry=r)
        self._seen_totals: dict[str, tuple] = {}  # the engine's running totals last seen (see _add_deltas)
        self.spec_drafts = Counter("tandem_spec_decode_num_drafts", "Verify rows that carried proposals "
                                   "(speculative decoding)", registry=r)
        self.spec_draft_tokens = Counter("tandem_spec_decode_num_draft_tokens", "Proposed tokens verified",
                                         registry=r)
        self.spec_accepted = Counter("tandem_spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                                     registry=r)
        self.spec_accepted_pos = Counter("tandem_spec_decode_num_accepted_tokens_per_pos", "Verify rows "
                                         "that accepted the proposal at each position", ["position"], registry=r)
        self.e2e = Histogram("tandem_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self._replica_stats: dict[int, Stats] = {}
        if replicas > 1:  # data parallelism: the load of each replica, beside the sums above
            self.routed = Counter("tandem_replica_requests", "Engine requests routed to each replica",
                                  ["replica"], registry=r)
            self.replica_running = Gauge("tandem_replica_requests_running", "Running requests per "
                                         "replica", ["replica"], registry=r)
            self.replica_waiting = Gauge("tandem_replica_requests_waiting", "Waiting requests per "
                                         "replica", ["replica"], registry=r)
            self.replica_kv = Gauge("tandem_replica_kv_cache_usage", "KV cache usage per replica",
                                    ["replica"], registry=r)

    def set_replica_stats(self, replica: int, stats: Stats) -> None:
        """One replica's load; the unlabelled gauges become sums (requests) and means (rest)."""
        self._replica_stats[replica] = stats
        label = str(replica)
        self.replica_running.labels(label).set(stats.running)
        self.replica_waiting.labels(label).set(stats.waiting)
        self.replica_kv.labels(label).set(stats.kv_cache_usage)
        every = list(self._replica_stats.values())
        self.set_stats(Stats(sum(s.running for s in every), sum(s.waiting for s in every),
                             _mean([s.kv_cache_usage for s in every]),
                             _mean([s.gpu_busy_fraction for s in every]),
                             _mean([s.mean_cpu_lead_ms for s in every]),
                             _mean([s.mean_host_ms for s in every])))

    def set_stats(self, stats: Stats) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.host_ms.set(stats.mean_host_ms)
        if stats.gpu_busy_fraction is not None:
            self.gpu_busy.set(stats.gpu_busy_fraction)
        if stats.mean_cpu_lead_ms is not None:
            self.cpu_lead.set(stats.mean_cpu_lead_ms)
        self._add_deltas("cache", [(self.cache_queries, (), stats.prefix_cache_queried_tokens),
                                   (self.cache_hits, (), stats.prefix_cache_hit_tokens)])
        self.cache_tokens.set(stats.prefix_cache_tokens)
        self._add_deltas("host", [(self.host_hits, (), stats.host_cache_hit_tokens),
                                  (self.host_copy_bytes, ("load",), stats.host_load_bytes),
                                  (self.host_copy_bytes, ("write_back",), stats.host_write_back_bytes),
                                  (self.host_copy_seconds, ("load",), stats.host_load_seconds),
                                  (self.host_copy_seconds, ("write_back",), stats.host_write_back_seconds)])
        self.host_tokens.set(stats.host_cache_tokens)
        self._add_deltas("spec", [(self.spec_drafts, (), stats.spec_decode_num_drafts),
                                  (self.spec_draft_tokens, (), stats.spec_decode_num_draft_tokens),
                                  (self.spec_accepted, (), stats.spec_decode_num_accepted_tokens)]
                         + [(self.spec_accepted_pos, (str(j),), n)
                            for j, n in enumerate(stats.spec_decode_num_accepted_tokens_per_pos)])

    def _add_deltas(self, group: str, totals: list[tuple[Counter, tuple, int]]) -> None:
        """Counters take deltas of the engine's running totals: (counter, its labels, total),
        in a fixed order per group. A total below the one last seen means the engine restarted
        (its totals start from 0 again): nothing is added that time; the new totals are kept."""
        seen = self._seen_totals.get(group, ())
        before = [seen[i] if i < len(seen) else 0 for i in range(len(totals))]
        if all(total >= b for (_, _, total), b in zip(totals, before)):
            for (counter, labels, total), b in zip(totals, before):
                (counter.labels(*labels) if labels else counter).inc(total - b)
        self._seen_totals[group] = tuple(total for _, _, total in totals)

    def set_engine_up(self, up: bool) -> None:
        """A dead engine runs nothing and holds nothing: its last figures must not linger."""
        self.engine_up.set(1 if up else 0)
        if not up:
            for gauge in (self.running, self.waiting, self.kv_cache_usage, self.host_ms, self.gpu_busy,
                          self.cpu_lead):
                gauge.set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None
