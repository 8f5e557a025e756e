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
