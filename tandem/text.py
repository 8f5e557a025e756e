"""Turning a request's generated token ids into streamed text, with stop strings.

Two stages, fed a few ids at a time:

* ``_IncrementalDecoder`` decodes a short window of ids (the prefix_offset /
  read_offset technique of vLLM and TGI) and returns only the new text, holding
  back a trailing incomplete UTF-8 character until its last byte arrives.
* ``_StopMatcher`` finds stop strings in that text and holds back any tail that
  could still grow into one.

``RequestText`` ties them together for the engine.

Semantics worth knowing:

* The last few prompt tokens are decoded with the generated ones as context, so
  the generated text is what ``decode(prompt + generated)`` shows after the
  prompt. For byte-level BPE this equals ``decode(generated)``; for
  SentencePiece-style tokenizers it keeps the first generated token's leading
  space (``decode(generated)`` alone would strip it, as at the start of any text).
* A stop string matches at the earliest point where one is complete: the first
  occurrence with the smallest end, the longest one on ties. This is the only
  rule that gives the same answer however the text is split into steps.
* ``clean_up_tokenization_spaces`` is never applied: it rewrites text across
  token boundaries and corrupts code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

# Prompt tokens decoded in front of the first generated ones, for their spacing.
_PROMPT_CONTEXT = 5
# A character is at most 4 bytes and every text-bearing token carries at least
# one, so in valid text a clean token boundary (decoding with no trailing
# U+FFFD) is rarely more than 4 tokens back. A longer held tail means the clean
# boundaries fell inside multi-token calls (look back for one) or invalid bytes.
_MAX_CHAR_TOKENS = 4
# Look-back attempts that found nothing wait this many ids before the next one.
_RETRY_AFTER = 16
# The window decoder hands a push back to a new stream once its text ends on a whole character
# and it has decoded at least this many ids (`_StreamDecoder`): each of its ids costs a Rust
# decode of the window, a new stream a few. 4, not 16: with a dummy model's ids, which wander
# over the vocabulary and end inside a character often, rows spent most steps in the window
# (256 rows on the CPU box: the result's host time 0.37 -> 0.30 ms a step).
_STREAM_RETRY_AFTER = 4
# A tail held this long is invalid bytes that nothing will complete: release it.
_MAX_HELD_TOKENS = 32
_REPLACEMENT = "\ufffd"


# The decoding methods a tokenizer subclass may override; if it overrides none, its `decode`
# is exactly the Rust backend's decode (plus the clean-up that is never applied here).
_DECODING_METHODS = ("decode", "_decode", "convert_tokens_to_string")


def decodes_with_backend(tokenizer: Any) -> bool:
    """Is `tokenizer.decode(ids, skip_special_tokens=s, clean_up_tokenization_spaces=False)`
    the same as its Rust backend's `decode(ids, skip_special_tokens=s)`?

    True for a transformers fast tokenizer whose class (and instance) inherits every decoding
    method from the stock fast-tokenizer classes (PreTrainedTokenizerFast, which transformers
    5 names TokenizersBackend, and its bases). A subclass overriding any of them may decode
    differently, so it keeps the slow path.
    """
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return False
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return False
    stock = set(PreTrainedTokenizerFast.__mro__)
    for name in _DECODING_METHODS:
        if name in vars(tokenizer):  # patched on the instance
            return False
        owner = next((c for c in type(tokenizer).__mro__ if name in vars(c)), None)
        if owner not in stock:
            return False
    return getattr(tokenizer, "_tokenizer", None) is not None


def ids_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """A function decoding a list of ids to text without clean-up, same text as `decode`.

    The streaming decoder calls it once or twice per generated token; transformers' `decode`
    spends most of that time in Python layers (argument conversion, batch detection,
    kwargs plumbing) around one Rust call, so a stock fast tokenizer calls the Rust
    backend directly (about 2x faster per token).
    """
    if decodes_with_backend(tokenizer):
        backend = tokenizer._tokenizer  # what `backend_tokenizer` returns, without the property
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def _prompt_context(decode: Callable[[list[int]], str], prompt: list[int]) -> tuple[list[int], str]:
    """The last few prompt ids and their text, starting and ending on whole characters.

    A context cut mid-character decodes to U+FFFD, which byte-fallback
    decoders spread over the whole byte run (generated bytes included); one
    ending mid-character would be rewritten by the generated bytes.
    """
    n = len(prompt)
    for start in [*range(n - _PROMPT_CONTEXT, n), *range(n - _PROMPT_CONTEXT - 1, n - 3 * _PROMPT_CONTEXT, -1)]:
        if start >= 0:
            text = decode(prompt[start:])
            if _REPLACEMENT not in text:
                return prompt[start:], text
    return [], ""  # no clean context: decode the generated ids on their own


@dataclass
class TextDelta:
    text: str  # new text that is now safe to show the user (may be "")
    stop: str | None  # the stop string that matched, if one did; the request must finish


class _IncrementalDecoder:
    """Decodes ids into text, O(window) per call, never ending mid-character.

    ids[prefix_offset:read_offset] is context whose text was already returned;
    each call decodes ids[prefix_offset:] and returns what lies past it. The
    window slides when the decoded text ends on a whole character.

    Exact (equal to one full decode) whenever the generated bytes are valid
    UTF-8. Invalid bytes still come out as U+FFFD, though where a byte-fallback
    decoder would turn a whole byte run into U+FFFD retroactively the count may
    differ.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool,
                 decode_ids: Callable[[list[int]], str] | None = None):
        """`decode_ids`: `ids_decoder(tokenizer, skip_special_tokens)` where the caller has it
        (a stream decoder handing a push over: the tokenizer's class need not be checked again)."""
        self._decode_ids = decode_ids or ids_decoder(tokenizer, skip_special_tokens)
        self._ids, self._prefix_text = _prompt_context(self._decode_ids, list(prompt_token_ids))
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._returned = 0  # chars past prefix_text already returned from this window
        self._clean_at = len(self._ids)  # last token boundary known to decode cleanly
        self._look_back_at = 0  # len(ids) from which a look-back may run again

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._decode_ids(self._ids[start:end])

    def push_one(self, token: int) -> str:
        return self.push((token,))

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        n = len(self._ids)
        text = self._decode(self._prefix_offset)
        if not text.endswith(_REPLACEMENT):
            self._clean_at = n
            return self._take(text, n)
        # Appending bytes only changes the trailing incomplete sequence (UTF-8
        # self-synchronises), so what precedes it is final. Strip every trailing
        # U+FFFD: byte-fallback decoders give one per byte of an unfinished run.
        new = self._take(text.rstrip(_REPLACEMENT), None)
        if n - self._clean_at > _MAX_CHAR_TOKENS and n >= self._look_back_at:
            new += self._take_to_clean_boundary()
        if n - self._clean_at >= _MAX_HELD_TOKENS:
            self._clean_at = n
            new += self._take(self._decode(self._prefix_offset), n)
        return new

    def _take(self, text: str, end: int | None) -> str:
        """Return text past what was returned; text decodes ids[prefix_offset:end].

        With an end, that boundary is clean and the window slides to it, unless
        nothing past the context decoded yet (a skipped special token must stay
        in the window so the next token's leading space decodes right).
        """
        done = len(self._prefix_text) + self._returned
        new = text[done:]
        self._returned += len(new)
        if end is not None and len(text) > len(self._prefix_text):
            self._prefix_offset, self._read_offset = self._read_offset, end
            self._prefix_text = self._decode(self._prefix_offset, end)
            self._returned = done + len(new) - len(text)  # chars past end already returned
        return new

    def _take_to_clean_boundary(self) -> str:
        # The call that completed a character also started the next one; find
        # the boundary between them so a held window stays short.
        n = len(self._ids)
        for end in range(n - 1, max(self._read_offset, n - 2 * _MAX_CHAR_TOKENS), -1):
            head = self._decode(self._prefix_offset, end)
            if not head.endswith(_REPLACEMENT) and len(head) > len(self._prefix_text):
                self._clean_at = end
                return self._take(head, end)
        self._look_back_at = n + _RETRY_AFTER
        return ""

    def flush(self) -> str:
        """Text still held back (a never-completed character), as the full decode shows it."""
        return self._take(self._decode(self._prefix_offset), None)

    @property
    def ends_on_whole_character(self) -> bool:
        """Every id's text is returned: the last push ended on a whole character."""
        return self._clean_at == len(self._ids)

    def last_ids(self, n: int) -> list[int]:
        return self._ids[-n:]


