"""Cheap checks of a large request body's costly fields, made on its bytes before it is parsed.

Decoding JSON (json.loads) and validating it (pydantic) are long C calls that hold the GIL,
so a worker thread does not spare the event loop: measured on the CPU, 7.9M token ids in a
15 MiB body stalled every other stream for 13 s, a 1M-entry logit_bias for 2 s, 300k chat
messages for 3 s. Here msgspec skips everything but these fields without building it and the
fields are measured from their bytes; one certainly too big is refused with a 400 naming it.
"""
from __future__ import annotations

import msgspec

from tandem.server.errors import APIError
from tandem.server.inputs import MAX_CHOICES

# Below this a body parses in milliseconds whatever it holds: not worth a scan.
SCAN_BYTES = 64 * 2**10
# Token ids in one field (prompt, stop_token_ids, /detokenize's tokens): also never more than
# MAX_CHOICES prompts of a whole context. 2**20 ids validate in ~0.5 s on a slow CPU.
MAX_TOKEN_IDS = 2**20
# Messages in one chat request: the longest agent sessions run to a few thousand; 300k cost
# the event loop 3 s to parse.
MAX_MESSAGES = 8192
TOO_DEEP = "the request body nests too deeply to parse"
_ID_FIELDS = ("prompt", "stop_token_ids", "tokens")
_ABSENT = msgspec.Raw(b"")


class _Costly(msgspec.Struct):
    """The fields whose size decides a body's parsing cost, as raw JSON (nothing decoded)."""

    prompt: msgspec.Raw = _ABSENT  # a union with None would decode the field, not keep it raw
    stop_token_ids: msgspec.Raw = _ABSENT
    tokens: msgspec.Raw = _ABSENT
    logit_bias: msgspec.Raw = _ABSENT
    messages: msgspec.Raw = _ABSENT
    input: msgspec.Raw = _ABSENT  # /v1/responses: its items are messages too


_DECODER = msgspec.json.Decoder(_Costly)
_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])


def check_body_shape(body: bytes, max_model_len: int, vocab_size: int) -> None:
    """APIError (400, naming the field) if the body's token ids, logit_bias entries or messages
    are certainly more than any servable request has; a body that is not a JSON object passes
    (the parser's own errors say what is wrong with it)."""
    if len(body) < SCAN_BYTES:
        return
    try:
        fields = _DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    except RecursionError:  # msgspec's depth limit; json.loads would hit Python's just the same
        raise APIError(400, TOO_DEEP) from None
    max_ids = min(MAX_TOKEN_IDS, MAX_CHOICES * max_model_len)
    for name in _ID_FIELDS:
        count = _id_count(getattr(fields, name))
        if count > max_ids:
            raise APIError(400, f"{name} has about {count} token ids; a request may carry at most {max_ids}",
                           name)
    if _separators(fields.logit_bias) + 1 > vocab_size:
        raise APIError(400, f"logit_bias has more entries than the vocabulary's {vocab_size} tokens",
                       "logit_bias")
    for name in ("messages", "input"):
        if (count := _item_count(getattr(fields, name))) > MAX_MESSAGES:
            raise APIError(400, f"{name} has {count} items; at most {MAX_MESSAGES} are allowed", name)


def _id_count(raw: msgspec.Raw) -> int:
    """An upper bound on the token ids in a list of ints (or of lists of ints): its commas + 1.
    Text (anything with a quote) counts 0: its characters are checked after parsing, cheaply."""
    data = bytes(raw)
    if not data or b'"' in data:
        return 0
    return data.count(b",") + 1


def _separators(raw: msgspec.Raw) -> int:
    # Token ids and logit_bias keys hold no commas (a body whose keys do is refused anyway).
    return bytes(raw).count(b",")


def _item_count(raw: msgspec.Raw) -> int:
    if not raw:
        return 0
    try:
        return len(_ITEMS.decode(raw))
    except (msgspec.DecodeError, msgspec.ValidationError):  # not a list: validation says so
        return 0
