"""The step channel's messages (rank 0 -> workers), msgpack-encoded with msgspec.

A worker decodes only these types, checked field by field (SamplingParams runs its own
validation), so nothing on the wire can run code: never pickle over a socket (the server's
IPC in tandem/server/protocol.py follows the same rule). Rows are array-like and rank 0
encodes them straight from plain tuples (the same bytes), so a step costs tens of
microseconds on each side.
"""
from __future__ import annotations

import dataclasses
import typing

import msgspec

from tandem.sampling import SamplingParams
from tandem.scheduler.batch import Row


class Admit(msgspec.Struct, array_like=True):
    """A request entering a slot: `Runner.start_request`'s arguments."""

    slot: int
    prompt_ids: list[int]
    params: SamplingParams
    outputs: list[int]
    seed: int  # the request's effective seed (a draft model's draws are keyed by it)


# Every Row field but the request travels as is, after the request's slot and seed: a field
# added to Row travels without edits here (its type must be one msgspec encodes).
ROW_FIELDS = tuple(f.name for f in dataclasses.fields(Row) if f.name != "req")
_ROW_TYPES = typing.get_type_hints(Row)
WireRow = msgspec.defstruct("WireRow", [("slot", int), ("seed", int)] + [(n, _ROW_TYPES[n]) for n in ROW_FIELDS],
                            array_like=True, module=__name__)


class TierCopy(msgspec.Struct, array_like=True):
    """A copy between the KV pool and its host tier that rank 0's plan queued: every rank
    queues the same one on its own shard ("load" or "write_back")."""

    kind: str
    gpu_slots: list[int]
    host_slots: list[int]


class Step(msgspec.Struct, tag=True):
    step: int
    admits: list[Admit]  # requests admitted since the previous step, in order
    rows: list[WireRow]  # rank 0 puts tuples in WireRow's field order here (array-like: same bytes)
    copies: list[TierCopy] = []  # host-tier copies the plan queued, in order, before its forward
    wait_copy: int = 0  # the copy (by number, KVTierCopier.seq) rank 0's forward waits for


class Stop(msgspec.Struct, tag=True):
    """The engine is closing: leave the loop and the process group."""


Message = Step | Stop
