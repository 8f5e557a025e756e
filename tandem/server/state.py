"""What every route of the server reads: the engine client, the tokenizer, the served model's
names and the field policy. Its own module so that the route modules (`api`, `tokenize`)
import it and not each other."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.server.client import EngineClient
from tandem.server.errors import APIError
from tandem.server.fields import FieldPolicy
from tandem.server.metrics import Metrics
from tandem.server.reasoning import ReasoningParser
from tandem.server.responses import TokenNames
from tandem.server.responses_store import ResponseStore


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Any
    model_name: str
    model_aliases: frozenset[str]  # other names accepted in "model" (the path it was loaded from)
    metrics: Metrics
    fields: FieldPolicy = field(default_factory=FieldPolicy)  # unknown / ignored request fields
    # GET /server_info: engine configuration and server arguments, secrets redacted (`tandem serve`)
    server_info: dict = field(default_factory=dict)
    draining: bool = False  # shutting down: no new generations
    reasoning: ReasoningParser | None = None  # --reasoning-parser: replies split into reasoning and content
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses kept for previous_response_id

    def __post_init__(self) -> None:
        self.names = TokenNames(self.tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.client.ready.max_model_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.model_aliases:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", "model", "model_not_found")

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tandem",
                "root": self.model_name, "parent": None, "max_model_len": self.max_model_len}
