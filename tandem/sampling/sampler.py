"""The batched device sampler: penalties, temperature, top-k/top-p/min-p, draw, logprobs."""
from __future__ import annotations

import torch
from torch import Tensor

from tandem.overlap.streams import device_int64
from tandem.sampling.inputs import SampleOutput, SamplingInputs
from tandem.sampling.noise import _mix32, gumbel_argmax
from tandem.sampling.params import SamplingParams


class Sampler:
    """Batched sampling on the device; one instance per model runner.

    Order (vLLM's): penalties -> temperature -> top-k -> top-p -> min-p -> draw.
    Penalty history (which tokens each slot's prompt contains, how often each
    token was generated) lives on the device because the host lags one step
    behind the sampled tokens.
    """

    def __init__(self, vocab_size: int, max_slots: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.max_slots = max_slots
        self.device = torch.device(device)
        # Hash of every token id, fixed for the sampler's life: the per-step noise
        # then costs one mix over [B, V] instead of two.
        vocab = torch.arange(vocab_size, dtype=torch.int64, device=self.device)
        self._token_hash = _mix32(vocab ^ 0x9E3779B9)
        self._vocab = vocab
        # Token v's bit in a packed allowed-token mask: bit v % 32 of int32 word v // 32.
        self._mask_word = vocab >> 5
        self._mask_bit = (vocab & 31).to(torch.int32)
        # Allocated on the first request with penalties (see start_request).
        self._prompt_mask: Tensor | None = None  # [max_slots, V] bool
        self._output_counts: Tensor | None = None  # [max_slots, V] int32

    # ---- penalty state

    @property
    def has_penalty_state(self) -> bool:
        return self._output_counts is not None

    def start_request(
        self,
        slot: int,
        prompt_token_ids: Tensor | list[int],
        params: SamplingParams | None = None,
    ) -> None:
        """Reset `slot` for a new request and remember its prompt tokens.

        Call it on the forward stream before the request's first sample. With
        `params` given and no penalties in it, nothing happens: a slot's history
        is only read by a request with penalties, and that request resets the slot
        itself. Without `params` the slot is always reset (and the state allocated).
        """
        if params is not None and not params.uses_penalties:
            return
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must be in [0, {self.max_slots}), got {slot}")
        if self._output_counts is None:
            shape = (self.max_slots, self.vocab_size)
            self._prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
            self._output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        assert self._prompt_mask is not None
        ids = self._to_device_ids(prompt_token_ids)
        self._prompt_mask[slot].zero_()
        self._prompt_mask[slot].index_fill_(0, ids, True)
        self._output_counts[slot].zero_()

    def _to_device_ids(self, ids: Tensor | list[int]) -> Tensor:
        if isinstance(ids, Tensor):
            return ids.to(self.device, dtype=torch.int64, non_blocking=True)
        return device_int64(ids, self.device)

    def record(self, slots: Tensor, token_ids: Tensor) -> None:
        """Count each row's sampled token in its slot's history: one device scatter, no host read.

        A no-op until some request needed penalties; padding rows should use a
        padding slot (their counts are never read).
        """
        if self._output_counts is None:
            return
        flat = slots.to(torch.int64) * self.vocab_size + token_ids.to(torch.int64)
        ones = torch.ones_like(flat, dtype=torch.int32)
        self._output_counts.view(-1).index_add_(0, flat, ones)

    def record_emitted(self, slots: Tensor, tokens: Tensor, accepted: Tensor) -> None:
        """A verify step's emitted tokens, tokens[b, :accepted[b] + 1], counted per slot."""
        if self._output_counts is None:
            return
        emitted = torch.arange(tokens.shape[1], device=tokens.device)[None, :] <= accepted[:, None]
        flat = slots.to(torch.int64)[:, None] * self.vocab_size + tokens.to(torch.int64)
        self._output_counts.view(-1).index_add_(0, flat.flatten(), emitted.flatten().to(torch.int32))

    def apply_penalties(self, logits: Tensor, inputs: SamplingInputs, extra_counts: Tensor | None = None) -> Tensor:
        """vLLM semantics, out of place: repetition over prompt+output, presence and
        frequency over output only. Rows with neutral values are unchanged. `extra_counts`
        [B, V]: outputs a row has beyond its slot's counts (a verify query's earlier proposals)."""
        if self._output_counts is None or self._prompt_mask is None:
            raise RuntimeError("penalties requested but no request with penalties went through start_request")
        slots = inputs.slots
        counts = self._output_counts.index_select(0, slots)
        if extra_counts is not None:
            counts = counts + extra_counts
        seen_out = counts > 0
        seen = seen_out | self._prompt_mask.index_select(0, slots)
        rep = inputs.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        logits = logits - inputs.frequency_penalty[:, None] * counts.to(logits.dtype)
        return logits - inputs.presence_penalty[:, None] * seen_out.to(logits.dtype)

    @staticmethod
    def apply_bias(logits: Tensor, inputs: SamplingInputs) -> Tensor:
        """Add each row's sparse biases (vLLM applies them before penalties), out of place:
        logprobs are reported from the unbiased logits, as vLLM's raw logprobs are."""
        rows, ids = inputs.bias_index[0], inputs.bias_index[1]
        flat = rows * logits.shape[1] + ids
        return logits.flatten().index_add(0, flat, inputs.bias_value).view_as(logits)

    # ---- sampling

    def apply_bitmask(self, logits: Tensor, bitmask: Tensor) -> Tensor:
        """Disallowed tokens to -inf; `bitmask` [B, ceil(V/32)] int32 (xgrammar's layout), a set
        bit allows the token. Out of place, fixed shapes: no host sync."""
        allowed = (bitmask.index_select(1, self._mask_word) >> self._mask_bit) & 1
        return logits.masked_fill(allowed == 0, float("-inf"))

    def sample(self, logits: Tensor, inputs: SamplingInputs, bitmask: Tensor | None = None,
               extra_counts: Tensor | None = None) -> SampleOutput:
        """Sample one token per row of `logits` [B, V]. Queues device work only. A `bitmask`
        (structured output) applies first, so penalties, every draw and the logprobs see the
        constrained distribution. `extra_counts`: see `apply_penalties`."""
        raw, logits = self._adjusted(logits, inputs, bitmask, extra_counts)
        greedy_ids = logits.argmax(dim=-1)
        if inputs.all_greedy:
            token_ids = greedy_ids
        else:
            is_greedy = inputs.temperature == 0
            sampled_ids = gumbel_argmax(self._scaled(logits, inputs), inputs.noise_key, self._token_hash)
            token_ids = torch.where(is_greedy, greedy_ids, sampled_ids)
        return self.with_logprobs(raw, token_ids, inputs)

    def distribution(self, logits: Tensor, inputs: SamplingInputs, bitmask: Tensor | None = None,
                     extra_counts: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(probs [B, V], raw logits): the distribution `sample` draws each row from (a point
        mass at the argmax for greedy rows), and the logits its logprobs are reported from.
        For rejection sampling against a draft's distribution."""
        raw, logits = self._adjusted(logits, inputs, bitmask, extra_counts)
        point = torch.nn.functional.one_hot(logits.argmax(dim=-1), self.vocab_size).to(torch.float32)
        if inputs.all_greedy:
            return point, raw
        probs = self._scaled(logits, inputs).softmax(dim=-1)
        return torch.where((inputs.temperature == 0)[:, None], point, probs), raw

    def with_logprobs(self, raw: Tensor, token_ids: Tensor, inputs: SamplingInputs) -> SampleOutput:
        """`token_ids` with their logprobs (and the top-n) under the raw logits, if any row asks."""
        out = SampleOutput(token_ids=token_ids)
        if inputs.max_logprobs is not None:
            logprobs = torch.log_softmax(raw, dim=-1)
            out.logprobs = logprobs.gather(1, token_ids[:, None]).squeeze(1)
            if inputs.max_logprobs > 0:
                top = torch.topk(logprobs, min(inputs.max_logprobs, self.vocab_size), dim=-1)
                out.top_logprobs, out.top_ids = top.values, top.indices
        return out

    def _adjusted(self, logits: Tensor, inputs: SamplingInputs, bitmask: Tensor | None,
                  extra_counts: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(raw, adjusted): fp32 logits after the mask, then after biases and penalties."""
        logits = logits.to(torch.float32)
        if bitmask is not None:
            logits = self.apply_bitmask(logits, bitmask)
        raw = logits
        if inputs.need_bias:
            logits = self.apply_bias(logits, inputs)
        if inputs.need_penalties:
            logits = self.apply_penalties(logits, inputs, extra_counts)
        return raw, logits

    def _scaled(self, logits: Tensor, inputs: SamplingInputs) -> Tensor:
        """Temperature, then top-k/top-p/min-p: the scores sampled rows are drawn from."""
        temperature = inputs.temperature
        scaled = logits / torch.where(temperature == 0, 1.0, temperature)[:, None]
        return self._mask(scaled, inputs)

    @property
    def token_hash(self) -> Tensor:
        """[V] int64: each token id's hash, the noise's per-token half (drafts draw with it too)."""
        return self._token_hash

    def _mask(self, scaled: Tensor, inputs: SamplingInputs) -> Tensor:
        """Set disallowed tokens to -inf. Each step runs only if some row needs it; a row
        with the neutral value (top_k=-1, top_p=1, min_p=0) passes through unchanged."""
        V = self.vocab_size
        neg_inf = float("-inf")
        if inputs.need_top_k or inputs.need_top_p:
            k = inputs.top_k
            k = torch.where((k < 1) | (k > V), V, k)  # -1 (off) keeps all V
        if inputs.need_top_p and not inputs.top_p_within_top_k:
            # Some top-p row has no top-k: sort the whole vocabulary once; top-k is then a
            # rank cut and top-p a mass cut in sorted order.
            vals, idx = scaled.sort(dim=-1, descending=True, stable=True)
            if inputs.need_top_k:
                vals = vals.masked_fill(self._vocab[None, :] >= k[:, None], neg_inf)
            vals = self._top_p_sorted(vals, inputs.top_p)
            scaled = torch.empty_like(scaled).scatter_(1, idx, vals)
        elif inputs.need_top_k:
            kmax = min(inputs.max_top_k, V)
            if inputs.need_top_p:
                # Every top-p row has top-k, so its nucleus lies within its top kmax tokens:
                # a [B, kmax] topk replaces the [B, V] sort. Rows without top-k keep all.
                vals, idx = torch.topk(scaled, kmax, dim=-1)
                vals = vals.masked_fill(self._vocab[None, :kmax] >= k[:, None], neg_inf)
                vals = self._top_p_sorted(vals, inputs.top_p)
                cut = torch.full_like(scaled, neg_inf).scatter_(1, idx, vals)
                scaled = torch.where((k < V)[:, None], cut, scaled)
            else:
                top_vals = torch.topk(scaled, kmax, dim=-1).values
                kth = top_vals.gather(1, (k.clamp(max=kmax) - 1)[:, None])
                kth = torch.where((k < V)[:, None], kth, neg_inf)
                scaled = scaled.masked_fill(scaled < kth, neg_inf)
        if inputs.need_min_p:
            # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p); min_p = 0 gives -inf (keeps all).
            # Renormalising after top-k/top-p keeps ratios, so this equals min-p on the cut distribution.
            floor = scaled.amax(dim=-1, keepdim=True) + torch.log(inputs.min_p)[:, None]
            scaled = scaled.masked_fill(scaled < floor, neg_inf)
        return scaled

    @staticmethod
    def _top_p_sorted(vals: Tensor, top_p: Tensor) -> Tensor:
        """Top-p on logits sorted descending: keep the smallest prefix whose mass reaches p.
        The top token has mass_before 0 < p, so it always stays. Rows with p = 1 are exempt
        so cumsum rounding cannot trim their tail."""
        probs = vals.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        p = top_p[:, None]
        return vals.masked_fill((mass_before >= p) & (p < 1.0), float("-inf"))