def _decode_stream_type() -> type | None:
    """tokenizers' DecodeStream (0.21 and later), or None."""
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    return DecodeStream


class TokenPieces:
    """Token id -> the text it adds after a whole character, shared by an engine's requests.

    For a tokenizer whose decoder is byte-level BPE's alone (GPT-2, Llama 3, Qwen, SmolLM2), the
    text of ids is the UTF-8 of their bytes joined, so after a whole-character boundary an id whose
    bytes are whole characters adds its own text, whatever came before. The stream decoder learns
    each id's text the first time it decodes it at such a boundary (one table per
    skip_special_tokens: a special id shows its text only when specials are kept) and from then on
    looks it up: in a busy step the Rust call costs ~2 us an id (its tables cold after the forward),
    the lookup ~0.1.
    """

    def __init__(self) -> None:
        self._tables: dict[bool, dict[int, str]] = {True: {}, False: {}}

    def table(self, skip_special_tokens: bool) -> dict[int, str]:
        return self._tables[skip_special_tokens]


def token_pieces(tokenizer: Any) -> TokenPieces | None:
    """A table for the tokenizer if its ids' texts join as bytes (a byte-level decoder alone,
    decoded by the Rust backend); None otherwise (SentencePiece decoders strip a leading space
    at the start of a text: an id's text depends on what precedes it)."""
    if tokenizer is None or not decodes_with_backend(tokenizer) or _decode_stream_type() is None:
        return None
    return TokenPieces() if _byte_level(tokenizer) else None


