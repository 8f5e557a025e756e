"""`speculative_config`: what the user asks for (vLLM's keys), checked once at engine build."""
from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
KNOWN_KEYS = frozenset({"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                        "disable_by_batch_size"})
MAX_SPECULATIVE_TOKENS = 16
# Verify steps past this many decoding rows cost more than they save (issue 20: the crossover
# is measured on the H200; the spec-verify bench has verify/decode 1.17 at 1 row, 1.50 at 16
# and 3.02 at 64 for the 8B shape, so at 32 rows a proposal must be accepted about twice per
# step to pay).
DEFAULT_DISABLE_BY_BATCH_SIZE = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" (prompt lookup over the request's own tokens) or "draft_model"
    num_speculative_tokens: int  # k: proposals verified per step and row
    prompt_lookup_max: int = 4  # ngram: the longest suffix matched
    prompt_lookup_min: int = 1  # ngram: the shortest
    model: str | None = None  # draft_model: its checkpoint (the target's tokenizer)
    # Steps with more decoding rows than this verify no proposals (plain decoding).
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @staticmethod
    def from_user(value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A dict (LLM's keyword), a JSON object (the --speculative-config flag) or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or JSON object), got {type(value).__name__}")
        unknown = sorted(set(value) - KNOWN_KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(sorted(KNOWN_KEYS))}")
        method = value.get("method", "draft_model" if value.get("model") is not None else None)
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)} "
                             f"(or give 'model' for a draft model); got {method!r}")
        k = _int(value, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
        cfg = SpeculativeConfig(
            method, k, prompt_lookup_max=_int(value, "prompt_lookup_max", 4, 1, 64),
            prompt_lookup_min=_int(value, "prompt_lookup_min", 1, 1, 64), model=value.get("model"),
            disable_by_batch_size=_int(value, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE, 1, 1 << 20))
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({cfg.prompt_lookup_min}) must not "
                             f"exceed prompt_lookup_max ({cfg.prompt_lookup_max})")
        if method == "draft_model":
            if not isinstance(cfg.model, str) or not cfg.model:
                raise ValueError("speculative_config: method 'draft_model' needs 'model' (a checkpoint path)")
            lookup = sorted({"prompt_lookup_max", "prompt_lookup_min"} & set(value))
            if lookup:
                raise ValueError(f"speculative_config: {', '.join(lookup)} are for method 'ngram', not 'draft_model'")
        elif cfg.model is not None:
            raise ValueError("speculative_config: 'model' is for method 'draft_model', not 'ngram'")
        return cfg


def _int(value: dict, key: str, default: int | None, low: int, high: int) -> int:
    if key not in value:
        if default is None:
            raise ValueError(f"speculative_config: {key!r} is required")
        return default
    v = value[key]
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise ValueError(f"speculative_config: {key} must be an integer in [{low}, {high}], got {v!r}")
    return v
