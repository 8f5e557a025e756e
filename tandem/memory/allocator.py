"""Free lists for KV token slots and request rows. Host-only bookkeeping, no device work."""


class SlotAllocator:
    """Hands out integer slots in [first, first + count). Double frees are errors, always:
    a slot freed twice would later be handed to two requests at once."""

    def __init__(self, count: int, first: int = 1):
        self.first, self.count = first, count
        self._free = list(range(first + count - 1, first - 1, -1))  # pop() gives low slots first
        self._in_use = bytearray(first + count)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} slots, {len(self._free)} free")
        out = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        for s in out:
            self._in_use[s] = 1
        return out

    def free(self, slots: list[int]) -> None:
        for s in slots:
            if not self._in_use[s]:
                raise AssertionError(f"slot {s} freed twice (or never allocated)")
            self._in_use[s] = 0
        self._free.extend(reversed(slots))
