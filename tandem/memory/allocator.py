"""Free lists for KV token slots and request rows. Host-only bookkeeping, no device work."""
from collections import deque


class SlotAllocator:
    """Hands out integer slots in [first, first + count). Double frees are errors, always:
    a slot freed twice would later be handed to two requests at once.

    Slots freed while a host-tier copy may still read or write them (`free(..., after_copy=seq)`:
    the copy's number on the copy stream, `KVTierCopier`) cool apart from the free list and are
    handed out after it, oldest first. Whoever takes one must have the next forward wait for that
    copy: `copy_needed` is the latest such copy handed out so far (the engine's fence reads it),
    unless the taker's own writes run on the copy stream, after it (`alloc(..., by_copy=True)`)."""

    def __init__(self, count: int, first: int = 1):
        self.first, self.count = first, count
        self._free = list(range(first + count - 1, first - 1, -1))  # pop() gives low slots first
        self._in_use = bytearray(first + count)
        self._cooling: deque[tuple[int, list[int]]] = deque()  # (copy number, slots), oldest first
        self._num_cooling = 0
        self.copy_needed = 0  # never decreases: a fence compares it with what it waited for

    @property
    def num_free(self) -> int:
        return len(self._free) + self._num_cooling

    def alloc(self, n: int, by_copy: bool = False) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"asked for {n} slots, {self.num_free} free")
        take = min(n, len(self._free))
        out = self._free[-1:-take - 1:-1]  # the last `take`, reversed, in one copy (pop() order)
        del self._free[len(self._free) - take:]
        if take < n:
            out += self._take_cooling(n - take, by_copy)
        in_use = self._in_use  # a local: the loop runs per slot (~1k a prefill row)
        for s in out:
            in_use[s] = 1
        return out

    def _take_cooling(self, n: int, by_copy: bool) -> list[int]:
        out = []
        while len(out) < n:
            seq, slots = self._cooling[0]
            need = n - len(out)
            if need >= len(slots):
                self._cooling.popleft()
                out += slots
            else:
                out += slots[:need]
                self._cooling[0] = (seq, slots[need:])
            if not by_copy:
                self.copy_needed = max(self.copy_needed, seq)
        self._num_cooling -= n
        return out

    def free(self, slots: list[int], after_copy: int = 0) -> None:
        in_use = self._in_use
        for s in slots:
            if not in_use[s]:
                raise AssertionError(f"slot {s} freed twice (or never allocated)")
            in_use[s] = 0
        if after_copy and slots:
            self._cooling.append((after_copy, list(slots)))
            self._num_cooling += len(slots)
        else:
            self._free.extend(reversed(slots))
