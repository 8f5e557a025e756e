"""Stored responses for `previous_response_id` and `GET /v1/responses/{id}`: in memory, bounded.

Each entry keeps its whole conversation (not a link to its parent), so a chain never breaks
when an older response is evicted; the byte bound is what keeps long chains in check.
Eviction is oldest-stored first. The store belongs to the server's state (one per process).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 256 * 2**20


@dataclass
class StoredResponse:
    response: dict  # the response object as it was returned
    conversation: list[dict]  # chat messages: the input (without instructions) and the output
    size: int = 0  # bytes, as JSON


@dataclass
class ResponseStore:
    max_responses: int = DEFAULT_MAX_RESPONSES  # 0 stores nothing
    max_bytes: int = DEFAULT_MAX_BYTES
    _entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    _bytes: int = 0

    def put(self, response: dict, conversation: list[dict]) -> None:
        entry = StoredResponse(response, conversation)
        entry.size = len(msgspec.json.encode([response, conversation]))
        if self.max_responses < 1 or entry.size > self.max_bytes:
            return  # too big to keep: a later previous_response_id gets a 404, as for an evicted one
        self.delete(response["id"])
        self._entries[response["id"]] = entry
        self._bytes += entry.size
        while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.size

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        old = self._entries.pop(response_id, None)
        if old is not None:
            self._bytes -= old.size
        return old is not None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes
