"""The bundle's tokenizer: encode, decode, chat template, stop tokens.

tokenizer.json through `tokenizers`; the chat template (tokenizer_config.json's
`chat_template` or chat_template.jinja) rendered with a sandboxed jinja2, as Hugging Face
renders it, and encoded without adding special tokens (the template writes them).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dspark.runtime.errors import DSparkError


def _raise(message: str) -> None:
    raise TemplateError(message)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable character for each byte, inverted (byte-level BPE vocabularies)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


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

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the tokenizer spells bytes as GPT-2's printable characters (ByteLevel)."""
        return '"ByteLevel"' in json.dumps(json.loads(self.tokenizer.to_str()).get("decoder"))

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprobs `bytes`): a byte-level BPE's
        characters mapped back to bytes, a SentencePiece byte-fallback token its byte, its
        word marker a space; otherwise its decoded text."""
        piece = self.tokenizer.id_to_token(token)
        if piece is None:
            return b""
        if self._byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if "\u2581" in piece:
            return piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token], skip_special_tokens=False).encode()

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
