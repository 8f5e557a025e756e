"""Benchmarks: `tandem bench latency | offline | serve`."""
