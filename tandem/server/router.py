"""`--dp N`: N engine processes (each possibly tensor-parallel) behind one front end.

Each HTTP request (all its choices) goes to the live replica with the fewest requests in
flight, counted by the front end itself: exact and current, where the engines' reported
running/waiting figures lag by one message. The router has the EngineClient surface the
API uses (start, submit, abort, close, ready, dead), so the API does not know it is there.
"""
from __future__ import annotations

import asyncio

from tandem.server.client import EngineClient
from tandem.server.errors import EngineDead
from tandem.server.metrics import Metrics
from tandem.server.protocol import Stats


class ReplicaRouter:
    def __init__(self, replicas: list[EngineClient], metrics: Metrics):
        self.replicas, self.metrics = replicas, metrics

    async def start(self):
        """Start every replica at once (they load in parallel); fails if any fails."""
        started = await asyncio.gather(*(r.start() for r in self.replicas))
        return started[0]

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.replicas))

    @property
    def ready(self):
        return self.replicas[0].ready

    @property
    def proc(self):
        return self.replicas[0].proc

    @property
    def dead(self) -> str | None:
        """Why a replica is gone, if one is (health turns 503; the others keep serving)."""
        return next((f"replica {i}: {r.dead}" for i, r in enumerate(self.replicas) if r.dead), None)

    @property
    def num_tracked(self) -> int:
        return sum(r.num_tracked for r in self.replicas)

    async def submit(self, queue: asyncio.Queue, request_ids: list[str], prompts: list[list[int]],
                     params: list) -> None:
        live = [i for i, r in enumerate(self.replicas) if not r.dead]
        if not live:
            raise EngineDead(self.dead or "no live replica")
        target = min(live, key=lambda i: self.replicas[i].num_tracked)
        self.metrics.routed.labels(str(target)).inc(len(request_ids))
        await self.replicas[target].submit(queue, request_ids, prompts, params)

    def use_tokenizer(self, tokenizer) -> None:
        for r in self.replicas:
            r.use_tokenizer(tokenizer)

    def abort(self, request_ids: list[str]) -> None:
        for r in self.replicas:  # each aborts only the ids it tracks
            r.abort(request_ids)

    def fail_all(self, reason: str) -> None:
        for r in self.replicas:
            r.fail_all(reason)


class ReplicaMetrics:
    """One replica's handle on the server's metrics: counters and histograms are shared
    (so they sum over replicas); load figures are kept per replica and summed."""

    def __init__(self, metrics: Metrics, replica: int):
        self.metrics, self.replica = metrics, replica

    def set_stats(self, stats: Stats) -> None:
        self.metrics.set_replica_stats(self.replica, stats)

    def __getattr__(self, name: str):
        return getattr(self.metrics, name)
