"""SamplingParams: one request's sampling settings, validated at construction."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

MAX_LOGPROBS = 20
_CONSTRAINTS = ("json_schema", "regex", "grammar", "choice")
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
# Below this a temperature is greedy: logits / 1e-38 overflow float32 (and sampling that
# cold is argmax anyway). vLLM draws the same line.
GREEDY_TEMPERATURE = 1e-5
# top_k travels as int64 and bounds a torch.topk; anything past int32 is "the whole vocab".
_MAX_TOP_K = 2**31 - 1
_INT64 = 2**63
# Stop conditions are matched every step for every request: bound what one request brings.
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


def _is_int(x: object) -> bool:
    # bool is an int subclass; True as max_tokens is a caller bug, not 1.
    return isinstance(x, int) and not isinstance(x, bool)


def check_unicode(text: str, name: str) -> None:
    """Text must be encodable: a lone surrogate ("\\ud800", legal in JSON escapes and Python
    str) is not, and would fail later inside the tokenizer or the wire encoder."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} contains a lone surrogate {text[exc.start]!r} at index {exc.start}; "
                         "text must be valid Unicode") from None


def _is_real(x: object) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


@dataclass
class SamplingParams:
    """vLLM's field names and meanings. `max_tokens=None` generates up to the context's end;
    `n` / `best_of` are expanded into separate engine requests by the caller (`LLM.generate`,
    the server): the engine itself runs one sequence per request. `prompt_logprobs=k` scores the
    prompt (each token after the first: its logprob, rank and the top k); a request asking for
    them takes no prefix-cache hit on the positions it still owes (the cached part is
    recomputed, see `Request.max_cached_prefix`)."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    # Structured output (at most one): the grammar engine masks every sampled token.
    json_schema: dict | str | None = None  # a JSON Schema, as a dict or a JSON string
    regex: str | None = None
    grammar: str | None = None  # EBNF, as xgrammar reads it
    choice: list[str] | None = None  # the output is exactly one of these strings
    n: int = 1
    best_of: int | None = None  # sample best_of, return the n with the highest cumulative logprob
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens exist
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    bad_words: list[str] | None = None  # words never generated

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be None or an int >= 1, got {self.max_tokens!r}")
        self._real("temperature", lo=0.0, rule=">= 0 (0 means greedy)")
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        self._real("top_p", lo=0.0, lo_open=True, hi=1.0, rule="in (0, 1]")
        if not _is_int(self.top_k) or not (self.top_k == -1 or 1 <= self.top_k <= _MAX_TOP_K):
            raise ValueError(
                f"top_k must be -1 (disabled) or an int in [1, 2**31) (0 is not accepted as "
                f"'disabled'), got {self.top_k!r}"
            )
        self._real("min_p", lo=0.0, hi=1.0, rule="in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")
        self.stop = self._stop_strings(self.stop)
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and 0 <= t < _INT64 for t in ids):
                raise ValueError(f"stop_token_ids must be None or a list of ints in [0, 2**63), got {ids!r}")
            if len(ids) > MAX_STOP_TOKEN_IDS:
                raise ValueError(f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
            self.stop_token_ids = list(ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        self._real("repetition_penalty", lo=0.0, lo_open=True, rule="> 0 (1 means off)")
        self._real("presence_penalty", lo=-2.0, hi=2.0, rule="in [-2, 2]")
        self._real("frequency_penalty", lo=-2.0, hi=2.0, rule="in [-2, 2]")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        self._check_samples()
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.logit_bias = self._bias(self.logit_bias)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be None or a list of non-blank str, got {self.bad_words!r}")
            for w in self.bad_words:  # the tokenizer cannot encode a lone surrogate
                check_unicode(w, "bad_words")
            self.bad_words = list(self.bad_words)
        self._check_constraint()

    def _check_constraint(self) -> None:
        """Shape checks only; the grammar engine parses the spec when the engine admits it."""
        given = [n for n in _CONSTRAINTS if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one of {', '.join(_CONSTRAINTS)} may be set; got {', '.join(given)}")
        if isinstance(self.json_schema, str):
            try:
                self.json_schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            except RecursionError:  # past ~1000 levels; the grammar's own limit is far lower
                raise ValueError("json_schema nests too deeply to parse as JSON") from None
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(f"json_schema must be a JSON object (dict or JSON string), got {self.json_schema!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and v):
                raise ValueError(f"{name} must be None or a non-empty str, got {v!r}")
        if self.choice is not None:
            c = self.choice
            if not isinstance(c, (list, tuple)) or not c or not all(isinstance(x, str) and x for x in c):
                raise ValueError(f"choice must be a non-empty list of non-empty str, got {c!r}")
            self.choice = list(c)

    def _check_samples(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(f"best_of must be None or an int >= n ({self.n}), got {self.best_of!r}")

    @staticmethod
    def _bias(bias: object) -> dict[int, float] | None:
        """Keys may be ints or decimal strings (JSON object keys are strings)."""
        if not bias:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be None or a dict of token id -> number, got {bias!r}")
        out = {}
        for key, value in bias.items():
            try:
                token = int(key) if not isinstance(key, bool) else -1
            except (TypeError, ValueError):
                token = -1
            if token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {key!r}")
            if not _is_real(value) or abs(value) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for {key!r}")
            out[token] = float(value)
        return out

    def _real(
        self, name: str, *, lo: float, hi: float | None = None, lo_open: bool = False, rule: str
    ) -> None:
        v = getattr(self, name)
        ok = _is_real(v) and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
        if not ok:
            raise ValueError(f"{name} must be a finite number {rule}, got {v!r}")
        setattr(self, name, float(v))

    @staticmethod
    def _stop_strings(stop: object) -> list[str] | None:
        if stop is None:
            return None
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
            raise ValueError(f"stop must be None, a non-empty str or a list of non-empty str, got {stop!r}")
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(items)} strings; at most {MAX_STOP_STRINGS} are allowed")
        for s in items:
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of {len(s)}")
            check_unicode(s, "stop")
        return list(items)

    # Host-side facts the scheduler uses to pick which batch-wide operations run.
    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_top_k(self) -> bool:
        return not self.is_greedy and self.top_k != -1

    @property
    def uses_top_p(self) -> bool:
        return not self.is_greedy and self.top_p < 1.0

    @property
    def uses_min_p(self) -> bool:
        return not self.is_greedy and self.min_p > 0.0

    @property
    def uses_penalties(self) -> bool:
        # Penalties change the argmax too, so greedy rows use them.
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def num_samples(self) -> int:
        """How many sequences one prompt runs: best_of if given, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, spec text) of the structured-output constraint: the grammar cache's key."""
        if self.json_schema is not None:
            return "json_schema", json.dumps(self.json_schema)  # key order kept: it is the output order
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        for kind in ("regex", "grammar"):
            if getattr(self, kind) is not None:
                return kind, getattr(self, kind)
        return None

    @property
    def stop_tokens(self) -> list[int]:
        return list(self.stop_token_ids or [])

    def samples(self) -> list["SamplingParams"]:
        """One params per sequence to run (n, or best_of): sequence i uses seed + i, so a
        seeded request is reproducible and its sequences differ. best_of > n needs each
        sequence's cumulative logprob to rank them, so those compute the chosen token's logprob.
        Prompt logprobs are the same for every sequence: only the first computes them."""
        if self.num_samples == 1:
            return [self]
        ranked = self.best_of is not None and self.best_of > self.n
        logprobs = 0 if ranked and self.logprobs is None else self.logprobs
        return [self.clone(n=1, best_of=None, logprobs=logprobs,
                           prompt_logprobs=self.prompt_logprobs if i == 0 else None,
                           seed=self.seed if self.seed is None or i == 0 else (self.seed + i) % 2**63)
                for i in range(self.num_samples)]

    def clone(self, **changes: object) -> "SamplingParams":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)


