"""The front end's detokenization (`EngineClient.use_tokenizer`): requests without stop strings
get their text made from each delta's `text_ids`, as the engine makes it; a failure ends only
that request. (End to end against the engine's own text: test_server.py.)"""
import asyncio

from tandem.config import EngineConfig
from tandem.server import protocol as P
from tandem.server.client import DeltaQueue, EngineClient, _Tracked
from tandem.server.metrics import Metrics
from tandem.text import RequestText

STATS = P.Stats(running=1, waiting=0, kv_cache_usage=0.0)


def _client(tokenizer) -> tuple[EngineClient, list]:
    client = EngineClient(EngineConfig(), 8, Metrics())
    sent = []
    client._send = sent.append  # the engine's socket: what the front end tells it
    client.use_tokenizer(tokenizer)
    return client, sent


def _track(client: EngineClient, rid: str, prompt: list[int], params: P.Params, queue: DeltaQueue) -> _Tracked:
    t = _Tracked(queue, 0, len(prompt), asyncio.get_running_loop().create_future(),
                 text=client._text_for(prompt, params))
    client._tracked[rid] = t
    return t


def _drain(queue: DeltaQueue) -> list[P.Delta]:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait()[1])
    return out


def test_stop_strings_stay_with_the_engine_and_no_tokenizer_makes_no_text(builtin_tokenizer):
    client, _ = _client(builtin_tokenizer)
    assert client._text_for([5, 6], P.Params(max_tokens=4)) is not None
    assert client._text_for([5, 6], P.Params(max_tokens=4, stop=["x"])) is None
    assert EngineClient(EngineConfig(), 8, Metrics())._text_for([5, 6], P.Params(max_tokens=4)) is None


def test_deltas_get_the_engines_text(builtin_tokenizer):
    """Ids ending inside a character and the finish that releases them: the text a RequestText
    of the engine's makes, delta by delta; a delta the engine detokenized (no text_ids) is kept."""
    ids = builtin_tokenizer.encode("Hello 日本 🙂 world", add_special_tokens=False)
    prompt = [5, 6, 7]

    async def scenario():
        client, _ = _client(builtin_tokenizer)
        queue = DeltaQueue()
        _track(client, "a", prompt, P.Params(max_tokens=len(ids)), queue)
        _track(client, "b", prompt, P.Params(max_tokens=4, stop=["x"]), queue)
        cut = _cut_inside_a_character(builtin_tokenizer, ids)
        for i, token in enumerate(cut):
            done = i == len(cut) - 1
            client._route(P.Outputs([], [], [P.Delta("a", [token], "", done, "length" if done else None, None,
                                                     text_ids=[token])], STATS))
        client._route(P.Outputs([], [], [P.Delta("b", [9], "engine's", True, "stop", None)], STATS))
        return _drain(queue)

    deltas = asyncio.run(scenario())
    reference = RequestText(builtin_tokenizer, prompt)
    want = [reference.append([t]).text for t in _cut_inside_a_character(builtin_tokenizer, ids)]
    released = reference.finish()
    assert released  # the finish has held-back bytes to release
    want[-1] += released
    assert [d.text for d in deltas[:-1]] == want
    assert deltas[-1].text == "engine's"


def _cut_inside_a_character(tokenizer, ids: list[int]) -> list[int]:
    """The ids up to the first one that ends inside a character."""
    end = next(i for i in range(len(ids)) if tokenizer.decode(ids[:i + 1]).endswith("\ufffd"))
    return ids[:end + 1]


def test_a_detokenizer_failure_ends_only_that_request(builtin_tokenizer):
    async def scenario():
        client, sent = _client(builtin_tokenizer)
        queue = DeltaQueue()
        broken = _track(client, "broken", [5], P.Params(max_tokens=8), queue)
        _track(client, "fine", [5], P.Params(max_tokens=8), queue)

        def fail(ids):
            raise RuntimeError("decoder exploded")
        broken.text.append = fail
        client._route(P.Outputs([], [], [P.Delta("broken", [40], "", False, None, None, text_ids=[40]),
                                         P.Delta("fine", [40], "", False, None, None, text_ids=[40])], STATS))
        return _drain(queue), sent, client

    deltas, sent, client = asyncio.run(scenario())
    broken, fine = deltas
    assert broken.finished and broken.finish_reason == "error" and "decoder exploded" in broken.error
    assert not fine.finished and fine.text == RequestText(builtin_tokenizer, [5]).append([40]).text
    assert [m.request_ids for m in sent if isinstance(m, P.Abort)] == [["broken"]]
    assert "broken" not in client._tracked and "fine" in client._tracked
