"""The engine's self-checks, switched on from the environment (the test suite sets both in
tests/conftest.py); read once when an engine is built. They are for finding tandem's own
bugs, not options a user tunes: each costs throughput (the prefix-cache audit walks every
cached slot after every step)."""
import os
from dataclasses import dataclass
from typing import Mapping

FUTURE_MAP_ENV = "TANDEM_DEBUG_FUTURE_MAP"
PREFIX_CACHE_ENV = "TANDEM_DEBUG_PREFIX_CACHE"


@dataclass(frozen=True)
class DebugChecks:
    future_map: bool = False  # a FutureMap read of a slot nothing was stashed in asserts on the device
    prefix_cache: bool = False  # the prefix cache's books (reference counts, slot owners) after every step

    @staticmethod
    def from_env(environ: Mapping[str, str] = os.environ) -> "DebugChecks":
        return DebugChecks(future_map=environ.get(FUTURE_MAP_ENV) == "1",
                           prefix_cache=environ.get(PREFIX_CACHE_ENV) == "1")
