"""The staging ring's layout: every field a kernel reads starts 16-byte aligned, whatever the
sizes of the fields before it (Triton compiles one kernel variant per pointer-alignment
pattern, so unaligned views would compile new variants while serving)."""
import torch

from tandem.overlap.staging import InputStager
from tandem.overlap.streams import StreamSet


def test_every_staged_field_is_16_byte_aligned_and_holds_its_values():
    stager = InputStager(StreamSet.create(torch.device("cpu")), capacity=64)
    fields = {"a": [1, 2, 3], "b": [4], "c": [], "d": [5, 6, 7, 8, 9], "e": [10]}
    views = stager.stage(0, fields)
    for name, values in fields.items():
        assert views[name].data_ptr() % 16 == 0, name
        assert views[name].tolist() == values
    assert stager.views(0, {k: len(v) for k, v in fields.items()})["e"].data_ptr() == views["e"].data_ptr()


def test_the_alignment_padding_does_not_eat_the_requested_capacity():
    stager = InputStager(StreamSet.create(torch.device("cpu")), capacity=20)
    fields = {f"f{i}": [i] for i in range(20)}  # 20 ints, each padded to 2
    views = stager.stage(1, fields)
    assert [v.item() for v in views.values()] == list(range(20))


class _CopyStillQueued:
    """The event of a copy that has not run yet (a step staged ahead, then dropped): the host
    buffer it reads must keep its values until the wait on it returns."""

    def __init__(self, host: torch.Tensor, values: list[int]):
        self.host, self.values, self.waited = host, values, False

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        assert self.host[:len(self.values)].tolist() == self.values  # not written over before the copy ran
        self.waited = True

    def record(self, stream=None) -> None:  # the next copy out of the slot
        pass


def test_a_ring_slot_is_written_again_only_after_the_copy_that_read_it_ran():
    stager = InputStager(StreamSet.create(torch.device("cpu")), capacity=16)
    stager.stage(1, {"a": [1, 2, 3, 4]})
    queued = _CopyStillQueued(stager.host[1], [1, 2, 3, 4])
    stager.copied[1] = queued
    stager.stage(3, {"a": [9, 9, 9, 9]})  # the same ring slot
    assert queued.waited and stager.host[1][:4].tolist() == [9, 9, 9, 9]
    stager.copied[1] = _CopyStillQueued(stager.host[1], [9, 9, 9, 9])
    untouched = _CopyStillQueued(stager.host[0], [])
    stager.copied[0] = untouched
    stager.stage(1, {"a": [5]})  # slot 1: no wait on slot 0's copy
    assert not untouched.waited and stager.copied[1].waited


def test_host_int64_holds_the_values_pinned_only_when_asked():
    from tandem.overlap.streams import host_int64
    values = [0, 7, 2**40, -3]
    t = host_int64(values, pin=False)
    assert t.dtype == torch.int64 and t.tolist() == values and not t.is_pinned()
    assert host_int64([], pin=False).shape == (0,)
    if torch.cuda.is_available():
        assert host_int64(values, pin=True).is_pinned()
