"""A request's state, as the scheduler and the output processor see it."""
import enum
import functools
import time
from dataclasses import dataclass, field

from tandem.sampling import SamplingParams
from tandem.sampling.bias import Bias
from tandem.sampling.inputs import sampling_row
from tandem.text import RequestText


PROMPT_HASH_BLOCK = 32  # tokens per block of `Request.prompt_block_hashes`


def _chain_block_hash(previous: int, ids: list[int], start: int) -> int:
    """The prefix hash through the block at `start`, chained on the previous block's
    (0 before the first): `prompt_block_hashes` and `first_block_hash` must agree."""
    return hash((previous, tuple(ids[start:start + PROMPT_HASH_BLOCK])))


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is itself: queue removal and `in` go by identity, in O(1) compares
class Request:
    rid: str
    # A tuple: the collector stops tracking a tuple of ints once a pass has seen it, and the
    # waiting requests' prompts were most of what a full pass walked once the prefix tree's
    # lists were tuples (CPU replay of the host-tier workload, session 50: 218k of 272k list
    # elements mid-run).
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    max_samples: int  # min(max_tokens, room left in the context)
    # Read for every row of every step (planning, launching, processing a result), so declared
    # together: an instance's attributes lie in declaration order, and after a forward the
    # requests are cold in the CPU's caches, where each cache line a row touches costs.
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)  # processed (known to the host)
    stop_ids: frozenset[int] = frozenset()  # token ids that finish it (EOS unless ignored, stop ids)
    # The caller makes its text (Engine.add_request's detokenize=False): outputs name the ids.
    text_outside: bool = False
    text: RequestText | None = None  # incremental detokenizer; None for a model without tokenizer
    mask: object | None = None  # a grammar.MaskProducer (structured output), set once compiled
    first_token_time: float | None = None
    # Placement, owned by the scheduler:
    slot: int = 0  # row in req_to_token and in the FutureMap; 0 = none
    kv_slots: list[int] = field(default_factory=list)  # KV slot of each computed token, in order
    num_computed: int = 0  # tokens whose KV is written by work already launched
    prefill_target: int = 0  # len(fill_ids) when (re)admitted; decode starts once computed
    num_scheduled_samples: int = 0  # samples launched (>= processed outputs, by the lag)
    last_step: int = -1  # last step that included this request (its KV is live until it completes)
    # Prefix cache (see tandem.memory.prefix_cache): kv_slots[:cached_len] are the tree's and
    # locked through cache_node; duplicate_slots are the request's own copies of cached tokens.
    cached_len: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the cache at first admission
    # Speculative decoding: proposals of launched verify rows not processed yet. Each may add
    # up to this many outputs beyond num_scheduled_samples; while > 0 the length is unknown.
    spec_extra: int = 0
    # Accepted proposals of its last verify rows, the pauses in a row they caused, and the
    # decode steps it proposes nothing for (tandem.speculative.planner.note_verified).
    spec_accepted_window: list[int] = field(default_factory=list)
    spec_pauses: int = 0
    spec_pause: int = 0
    # Read when a request arrives, is admitted or ends:
    prompt: str | None = None  # the prompt text, when it came as text
    bias: Bias = ()  # (token id, added logit) on every sample: logit_bias, bad words
    min_tokens_bias: Bias = ()  # bans on stop ids while fewer than params.min_tokens exist
    arrival_time: float = field(default_factory=time.monotonic)
    output_logprobs: list = field(default_factory=list)
    # prompt_logprobs: the engine's TokenLogprob of prompt tokens 1, 2, ... in order, as the
    # steps that computed their rows are processed (row p's logits score token p + 1).
    prompt_logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cache_node: object = None
    duplicate_slots: list[int] = field(default_factory=list)
    host_hit_nodes: list = field(default_factory=list)  # loaded nodes this admission read first (host hits)
    table_pending: int = 0  # leading table entries (reused from the cache) not yet on the device
    spec_index: object | None = None  # a speculative.ngram.HostNgramIndex of its known tokens
    num_preemptions: int = 0
    prefetch_waits: int = 0  # plans that left it waiting for its host-tier prefix to load (PrefixCache)
    host_match_walk: object | None = None  # its prompt's last tree walk (PrefixCache._host_only_tokens)

    @functools.cached_property
    def sampling_row(self) -> bytes:
        """Its `sampling_row`, packed at its first sampled step (params are fixed once
        submitted): the runner's sampling inputs join one bytes object a row."""
        return sampling_row(self.params, self.seed)

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Every sample is the argmax of the raw logits: temperature 0, no penalties, no bias,
        no logprobs. Fixed at admission (the engine owns its params and biases), so a batch
        of such rows needs no sampling inputs (`SamplingInputs.plain_greedy`)."""
        p = self.params
        return (p.temperature == 0 and not p.uses_penalties and not self.bias
                and not (p.min_tokens and self.min_tokens_bias) and p.logprobs is None)

    def bias_at(self, sample_index: int) -> Bias:
        """The logit bias of sample `sample_index`, known at schedule time (no sampled value needed)."""
        if sample_index < self.params.min_tokens:
            return self.bias + self.min_tokens_bias
        return self.bias

    @property
    def fill_ids(self) -> list[int]:
        """The tokens a (re)prefill must compute: the prompt, plus outputs after a preemption."""
        ids = list(self.prompt_token_ids)
        ids += self.output_token_ids
        return ids

    @property
    def fill_len(self) -> int:
        """len(fill_ids), without building it (a ~9k-token history's copy is ~7 us)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def fill_slice(self, start: int, stop: int) -> list[int]:
        """fill_ids[start:stop], copying only those tokens."""
        prompt = self.prompt_token_ids
        if stop <= len(prompt):
            return list(prompt[start:stop])
        return self.fill_ids[start:stop]

    @functools.cached_property
    def first_block_hash(self) -> int | None:
        """prompt_block_hashes[0] (None: no whole block), for ~1/300 of a 9k-token prompt's
        hashing: prompts differing in their first block share no block's prefix."""
        if "prompt_block_hashes" in self.__dict__:
            hashes = self.prompt_block_hashes
            return hashes[0] if hashes else None
        ids = self.prompt_token_ids
        return _chain_block_hash(0, ids, 0) if len(ids) >= PROMPT_HASH_BLOCK else None

    @functools.cached_property
    def prompt_block_hashes(self) -> list[int]:
        """hashes[k] identifies prompt[:BLOCK * (k + 1)]: equal hashes, equal prefixes (up to
        hash collisions), compared in O(1) where a token-by-token compare costs O(length)."""
        hashes, h = [], 0
        ids = self.prompt_token_ids
        for start in range(0, len(ids) - PROMPT_HASH_BLOCK + 1, PROMPT_HASH_BLOCK):
            h = _chain_block_hash(h, ids, start)
            hashes.append(h)
        return hashes

    @property
    def prompt_logprobs_owed(self) -> bool:
        """It asked for prompt logprobs and some are not processed yet."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1)

    @property
    def max_cached_prefix(self) -> int:
        """Leading input tokens whose KV admission may take from the prefix cache: all but the
        last (its logits are sampled), and none whose logits still owe a prompt logprob: those
        rows are recomputed (row p scores token p + 1, and prompt_logprobs[p - 1] is owed)."""
        most = len(self.prompt_token_ids) + len(self.output_token_ids) - 1  # len(fill_ids) - 1, no copy
        return min(most, len(self.prompt_logprobs)) if self.prompt_logprobs_owed else most

    def prompt_logprob_span(self, start: int, n: int) -> tuple[int, int] | None:
        """The positions [a, b) of a prefill row over [start, start + n) whose logits give
        prompt logprobs still owed (position p scores prompt token p + 1). Processed entries
        lie below every row of this admission that is still to be planned, so the row's own
        start bounds the span too; the last prompt position scores no prompt token."""
        if not self.prompt_logprobs_owed:
            return None
        a, b = max(start, len(self.prompt_logprobs)), min(start + n, len(self.prompt_token_ids) - 1)
        return (a, b) if a < b else None

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= self.prefill_target

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def can_decode(self) -> bool:
        return (self.status is Status.RUNNING and self.prefill_done
                and self.num_scheduled_samples < self.max_samples)
