"""What the server does with request fields it does not use: log once, or refuse.

Standard OpenAI fields without meaning here (`IGNORED`) are accepted and logged the first
time each is seen. Fields no schema declares are ignored with a warning, as vLLM does,
or refused with a 400 naming them under `--strict-api` (a typo then fails loudly).
"""
from __future__ import annotations

import logging

from pydantic import BaseModel

from tandem.server.errors import APIError
from tandem.server.openai_schemas import IGNORED

log = logging.getLogger("tandem.server")


class FieldPolicy:
    def __init__(self, strict: bool = False):
        self.strict = strict
        self._logged: set[str] = set()

    def check(self, body: BaseModel, ignored: dict[str, str] = IGNORED) -> None:
        """Raise APIError for an unknown field under strict mode; otherwise log what is ignored
        (`ignored`: field -> reason; an endpoint whose standard fields differ passes its own)."""
        unknown = list(body.model_extra or ())
        if unknown and self.strict:
            raise APIError(400, f"unrecognized request argument: {unknown[0]} (the server runs "
                                "with --strict-api)", unknown[0])
        for name in unknown:
            self._once(name, f"ignoring unknown request field {name!r} (--strict-api refuses such "
                             "requests)")
        for name in body.model_fields_set & ignored.keys():
            if getattr(body, name) is not None:
                self._once(name, f"ignoring request field {name!r}: {ignored[name]}")
        options = getattr(body, "stream_options", None)
        if options is not None and options.include_obfuscation is not None:
            self._once("include_obfuscation", "ignoring stream_options.include_obfuscation: "
                                              f"{IGNORED['include_obfuscation']}")

    def _once(self, name: str, message: str) -> None:
        # Once per field per server life, and a bounded set: random field names cannot flood.
        if name not in self._logged and len(self._logged) < 256:
            self._logged.add(name)
            log.warning(message)
