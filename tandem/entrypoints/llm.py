"""The offline API: `LLM(...).generate(prompts, params)` and `.chat(messages, params)`, at
vLLM's shapes: str, token-id and dict prompts, `list[dict[int, Logprob]]` logprobs, vLLM's
constructor names where tandem has their meaning (`tandem.options.llm_config`)."""
import dataclasses
import logging
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from tqdm import tqdm

from tandem.chat_template import render_chat, text_content
from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.entrypoints.ranks import build_engine
from tandem.entrypoints.interrupts import interrupts_between_steps
from tandem.options import llm_config
from tandem.outputs import RequestOutput, SampleLogprobs, TokenLogprob, prompt_logprobs, sample_logprobs
from tandem.sampling import SamplingParams
from tandem.text import NamedIds, TextAtEnd, TokenNames, decodes_with_backend, texts_at_end

# vLLM's PromptType, text only: a str, token ids, {"prompt": str} or {"prompt_token_ids": [...]}.
Prompt = str | list[int] | dict[str, Any]
Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **options):
        """`options`: the fields of `tandem.config.EngineConfig` (the command lines' engine
        flags, same names and defaults), `launch` and `experiments`; and vLLM's names for
        them (`max_num_seqs`, `enforce_eager`, ...: `tandem.options.VLLM_NAMES`)."""
        self._start(build_engine(llm_config(model, options)))

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "LLM":
        """An LLM over the engine of a whole configuration (the command lines' engine flags,
        as `tandem bench` reads them with `tandem.options.engine_config`)."""
        llm = cls.__new__(cls)
        llm._start(build_engine(cfg))
        return llm

    def _start(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._names = TokenNames(engine.tokenizer)  # logprobs' decoded_token
        # Texts are made once the requests ended, in one batch decode (texts_at_end), not step by
        # step between two forwards; only a tokenizer the Rust backend decodes makes that cheaper.
        self._texts_at_end = decodes_with_backend(engine.tokenizer)
        _finalize_with_engine(engine)

    def get_tokenizer(self) -> Any:
        """The tokenizer the engine uses (a transformers tokenizer; None for a model without one)."""
        return self.tokenizer

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
                        groups[-1].append(engine.add_request(prompt.engine_input, seq,
                                                             detokenize=not self._texts_at_end))
                text_ids = self._run(sum(len(g) for g in groups), use_tqdm, check_interrupt)
                sequences = self._with_texts([[engine.output(rid) for rid in g] for g in groups], params, text_ids)
                outputs = [self._merge(seqs, sp, p) for seqs, sp, p in zip(sequences, params, prompts)]
            finally:
                if not engine.dead:  # a dead CUDA context (or worker) must not be touched again
                    engine.cancel([rid for g in groups for rid in g])  # on error too: nothing leaked
        return outputs  # a request whose step failed has finish_reason 'error' (the engine logs why)

    def _run(self, num_sequences: int, use_tqdm: bool, check_interrupt) -> dict[str, NamedIds]:
        """Step until every request ended; returns the ids each request's outputs named for its
        text (`StepOutput.text_ids`, requests the engine makes no text for), output by output."""
        engine = self.engine
        bar = tqdm(total=num_sequences, desc="generate", unit="seq", dynamic_ncols=True,
                   disable=not use_tqdm or num_sequences < 2)
        tokens, start = 0, time.perf_counter()
        text_ids: dict[str, NamedIds] = defaultdict(NamedIds)
        while engine.has_unfinished():
            check_interrupt()  # Ctrl-C lands here, between steps
            finished = 0
            for out in engine.step():
                tokens += len(out.new_token_ids)
                finished += out.finished
                if out.text_ids is not None:
                    text_ids[out.request_id].add(out.text_ids)
            bar.update(finished)
            if not bar.disable:
                bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.0f} tok/s", refresh=False)
        bar.close()
        return text_ids

    def _with_texts(self, groups: list[list[RequestOutput]], params: list[SamplingParams],
                    text_ids: dict[str, NamedIds]) -> list[list[RequestOutput]]:
        """Each prompt's sequences with the texts the engine left to this caller (requests
        without stop strings), all made in one batch from the ids they named: the texts the
        engine would have streamed."""
        if not self._texts_at_end:
            return groups
        left = [(o, sp) for outs, sp in zip(groups, params) if not sp.stop for o in outs]
        texts = texts_at_end(self.tokenizer, [
            TextAtEnd(o.prompt_token_ids, text_ids.get(o.request_id, NamedIds()), sp.skip_special_tokens,
                      ended=o.outputs[0].finish_reason != "error") for o, sp in left], self.engine.token_pieces)
        made = {id(o): dataclasses.replace(o, outputs=[dataclasses.replace(o.outputs[0], text=t)])
                for (o, _), t in zip(left, texts)}
        return [[made.get(id(o), o) for o in outs] for outs in groups]

    def reset_prefix_cache(self) -> int:
        """Drop every cached prompt prefix no running request uses; returns the KV slots freed."""
        return self.engine.reset_prefix_cache()

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate.
        vLLM's keywords: `chat_template` replaces the model's template, `tools` (OpenAI
        function specs) and `chat_template_kwargs` reach the template, `continue_final_message`
        (with add_generation_prompt=False) extends the last assistant message. Tool calls in
        the reply are text, as in vLLM's offline chat."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [render_chat(self.tokenizer, _plain_messages(c), add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools,
                               chat_template=chat_template, template_kwargs=chat_template_kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: Conversation, add_generation_prompt: bool = True) -> list[int]:
        return render_chat(self.tokenizer, _plain_messages(conversation), add_generation_prompt=add_generation_prompt)

    def _merge(self, outs: list[RequestOutput], sp: SamplingParams, prompt: "_Prompt") -> RequestOutput:
        """A prompt's sequences as one output: all n, or the n best of best_of by cumulative
        logprob; logprobs in vLLM's shape."""
        seqs = [o.outputs[0] for o in outs]
        if len(seqs) > sp.n:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:sp.n]
        seqs = [dataclasses.replace(s, index=i, logprobs=self._logprobs(s.logprobs, sp))
                for i, s in enumerate(seqs)]
        first = outs[0]  # the sequence that computed the prompt logprobs (SamplingParams.samples)
        prompt_lps = prompt_logprobs(first.prompt_logprobs, self._names) if first.prompt_logprobs else None
        # Summed over the sequences: with the prefix cache, n samples prefill their prompt once.
        return RequestOutput(first.request_id, prompt.text if prompt.text is not None else first.prompt,
                             first.prompt_token_ids, seqs, prompt_lps, num_preemptions=sum(o.num_preemptions for o in outs),
                             num_cached_tokens=sum(o.num_cached_tokens for o in outs))

    def _logprobs(self, lps: list[TokenLogprob] | None, sp: SamplingParams) -> SampleLogprobs | None:
        # best_of computes them for the ranking alone: not asked for, not returned.
        return sample_logprobs(lps, self._names) if lps is not None and sp.logprobs is not None else None


