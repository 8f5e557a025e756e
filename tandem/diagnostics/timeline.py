"""Per-step timeline: host time spent planning, launching and processing, and device time
of each forward from CUDA events. Events are read only after the step's result was
processed (its copy_done completed), with `query()` as a guard: never a blocking read."""
import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class StepRecord:
    step: int
    batch_size: int
    num_tokens: int
    is_decode: bool
    context_tokens: int  # sum over rows of tokens in cache after the step (KV read by attention)
    attn_pairs: int  # query-key pairs attention computes (causal), for FLOP counts
    host_start: float  # perf_counter when planning began (seconds)
    schedule_ms: float
    launch_ms: float
    process_ms: float = 0.0  # processing this step's result (in a later engine call)
    host_wait_ms: float = 0.0  # part of process_ms spent in the one sanctioned wait
    gpu_forward_ms: float | None = None  # None on the CPU or when events were not ready
    gpu_idle_before_ms: float | None = None  # device gap since the previous forward ended


class Timeline:
    def __init__(self, path: str | Path | None = None):
        self.records: list[StepRecord] = []
        self._file = open(path, "w") if path else None

    def add(self, record: StepRecord) -> None:
        self.records.append(record)

    def completed(self, record: StepRecord, start, end, previous_end) -> None:
        """Fill device times once the step's forward is known complete."""
        if start is not None and end is not None and end.query():
            record.gpu_forward_ms = start.elapsed_time(end)
            if previous_end is not None and previous_end.query():
                record.gpu_idle_before_ms = max(0.0, previous_end.elapsed_time(start))
        if self._file:
            self._file.write(json.dumps(asdict(record)) + "\n")

    def summary(self, skip: int = 0) -> dict:
        recs = [r for r in self.records[skip:] if r.gpu_forward_ms is not None]
        out = {"steps": len(self.records[skip:]),
               "mean_host_ms": _mean([r.schedule_ms + r.launch_ms + r.process_ms - r.host_wait_ms
                                      for r in self.records[skip:]]),
               "mean_host_wait_ms": _mean([r.host_wait_ms for r in self.records[skip:]])}
        if recs:
            busy = sum(r.gpu_forward_ms for r in recs)
            idle = sum(r.gpu_idle_before_ms or 0.0 for r in recs[1:])
            out["gpu_busy_fraction"] = busy / (busy + idle) if busy + idle > 0 else None
            out["mean_gpu_forward_ms"] = busy / len(recs)
        return out

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
