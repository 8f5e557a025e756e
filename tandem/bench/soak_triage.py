"""Where a mismatching greedy answer left the reference, and how close that pick was.

A mismatch is either a bug or two nearly equal logits that different batch shapes round
differently (bf16 on a GPU, say). To tell them apart, the reference request is sent again
with top-2 logprobs; walking its tokens, the first one after which the reference text stops
being a prefix of the target's text is where they diverged, and the gap between its two best
logprobs says how close the call was (a near-tie is below `NEAR_TIE`). The logprobs are the
unpenalized ones, so with penalties the gap is only indicative.
"""
from __future__ import annotations

import json

import httpx

NEAR_TIE = 1e-3


async def divergence(http: httpx.AsyncClient, base: str, path: str, body: bytes, choice: int,
                     got_text: str) -> dict | None:
    """{"token_index", "token", "top2_gap"} where choice `choice` of the reference first
    leaves `got_text`; None when the texts agree token by token (e.g. only the finish reason
    differs) or the reference cannot be asked."""
    d = json.loads(body)
    if path == "completions":
        d["logprobs"] = 2
    else:
        d["logprobs"], d["top_logprobs"] = True, 2
    r = await http.post(f"{base}/v1/{path}", json=d)
    if r.status_code != 200:
        return None
    c = sorted(r.json()["choices"], key=lambda c: c["index"])[choice]
    text = ""
    for i, (token, top) in enumerate(_tokens(c, path)):
        text += token
        if not got_text.startswith(text):
            best = sorted(top, reverse=True)[:2]
            return {"token_index": i, "token": token, "top2_gap": best[0] - best[1] if len(best) == 2 else None}
    return None


def _tokens(choice: dict, path: str) -> list[tuple[str, list[float]]]:
    """(token text, its top logprobs) per generated token."""
    lp = choice["logprobs"]
    if path == "completions":
        return [(t, list(top.values())) for t, top in zip(lp["tokens"], lp["top_logprobs"])]
    return [(t["token"], [x["logprob"] for x in t["top_logprobs"]]) for t in lp["content"]]