def _byte_level(tokenizer: Any) -> bool:
    """Its backend's decoder is byte-level BPE's alone: text is the UTF-8 of the ids' bytes."""
    from tokenizers.decoders import ByteLevel
    return type(tokenizer._tokenizer.decoder) is ByteLevel


class _StreamDecoder:
    """The same text as `_IncrementalDecoder`, for a tokenizer that decodes with its Rust
    backend: the backend's DecodeStream takes one call per id (~0.6 us a token against the
    window decoder's ~2.3 on the built-in tokenizer; at 256 decoding rows that was ~1.2 ms of
    the host's step).

    The stream returns an id's text once the text ends on a whole character. Where it returns
    nothing (an id that ends inside a character, or one with no text of its own, such as a
    skipped special token) or refuses (its prefix check), the window decoder takes the push over
    from where it began, a whole-character boundary: it releases what precedes an unfinished
    character at once and bounds runs of broken bytes, as it always did. Once its text ends on a whole character again,
    and at least _STREAM_RETRY_AFTER ids later, a new stream takes back over, primed with the last few ids.

    With a TokenPieces table, an id it knows adds its text without the stream. The stream then
    lags behind the ids; for the byte-level decoders the table is made for, that does not change
    what it returns next: every id it skipped ended on a whole character.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool,
                 stream_type: type, pieces: TokenPieces | None = None):
        self._tokenizer, self._skip, self._stream_type = tokenizer, skip_special_tokens, stream_type
        self._pieces = pieces.table(skip_special_tokens) if pieces is not None else None
        self._backend = tokenizer._tokenizer
        self._decode_ids = ids_decoder(tokenizer, skip_special_tokens)
        self._window: _IncrementalDecoder | None = None  # the window decoder while it decodes
        self._window_ids = 0  # ids it has decoded since it took over
        self._start_stream(_prompt_context(self._decode_ids, list(prompt_token_ids))[0])

    def _start_stream(self, context: list[int]) -> None:
        self._stream = self._stream_type(skip_special_tokens=self._skip)
        for token in context:  # primed: the context's text is the prompt's (or already returned)
            self._stream.step(self._backend, token)
        self._ids = context  # every id the stream took; each ended on a whole character

    def push_one(self, token: int) -> str:
        """`push([token])`: plain decoding appends one id a step, at every row of every step."""
        if self._window is not None:
            return self._push_window((token,))
        pieces = self._pieces
        text = pieces.get(token) if pieces is not None else None  # most ids: one lookup, no call
        if text is None:
            text = self._step(token)
        if text is None:
            return self._hand_to_window((token,), len(self._ids))
        self._ids.append(token)
        return text

    def push(self, token_ids: Sequence[int]) -> str:
        if self._window is not None:
            return self._push_window(token_ids)
        if len(token_ids) == 1:
            return self.push_one(token_ids[0])
        start, out = len(self._ids), []
        for token in token_ids:
            text = self._step(token)
            if text is None:
                return self._hand_to_window(token_ids, start)
            self._ids.append(token)
            out.append(text)
        return "".join(out)

    def _step(self, token: int) -> str | None:
        """The id's text; None where it ends inside a character or adds none (or the stream refused)."""
        pieces = self._pieces
        if pieces is not None:
            text = pieces.get(token)
            if text is not None:
                return text
        try:
            text = self._stream.step(self._backend, token)
        except Exception:  # noqa: BLE001 (its prefix check: the window decoder decodes the push)
            return None
        if text is not None and pieces is not None:
            pieces[token] = text  # decoded at a whole-character boundary: the id's own text
        return text

    def _hand_to_window(self, token_ids: Sequence[int], start: int) -> str:
        """The whole push goes to the window decoder, from the boundary where it began (every
        push the stream took ended on a whole character): the window decoder decodes the push's
        byte runs together, and looks back from its start. The stream is not used again."""
        del self._ids[start:]
        self._window = _IncrementalDecoder(self._tokenizer, self._ids[-3 * _PROMPT_CONTEXT:], self._skip,
                                           self._decode_ids)
        self._window_ids = 0
        return self._push_window(token_ids)

    def _push_window(self, token_ids: Sequence[int]) -> str:
        window = self._window
        text = window.push(token_ids)
        self._window_ids += len(token_ids)
        if self._window_ids >= _STREAM_RETRY_AFTER and window.ends_on_whole_character:
            self._window = None
            self._start_stream(_prompt_context(self._decode_ids, window.last_ids(3 * _PROMPT_CONTEXT))[0])
        return text

    def flush(self) -> str:
        """Text still held back (a never-completed character), as the full decode shows it."""
        return self._window.flush() if self._window is not None else ""