def _plain_messages(conversation: Conversation) -> Conversation:
    """Messages with OpenAI-style content parts joined into the string the templates read."""
    return [{**m, "content": text_content(m["content"])} if isinstance(m, dict) and "content" in m else m
            for m in conversation]


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


@dataclass
class _Prompt:
    engine_input: str | list[int]  # what the engine tokenizes, or the ids themselves
    text: str | None = None  # RequestOutput.prompt where the caller gave both text and ids


# vLLM's prompt keys that tandem cannot serve, and why.
_REFUSED_PROMPT_KEYS = {
    "multi_modal_data": "this model accepts text only",
    "mm_processor_kwargs": "this model accepts text only",
    "multi_modal_uuids": "this model accepts text only",
    "prompt_embeds": "tandem takes text or token ids, not embeddings",
    "cache_salt": "tandem's prefix cache is shared by every request; it takes no salt",
    "encoder_prompt": "tandem runs decoder-only models",
    "decoder_prompt": "tandem runs decoder-only models",
}


def _as_prompt_list(prompts) -> list[_Prompt]:
    if isinstance(prompts, (str, dict)):
        return [_as_prompt(prompts)]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        raise TypeError("pass token ids as a list of lists: [[1, 2, 3]] (or [{'prompt_token_ids': [1, 2, 3]}])")
    return [_as_prompt(p) for p in prompts]


def _as_prompt(p: Prompt) -> _Prompt:
    if isinstance(p, (str, list)):
        return _Prompt(p)
    if not isinstance(p, dict):
        raise TypeError(f"a prompt must be a str, a list of token ids or a dict with 'prompt' or "
                        f"'prompt_token_ids', got {type(p).__name__}")
    for key in p.keys() & _REFUSED_PROMPT_KEYS.keys():
        if p[key] is not None:
            raise ValueError(f"prompt key {key!r}: {_REFUSED_PROMPT_KEYS[key]}")
    unknown = p.keys() - _REFUSED_PROMPT_KEYS.keys() - {"prompt", "prompt_token_ids"}
    if unknown:
        raise ValueError(f"unknown prompt keys {sorted(unknown)}; a prompt dict has 'prompt' (text) or "
                         "'prompt_token_ids' (a list of ints)")
    text, ids = p.get("prompt"), p.get("prompt_token_ids")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"'prompt' must be a str, got {type(text).__name__}")
    if ids is not None:  # vLLM's order: token ids win over the text
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise TypeError("'prompt_token_ids' must be a list of ints")
        return _Prompt(ids, text)
    if text is None:
        raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (a list of ints)")
    return _Prompt(text)


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
