"""Device-to-host copy of sampled ids (and logprobs) into pinned buffers, on the copy stream.

Pinned host buffers form a two-deep ring: step N's slot is reused by step N + 2, which is
launched only after step N's result was processed. The prompt-logprob buffers (sized by the
step's scored prefill rows, unknown up front) grow in place: a slot is replaced only when step
N + 2 needs more room, and by then step N's views were read.
"""
from dataclasses import dataclass

import torch

from tandem.overlap.streams import StreamSet, host_wait

from tandem.sampling import MAX_LOGPROBS as MAX_TOP_LOGPROBS
from tandem.sampling.prompt_logprobs import PromptLogprobs


@dataclass
class HostResult:
    """Views of pinned host memory, valid to read once `copy_done` completed."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    copy_done: object
    prompt: PromptLogprobs | None = None  # the step's scored prefill rows (pinned views)

    def wait(self) -> None:
        """The loop's one wait for a step: its result's copy."""
        host_wait(self.copy_done)


class ResultCopier:
    def __init__(self, streams: StreamSet, max_rows: int, depth: int = 2):
        self.streams, self.depth = streams, depth
        pin = streams.pin()
        self.tokens = [torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(depth)]
        self.logprobs = [torch.zeros(max_rows, dtype=torch.float32, pin_memory=pin) for _ in range(depth)]
        # Flat, so that an [n, k] view is contiguous (async copies need contiguous targets).
        self.top_ids = [torch.zeros(max_rows * MAX_TOP_LOGPROBS, dtype=torch.int64, pin_memory=pin)
                        for _ in range(depth)]
        self.top_lps = [torch.zeros(max_rows * MAX_TOP_LOGPROBS, dtype=torch.float32, pin_memory=pin)
                        for _ in range(depth)]
        # Prompt logprobs, per ring slot and field: allocated on first use, grown on demand.
        self.prompt: list[dict[str, torch.Tensor]] = [{} for _ in range(depth)]

    def copy(self, step: int, token_ids: torch.Tensor, logprobs: torch.Tensor | None,
             top_ids: torch.Tensor | None, top_logprobs: torch.Tensor | None, sampled,
             prompt: PromptLogprobs | None = None) -> HostResult:
        """Queue the copies behind event `sampled` (recorded on the forward stream, after the
        prompt logprobs too), all before the one `copy_done`."""
        i, n = step % self.depth, token_ids.shape[0]
        copy = self.streams.copy
        out = HostResult(self.tokens[i][:n], None, None, None, self.streams.event())
        with self.streams.use(copy):
            copy.wait_event(sampled)
            self._to_host(out.token_ids, token_ids)
            # A verify step packs more ids than it has sampled tokens: logprobs go by their own count.
            n = logprobs.shape[0] if logprobs is not None else n
            if logprobs is not None:
                out.logprobs = self.logprobs[i][:n]
                self._to_host(out.logprobs, logprobs)
            if top_ids is not None:
                k = top_ids.shape[1]
                out.top_ids = self.top_ids[i][:n * k].view(n, k)
                out.top_logprobs = self.top_lps[i][:n * k].view(n, k)
                self._to_host(out.top_ids, top_ids)
                self._to_host(out.top_logprobs, top_logprobs)
            if prompt is not None:
                out.prompt = self._prompt_to_host(i, prompt)
            out.copy_done.record(copy)
        return out

    def _prompt_to_host(self, i: int, prompt: PromptLogprobs) -> PromptLogprobs:
        """On the copy stream, into ring slot i's prompt buffers (grown to fit)."""
        n = prompt.logprobs.shape[0]
        k = prompt.top_ids.shape[1] if prompt.top_ids is not None else 0
        host = PromptLogprobs(self._room(i, "logprobs", n, torch.float32), self._room(i, "ranks", n, torch.int64),
                              self._room(i, "top_ids", n * k, torch.int64).view(n, k) if k else None,
                              self._room(i, "top_logprobs", n * k, torch.float32).view(n, k) if k else None)
        for name in ("logprobs", "ranks", "top_ids", "top_logprobs"):
            if getattr(prompt, name) is not None:
                self._to_host(getattr(host, name), getattr(prompt, name))
        return host

    def _room(self, i: int, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned view of `numel` elements in slot i's buffer `name`. Lifetime: slot i was last
        copied into by step N - 2, whose result was processed before step N launched, so a
        smaller buffer may be dropped; growth doubles, so a long prompt reallocates rarely."""
        buf = self.prompt[i].get(name)
        if buf is None or buf.numel() < numel:
            size = max(numel, 2 * buf.numel() if buf is not None else 1024)
            buf = self.prompt[i][name] = torch.empty(size, dtype=dtype, pin_memory=self.streams.pin())
        return buf[:numel]

    def _to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
        # Lifetime: src was allocated on the forward stream and is read here on the copy stream.
        self.streams.record_stream(src, self.streams.copy)
