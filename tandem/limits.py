"""The context-window check, one wording offline and online.

The text is vLLM's, so client libraries that classify errors by message (litellm's
ContextWindowExceededError, LangChain's retry logic) recognise tandem's too.
"""
from __future__ import annotations


def context_error(max_model_len: int, prompt_len: int, max_tokens: int | None) -> str | None:
    """Why `prompt_len + max_tokens` cannot run in a context of `max_model_len`, or None.

    `max_tokens=None` means "as many as fit": then only the prompt must leave room for one.
    """
    if max_tokens is None or prompt_len >= max_model_len:
        if prompt_len < max_model_len:
            return None
        return (f"This model's maximum context length is {max_model_len} tokens. However, your request "
                f"has {prompt_len} input tokens, and at least one must be left to generate. Please "
                "reduce the length of the input messages.")
    if prompt_len + max_tokens <= max_model_len:
        return None
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.")
