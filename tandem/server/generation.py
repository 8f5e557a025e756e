"""One HTTP request's engine requests (prompts x n choices), merged into one stream of deltas."""
from __future__ import annotations

from typing import AsyncIterator

from tandem.server import protocol as P
from tandem.server.client import DeltaQueue, EngineClient
from tandem.server.errors import APIError, EngineDead


class Generation:
    def __init__(self, client: EngineClient, request_id: str,
                 prompts: list[list[int]], params: list[P.Params]):
        self.client, self.request_id = client, request_id
        self.prompts, self.params = prompts, params
        self.rids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self._queue = DeltaQueue()
        self._unfinished = set(range(len(prompts)))

    async def start(self) -> None:
        """Returns once the engine accepted every choice; raises APIError / EngineDead otherwise."""
        await self.client.submit(self._queue, self.rids, self.prompts, self.params)

    async def deltas(self) -> AsyncIterator[tuple[int, P.Delta]]:
        """(choice index, delta) in arrival order until every choice finished."""
        while self._unfinished:
            item = self._queue.take(await self._queue.get())
            if isinstance(item, EngineDead):
                self._unfinished.clear()
                raise item
            if isinstance(item, APIError):  # the reader fell too far behind (DeltaQueue)
                self.abort()
                raise item
            index, delta = item
            if delta.finished:
                self._unfinished.discard(index)
            if delta.error is not None:  # the engine failed this choice: the whole request fails
                self.abort()
                code = delta.error_code or ("engine_error" if delta.error_status >= 500 else None)
                raise APIError(delta.error_status, delta.error, code=code)
            yield index, delta

    def abort(self) -> None:
        """Stop whatever has not finished (the client left); a no-op once all finished."""
        if self._unfinished:
            self.client.abort([self.rids[i] for i in self._unfinished])
            self._unfinished.clear()
