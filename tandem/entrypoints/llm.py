"""The offline API: `LLM(...).generate(prompts, params)` and `.chat(messages, params)`."""
import dataclasses
import difflib
import logging
import time
import weakref
from typing import Sequence

import torch
from tqdm import tqdm

from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.entrypoints.ranks import build_engine
from tandem.entrypoints.interrupts import interrupts_between_steps
from tandem.outputs import RequestOutput
from tandem.sampling import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **options):
        """`options`: the fields of `tandem.config.EngineConfig` (the command lines' engine
        flags, same names and defaults), plus `launch` and `experiments`."""
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        for key in options.keys() - known:
            close = difflib.get_close_matches(key, known, 1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"LLM() got an unknown option {key!r}{hint}")
        self.engine = engine = build_engine(EngineConfig(model=model, **options))
        self.tokenizer = engine.tokenizer
        _finalize_with_engine(engine)

    def close(self) -> None:
        """Release the engine: its device memory, graphs and buffers, also for whoever else
        holds `llm.engine` (it is closed for them too). Idempotent."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order; its `.outputs` holds the n sequences.

        n (and best_of) run as separate engine requests of the same prompt, admitted
        together, so a prefix cache serves the prompt's KV to all of them."""
        engine = self.engine
        if engine.closed:
            raise RuntimeError("this LLM is closed (close() or the end of its with-block); create a new one")
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        groups: list[list[str]] = []
        with interrupts_between_steps() as check_interrupt:
            try:
                for prompt, sp in zip(prompts, params):
                    groups.append([])  # before adding: a failure part-way still cancels what was added
                    for seq in sp.samples():
                        groups[-1].append(engine.add_request(prompt, seq))
                self._run(sum(len(g) for g in groups), use_tqdm, check_interrupt)
                outputs = [_merge([engine.output(rid) for rid in g], sp) for g, sp in zip(groups, params)]
            finally:
                if not engine.dead:  # a dead CUDA context (or worker) must not be touched again
                    engine.cancel([rid for g in groups for rid in g])  # on error too: nothing leaked
        return outputs  # a request whose step failed has finish_reason 'error' (the engine logs why)

    def _run(self, num_sequences: int, use_tqdm: bool, check_interrupt) -> None:
        engine = self.engine
        bar = tqdm(total=num_sequences, desc="generate", unit="seq", dynamic_ncols=True,
                   disable=not use_tqdm or num_sequences < 2)
        tokens, start = 0, time.perf_counter()
        while engine.has_unfinished():
            check_interrupt()  # Ctrl-C lands here, between steps
            outs = engine.step()
            tokens += sum(len(o.new_token_ids) for o in outs)
            bar.update(sum(o.finished for o in outs))
            if not bar.disable:
                bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.0f} tok/s", refresh=False)
        bar.close()

    def reset_prefix_cache(self) -> int:
        """Drop every cached prompt prefix no running request uses; returns the KV slots freed."""
        return self.engine.reset_prefix_cache()

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True) -> list[int]:
        ids = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, return_dict=False)
        return list(ids)


def _finalize_with_engine(engine: Engine) -> None:
    """The engine lives as long as anyone holds it, the LLM or not (`engine = LLM(...).engine`
    keeps working). An engine has no reference cycles, so dropping its last holder frees its
    memory at once; this finalizer, tied to the engine's lifetime and holding no reference to
    it, does the rest of close(). Not at interpreter exit: the process gives it all back."""
    finalizer = weakref.finalize(engine, _after_engine, engine.parallel, engine.fatal, engine.device)
    finalizer.atexit = False


def _after_engine(parallel, fatal, device: torch.device) -> None:
    """Once an engine is gone without close(): stop its tensor-parallel workers and hand cached
    device memory back (never on a context a sticky error poisoned)."""
    parallel.close()
    if device.type == "cuda" and not fatal.dead and parallel.failure is None:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _merge(outs: list[RequestOutput], sp: SamplingParams) -> RequestOutput:
    """A prompt's sequences as one output: all n, or the n best of best_of by cumulative logprob."""
    seqs = [o.outputs[0] for o in outs]
    if len(seqs) > sp.n:
        seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:sp.n]
        if sp.logprobs is None:  # computed only for the ranking
            seqs = [dataclasses.replace(s, logprobs=None) for s in seqs]
    first = outs[0]
    # Summed over the sequences: with the prefix cache, n samples prefill their prompt once.
    return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids,
                         [dataclasses.replace(s, index=i) for i, s in enumerate(seqs)],
                         num_preemptions=sum(o.num_preemptions for o in outs),
                         num_cached_tokens=sum(o.num_cached_tokens for o in outs))


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        raise TypeError("pass token ids as a list of lists: [[1, 2, 3]]")
    for p in prompts:
        if not isinstance(p, (str, list)):
            raise TypeError(f"a prompt must be a str or a list of token ids, got {type(p).__name__}")
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if isinstance(params, dict) or isinstance(params, (str, bytes)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                        f"{type(params).__name__}; build one with SamplingParams(**...)")
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got a {type(p).__name__} in the list")
    return params


logging.getLogger("tandem").addHandler(logging.NullHandler())
