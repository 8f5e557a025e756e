"""`tandem bench host-steps`: the CPU replay of the GPU's steady decode path (issue 21)."""
import json

import pytest

from tandem.bench import host_steps
from tandem.scheduler.batch import DecodeColumns


@pytest.mark.parametrize("text", ["engine", "caller"])
def test_the_graphed_decode_path_makes_no_rows_and_times_each_phase(monkeypatch, tmp_path, text):
    """The stub graphs put every decode step on the graphed path, which reads the scheduler's
    decode columns from plan to result: no `Row` is made. Each phase is timed."""
    made = []  # not raised: a launch's or a row's failure would be caught and served as an error
    monkeypatch.setattr(DecodeColumns, "rows", lambda self: made.append(self) or [])
    out = tmp_path / "host.json"
    assert host_steps.main(["--batch", "8", "--steps", "4", "--warmup", "2", "--rounds", "1", "--tokenizer",
                            "builtin", "--text", text, "--json", str(out)]) == 0
    median = json.loads(out.read_text())["median"]
    assert set(median) == {"schedule", "launch", "process", "host", "gc"}
    assert all(median[k] > 0 for k in ("schedule", "launch", "process"))
    assert made == []
