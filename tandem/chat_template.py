"""A conversation through a tokenizer's chat template: one set of rules for `LLM.chat`,
`tandem chat` and the server's chat routes."""
from __future__ import annotations

from typing import Any

# Keys the template call itself owns: chat_template_kwargs may not override them.
TEMPLATE_RESERVED = frozenset({"conversation", "messages", "tokenize", "return_dict", "return_tensors",
                               "add_generation_prompt", "continue_final_message", "tools", "documents",
                               "chat_template", "padding", "truncation", "max_length", "tokenizer_kwargs",
                               "return_assistant_tokens_mask"})


class ChatTemplateError(ValueError):
    """The conversation or the template options cannot be rendered; `field` names the request
    field at fault (the server answers 400 naming it)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def render_chat(tokenizer: Any, conversation: list[dict], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None,
                chat_template: str | None = None, template_kwargs: dict | None = None) -> list[int]:
    """The template applied to plain message dicts, as token ids. `chat_template`: a Jinja
    template used instead of the tokenizer's; `template_kwargs`: extra template variables
    (Qwen3's enable_thinking, say)."""
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ChatTemplateError("this model has no chat template", "messages")
    reserved = sorted(TEMPLATE_RESERVED & set(template_kwargs or ()))
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError("continue_final_message needs add_generation_prompt set to false",
                                "continue_final_message")
    try:
        ids = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools, chat_template=chat_template,
            tokenize=True, return_dict=False, **(template_kwargs or {}))
    except Exception as exc:  # jinja raises whatever the template author chose
        raise ChatTemplateError(f"the chat template refused these messages: {exc}", "messages") from None
    return list(ids)


def text_content(content: Any) -> Any:
    """A message's content as the templates read it: OpenAI-style text (and refusal) parts
    joined into one string, as the server does (vLLM's 'string' content format); a string or
    None as it is."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "refusal") or not isinstance(part.get(kind), str):
            raise ChatTemplateError(f"a content part of type {kind!r}: this model accepts text only; parts "
                                    "must be {'type': 'text', 'text': '...'}", "messages")
        texts.append(part[kind])
    return "".join(texts)