class _StopMatcher:
    """Cuts text at the first stop string; holds back what may become one.

    An Aho-Corasick automaton over the stop strings, its state carried across pushes: each
    character costs amortised O(1) however many stop strings there are. The state is the
    longest tail of the text seen that is a prefix of some stop string, which is exactly the
    text to hold back.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool):
        self._include = include_stop_str_in_output
        self._next: list[dict[str, int]] = [{}]  # trie edges per state; state 0 is the root
        self._depth = [0]
        self._word: list[str | None] = [None]  # the stop string ending at this state
        for s in dict.fromkeys(stop):
            self._insert(s)
        self._fail, self._out = self._links()
        self._state = 0
        # Text received but not released: the last depth[state] characters.
        self._pending = ""

    def _insert(self, word: str) -> None:
        state = 0
        for ch in word:
            nxt = self._next[state].get(ch)
            if nxt is None:
                nxt = len(self._next)
                self._next[state][ch] = nxt
                self._next.append({})
                self._depth.append(self._depth[state] + 1)
                self._word.append(None)
            state = nxt
        self._word[state] = word

    def _links(self) -> tuple[list[int], list[int | None]]:
        """Failure links (longest proper suffix that is a trie state) and output links (the
        longest stop string ending here: this state's own, else its failure chain's)."""
        fail, out = [0] * len(self._next), [None] * len(self._next)
        queue = list(self._next[0].values())
        for head in queue:  # breadth first: a state's failure state is shallower
            out[head] = head if self._word[head] is not None else out[fail[head]]
            for ch, child in self._next[head].items():
                f = fail[head]
                while f and ch not in self._next[f]:
                    f = fail[f]
                fail[child] = self._next[f].get(ch, 0)
                queue.append(child)
        return fail, out

    def _step(self, state: int, ch: str) -> int:
        while state and ch not in self._next[state]:
            state = self._fail[state]
        return self._next[state].get(ch, 0)

    def push(self, text: str) -> tuple[str, str | None]:
        if len(self._next) == 1:
            return text, None
        if self._state == 0 and self._next[0].keys().isdisjoint(text):
            # From the root, a character that starts no stop string leads back to the root:
            # nothing matches and nothing is held (one C-level check, not a Python loop).
            return text, None
        state, base = self._state, len(self._pending)
        for i, ch in enumerate(text):
            state = self._step(state, ch)
            hit = self._out[state]
            if hit is not None:  # smallest end; the longest stop string ending there
                s = self._word[hit]
                pending, end = self._pending + text, base + i + 1
                self._pending, self._state = "", 0
                return pending[: end if self._include else end - len(s)], s
        self._state = state
        pending = self._pending + text
        cut = len(pending) - self._depth[state]
        self._pending = pending[cut:]
        return pending[:cut], None

    def flush(self) -> str:
        out, self._pending, self._state = self._pending, "", 0
        return out


def _decoder(tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool,
             pieces: TokenPieces | None) -> _StreamDecoder | _IncrementalDecoder:
    """The Rust backend's stream where the tokenizer decodes with its backend; else the window decoder."""
    stream_type = _decode_stream_type() if decodes_with_backend(tokenizer) else None
    if stream_type is None:
        return _IncrementalDecoder(tokenizer, prompt_token_ids, skip_special_tokens)
    return _StreamDecoder(tokenizer, prompt_token_ids, skip_special_tokens, stream_type, pieces)


