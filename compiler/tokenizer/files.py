"""The bundle's tokenizer/: validated copies of the Hugging Face tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

from dspark.runtime.errors import DSparkError

TOKENIZER_JSON = "tokenizer.json"
OPTIONAL_FILES = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                  "generation_config.json", "genai_config.json")  # the last: EOS ids


def find_tokenizer(arg: Path | None, main_path: Path) -> Path | None:
    """--tokenizer DIR if given (must be valid), else main.onnx's folder if it has one."""
    if arg is None:
        return main_path.parent if (main_path.parent / TOKENIZER_JSON).is_file() else None
    if not arg.exists():
        raise DSparkError(f"--tokenizer {arg}: no such directory")
    if not arg.is_dir():
        raise DSparkError(f"--tokenizer {arg}: not a directory")
    if not (arg / TOKENIZER_JSON).is_file():
        raise DSparkError(f"--tokenizer {arg}: no {TOKENIZER_JSON} in it")
    return arg


def tokenizer_vocab_size(folder: Path) -> int:
    from tokenizers import Tokenizer

    path = folder / TOKENIZER_JSON
    try:
        return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except PermissionError:
        raise DSparkError(f"{path}: permission denied") from None
    except Exception as e:  # noqa: BLE001 - tokenizers raises bare Exceptions
        raise DSparkError(f"{path}: not a readable tokenizer ({str(e).splitlines()[0]})") from None


def copy_tokenizer(folder: Path, dest: Path) -> list[str]:
    dest.mkdir()
    copied = []
    for name in (TOKENIZER_JSON, *OPTIONAL_FILES):
        src = folder / name
        if not src.is_file():
            continue
        try:
            data = src.read_bytes()
            if name.endswith(".json") and name != TOKENIZER_JSON:
                json.loads(data)
        except PermissionError:
            raise DSparkError(f"{src}: permission denied") from None
        except ValueError as e:
            raise DSparkError(f"{src}: not valid JSON ({e})") from None
        (dest / name).write_bytes(data)
        copied.append(name)
    return copied
