"""A prompt as token ids: given as ids, as text, or as a user message in the chat template.
The CLI, the benchmark and the samples all turn prompts into ids here."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

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


def load_prompts(path: Path | None) -> list[dict]:
    """A JSONL prompt file (`dsrun bench`, `dsc datastore`), or the bundled bench prompts;
    each entry named and classed."""
    text = (path.read_text() if path else
            resources.files("dspark.runtime.cli").joinpath("bench_prompts.jsonl").read_text())
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            p = json.loads(line)
        except ValueError as e:
            raise DSparkError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(p, dict) or not ({"prompt", "chat", "prompt_ids"} & set(p)):
            raise DSparkError(f"{path}:{n}: needs a 'prompt', 'chat' or 'prompt_ids' field")
        prompts.append({"name": p.get("name", f"p{n}"), "class": p.get("class", "default"), **p})
    if not prompts:
        raise DSparkError(f"{path}: no prompts")
    return prompts


def entry_ids(tokenizer, p: dict) -> list[int]:
    """A prompt file entry's ids (its `prompt`, `chat` or `prompt_ids`)."""
    return prompt_ids(tokenizer, p.get("prompt"), p.get("chat"), p.get("prompt_ids"))
