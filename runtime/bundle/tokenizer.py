"""The bundle's tokenizer: encode, decode, chat template, stop tokens.

tokenizer.json through `tokenizers`; the chat template (tokenizer_config.json's
`chat_template` or chat_template.jinja) rendered with a sandboxed jinja2, as Hugging Face
renders it, and encoded without adding special tokens (the template writes them).
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dspark.runtime.errors import DSparkError


def _raise(message: str) -> None:
    raise TemplateError(message)


class BundleTokenizer:
    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template_path = folder / "chat_template.jinja"
        self.chat_template = (template_path.read_text() if template_path.exists()
                              else self.config.get("chat_template"))
        self.eos_ids = self._special_ids("eos_token") | self._generation_eos(folder)

    def _token(self, key: str) -> str | None:
        value = self.config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    def _special_ids(self, key: str) -> set[int]:
        token = self._token(key)
        tid = self.tokenizer.token_to_id(token) if token else None
        return {tid} if tid is not None else set()

    @staticmethod
    def _generation_eos(folder: Path) -> set[int]:
        """eos_token_id of generation_config.json (Hugging Face) and of genai_config.json's
        model (onnxruntime-genai's builder), an id or a list."""
        found: set[int] = set()
        for name, path in (("generation_config.json", ()), ("genai_config.json", ("model",))):
            if not (folder / name).exists():
                continue
            config = json.loads((folder / name).read_text())
            for key in path:
                config = config.get(key, {}) if isinstance(config, dict) else {}
            eos = config.get("eos_token_id") if isinstance(config, dict) else None
            found |= set(eos) if isinstance(eos, list) else {eos} if isinstance(eos, int) else set()
        return found

    def encode(self, text: str, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict]) -> str:
        if not self.chat_template:
            raise DSparkError("the bundle's tokenizer has no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True,
                bos_token=self._token("bos_token") or "", eos_token=self._token("eos_token") or "")
        except TemplateError as e:
            raise DSparkError(f"chat template: {e}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render_chat(messages), special=False)


def load_tokenizer(folder: Path | None) -> BundleTokenizer | None:
    return BundleTokenizer(folder) if folder is not None else None