class RequestText:
    """Text output of one request: feed generated ids, get safe-to-show deltas."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] | None = None,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        pieces: TokenPieces | None = None,
    ):
        """`pieces`: the engine's table from `token_pieces(tokenizer)`, shared by its requests."""
        if isinstance(stop, str):
            raise TypeError("stop must be a list of strings, not a string")
        stop = list(stop or ())
        if any(not isinstance(s, str) for s in stop):
            raise TypeError(f"stop strings must be str, got {stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        self._decoder = _decoder(tokenizer, prompt_token_ids, skip_special_tokens, pieces)
        # None without stop strings: most requests, whose every id would pass through a matcher for nothing.
        self._stops = _StopMatcher(stop, include_stop_str_in_output) if stop else None
        self._chunks: list[str] = []
        self._joined: str | None = ""
        self.matched_stop: str | None = None
        self.finished = False

    @property
    def text(self) -> str:
        """All text emitted so far; the final text once finished (joined on read: not per step)."""
        if self._joined is None:
            self._joined = "".join(self._chunks)
        return self._joined

    def _keep(self, text: str) -> str:
        if text:
            self._chunks.append(text)
            self._joined = None
        return text

    def _released(self, text: str) -> tuple[str, str | None]:
        """Decoded text through the stop strings: (the text released, the stop string that matched)."""
        stop = None
        if self._stops is not None:
            text, stop = self._stops.push(text)
            self.matched_stop = stop
        if text:  # `_keep`, inline: every row of every step
            self._chunks.append(text)
            self._joined = None
        return text, stop

    def append(self, token_ids: Sequence[int]) -> TextDelta:
        """Feed newly generated ids; the returned delta says whether a stop string matched.

        Ids arriving after a stop matched (the overlap loop's one-step lag) are
        ignored: nothing after a stop string is ever emitted.
        """
        if self.finished:
            raise RuntimeError("append() after finish()")
        if self.matched_stop is not None:
            return TextDelta("", None)
        return TextDelta(*self._released(self._decoder.push(token_ids)))

    def append_token(self, token: int) -> tuple[str, str | None]:
        """`append([token])` as (text, stop): plain decoding's one id a step, at every row of
        every step, with no list to wrap it and no delta to build."""
        if self.finished:
            raise RuntimeError("append() after finish()")
        if self.matched_stop is not None:
            return "", None
        return self._released(self._decoder.push_one(token))

    def finish(self) -> str:
        """The request ended: release held-back text and return it (idempotent)."""
        if self.finished:
            return ""
        self.finished = True
        if self.matched_stop is not None:
            return ""
        # The never-completed tail goes through stop matching like any other text.
        out, stop = self._released(self._decoder.flush())
        if stop is None and self._stops is not None:
            out += self._keep(self._stops.flush())
        return out


@dataclass
class NamedIds:
    """The ids a request's outputs named for its text (`StepOutput.text_ids`), as they came:
    flat, with each output's count kept only once one named other than one id (a verify step's
    run, a stop id left out), so a long offline job keeps one int a token."""

    ids: list[int] = field(default_factory=list)
    sizes: list[int] | None = None  # ids per output; None: one each

    def add(self, ids: list[int]) -> None:
        if self.sizes is None and len(ids) != 1:
            self.sizes = [1] * len(self.ids)  # every output before this one named one id
        self.ids.extend(ids)
        if self.sizes is not None:
            self.sizes.append(len(ids))

    def chunks(self) -> list[list[int]]:
        """Each output's ids, in order."""
        if self.sizes is None:
            return [[t] for t in self.ids]
        out, at = [], 0
        for n in self.sizes:
            out.append(self.ids[at:at + n])
            at += n
        return out


@dataclass
class TextAtEnd:
    """A request whose caller makes its text once it has ended (`LLM.generate`)."""

    prompt_token_ids: Sequence[int]
    named: NamedIds
    skip_special_tokens: bool = True
    # Ended by an output that is not an error: its held-back tail is released (RequestText.finish).
    ended: bool = True


def texts_at_end(tokenizer: Any, requests: Sequence[TextAtEnd], pieces: TokenPieces | None = None) -> list[str]:
    """Each request's text: exactly what a RequestText (no stop strings) fed each output's ids
    as they came would have made, at a fraction of the cost.

    Where the tokenizer decodes with its Rust backend, one batch decode of each request's prompt
    context and ids: the streamed text equals one full decode whenever that decode is valid
    UTF-8 (no U+FFFD; `_IncrementalDecoder`). With broken bytes (U+FFFD) it does too for a
    byte-level decoder, whose U+FFFD replace each broken run where it lies, once the request
    ended (an error leaves the stream holding a last unfinished character back). The one
    exception: 32 ids in a row that end no character, which the stream releases as U+FFFD
    before it knows what follows. Every other request with a U+FFFD (byte fallback spreads it
    over a whole byte run) is streamed output by output.
    """
    texts: list[str | None] = [None] * len(requests)
    if decodes_with_backend(tokenizer):
        byte_level = _byte_level(tokenizer)
        for skip in (True, False):
            rows = [i for i, r in enumerate(requests) if r.skip_special_tokens == skip]
            if not rows:
                continue
            decode = ids_decoder(tokenizer, skip)
            contexts = [_prompt_context(decode, list(requests[i].prompt_token_ids)) for i in rows]
            batch = [ctx + requests[i].named.ids for i, (ctx, _) in zip(rows, contexts)]
            decoded = tokenizer._tokenizer.decode_batch(batch, skip_special_tokens=skip)
            for i, (_, head), full in zip(rows, contexts, decoded):
                if full.startswith(head) and (_REPLACEMENT not in full or byte_level and requests[i].ended):
                    texts[i] = full[len(head):]
    return [text if text is not None else _streamed(tokenizer, r, pieces) for text, r in zip(texts, requests)]


def _streamed(tokenizer: Any, request: TextAtEnd, pieces: TokenPieces | None) -> str:
    text = RequestText(tokenizer, request.prompt_token_ids, skip_special_tokens=request.skip_special_tokens,
                       pieces=pieces)
    for ids in request.named.chunks():
        text.append(ids)
    if request.ended:
        text.finish()
    return text.text


class TokenNames:
    """Token id -> the text it shows, for logprobs (cached: the same ids recur)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self._cache.get(token_id)
        if name is None:
            name = self._tokenizer.decode([token_id]) if self._tokenizer is not None else f"<{token_id}>"
            self._cache[token_id] = name
        return name
