"""A prompt as token ids: given as ids, as text, or as a user message in the chat template.
The CLI, the benchmark and the samples all turn prompts into ids here."""

from __future__ import annotations

from dspark.runtime.errors import DSparkError


def prompt_ids(tokenizer, text: str | None = None, chat: str | None = None,
               ids: list[int] | None = None) -> list[int]:
    """Exactly one of text, chat or ids; text and chat need the bundle's tokenizer."""
    if sum(x is not None for x in (text, chat, ids)) != 1:
        raise DSparkError("give exactly one of a prompt text, a chat message or token ids")
    if ids is not None:
        return list(ids)
    if tokenizer is None:
        raise DSparkError("the bundle has no tokenizer: give token ids")
    if chat is not None:
        return tokenizer.encode_chat([{"role": "user", "content": chat}])
    return tokenizer.encode(text)
