import os

# Tests run on the CPU with deterministic kernels; keep thread count modest on 2-core CI.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models: one intra-op thread is fastest, and on a shared 2-core machine several
# OpenMP threads spin against each other (seen: 100x slower matmuls under load).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every engine in the tests checks FutureMap reads on the device (a read before a write fails).
os.environ.setdefault("TANDEM_DEBUG_FUTURE_MAP", "1")
# ... and the prefix cache's books (reference counts, slot ownership) after every step.
os.environ.setdefault("TANDEM_DEBUG_PREFIX_CACHE", "1")
import torch  # noqa: E402

torch.set_num_threads(1)

import pytest


@pytest.fixture(scope="session")
def builtin_tokenizer():
    """The built-in model's tokenizer (from its GGUF; a few seconds, so once per session)."""
    saved = os.environ.get("TANDEM_TEST_TOKENIZER")  # a saved copy, where the GGUF is not at hand
    if saved:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(saved)
    from tandem.models.checkpoint import builtin_model_path, open_checkpoint
    return open_checkpoint(builtin_model_path(), config_only=True).load_tokenizer()


@pytest.fixture(scope="session")
def tiny_text_model(tmp_path_factory, builtin_tokenizer):
    """A tiny random Llama with the built-in model's real tokenizer: fast, and text works."""
    from tiny_models import make_tiny_model
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_text"), "llama",
                           vocab_size=len(builtin_tokenizer), eos_token_id=2, hidden_size=64,
                           intermediate_size=128)
    builtin_tokenizer.save_pretrained(path)
    return path


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After the summary: end without interpreter teardown if Triton was imported (its
    nanobind bindings print a leak report there, which reads like a crash); the exit code
    is pytest's."""
    from tandem.entrypoints.cli import exit_quietly
    exit_quietly(config.stash.get(_EXIT_STATUS, 0))


_EXIT_STATUS = pytest.StashKey[int]()
