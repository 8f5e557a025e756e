"""vLLM's /tokenize and /detokenize: the server's own tokenizer and chat template, for
clients that count tokens or build prompts the way the server will."""
from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.responses import Response

from tandem.server.errors import APIError
from tandem.server.inputs import check_prompt_text, render_chat
from tandem.server.openai_schemas import DetokenizeRequest, TokenizeRequest
from tandem.server.state import ServerState


def _json(body: dict) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")


def add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    def tokenizer():
        if state.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return state.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        state.check_model(body.model)
        state.fields.check(body)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of prompt and messages", "prompt")
        tok = tokenizer()
        # In a worker thread, like a completion's prompt: a long one must not stall the streams.
        ids, strs = await asyncio.to_thread(_tokenized, body, tok, state.max_model_len)
        return _json({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                      "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        state.check_model(body.model)
        state.fields.check(body)
        vocab = state.client.ready.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", "tokens")
        return _json({"prompt": tokenizer().decode(body.tokens)})


def _tokenized(body: TokenizeRequest, tok: Any, max_model_len: int) -> tuple[list[int], list[str] | None]:
    """The token ids of the prompt or the rendered messages, and their strings if asked for."""
    if body.messages is not None:
        ids = render_chat(tok, body.messages, body.add_generation_prompt, body.continue_final_message,
                          body.chat_template_kwargs)
        if body.add_special_tokens:  # off by default: the template already places them
            ids = tok.build_inputs_with_special_tokens(ids)
    else:
        check_prompt_text(body.prompt, max_model_len)  # the completions' checks: valid, not certainly too long
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = list(tok.encode(body.prompt, add_special_tokens=add))
    return ids, tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
