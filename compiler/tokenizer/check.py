"""Are a draft's and a main model's tokenizers aligned? The comparison behind
`ds-tokenizer-check` and `dsc compile`'s tokenizer gate, and the draft->main token map.

The seed's first production pit: a draft that splits "🛒" into three byte tokens where the
main tokenizer has one; every draft containing it is rejected and nothing says why. A
draft token is only useful to the main model if it means the same string there.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dspark.runtime.bundle.token_map import TokenMap
from dspark.runtime.errors import DSparkError

SPECIALS = ("bos_token", "eos_token", "pad_token", "unk_token")

# Text that tokenizers disagree on most: emoji (ZWJ sequences, skin tones, flags), CJK and
# full-width punctuation, combining marks, leading spaces, tabs and newlines, digits, code.
RISKY = (
    "🛒 Add to cart", "👩‍💻 works on 👨‍👩‍👧‍👦 stuff", "👍🏽 thumbs up 👍🏿", "🇯🇵🇩🇪 flags",
    "中文测试，全角标点！（括号）", "日本語のテキスト。", "한국어 문장입니다.",
    "café naïve coöperate", "e\u0301 combining acute", "  two leading spaces",
    "\ttab\tseparated\nnew line\r\n", "3.14159 2026-11-29 1,000,000 0x1F",
    "def f(x):\n    return x ** 2  # square", "if (a && b) { return a->c; }",
)


@dataclass
class Loaded:
    path: Path
    tokenizer: object
    config: dict

    @property
    def vocab_size(self) -> int:
        """1 + the largest id (vocabularies may leave ids unused)."""
        return 1 + max(self.tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)

    def special(self, key: str) -> tuple[str | None, int | None]:
        value = self.config.get(key)
        text = value.get("content") if isinstance(value, dict) else value
        return text, (self.tokenizer.token_to_id(text) if text else None)


def load(path: Path, flag: str) -> Loaded:
    """A bundle, a tokenizer.json, or a folder with Hugging Face tokenizer files."""
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.exists():
        raise DSparkError(f"{flag} {path}: no such file or directory")
    folder = path.parent if path.is_file() else path
    if path.is_dir() and (path / "tokenizer" / "tokenizer.json").is_file():
        folder = path / "tokenizer"  # a bundle
    file = path if path.is_file() else folder / "tokenizer.json"
    if not file.is_file():
        raise DSparkError(f"{flag} {path}: no tokenizer.json (give a bundle, a tokenizer.json "
                          "or a folder with one)")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - tokenizers raises bare Exceptions
        raise DSparkError(f"{flag} {file}: not a readable tokenizer "
                          f"({str(e).splitlines()[0]})") from None
    config_path = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except ValueError as e:
        raise DSparkError(f"{config_path}: not valid JSON ({e})") from None
    return Loaded(file, tokenizer, config)


@dataclass
class Segmentation:
    text: str
    draft: list[str]
    main: list[str]
    first_divergence: int | None  # token index, None when identical


@dataclass
class Report:
    draft_vocab: int
    main_vocab: int
    specials: dict = field(default_factory=dict)
    differing_ids: int = 0
    first_differing: list = field(default_factory=list)
    segmentations: list = field(default_factory=list)
    mappable: int = 0  # draft ids whose string exists in the main vocabulary

    @property
    def aligned(self) -> bool:
        return (self.draft_vocab == self.main_vocab and self.differing_ids == 0
                and all(s["agree"] for s in self.specials.values())
                and all(s.first_divergence is None for s in self.segmentations))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aligned"] = self.aligned
        return d


def segment(tok: Loaded, text: str) -> tuple[list[int], list[str]]:
    enc = tok.tokenizer.encode(text, add_special_tokens=False)
    return enc.ids, enc.tokens


def compare(draft: Loaded, main: Loaded, strings: tuple[str, ...] = ()) -> Report:
    report = Report(draft.vocab_size, main.vocab_size)
    for key in SPECIALS:
        (dt, di), (mt, mi) = draft.special(key), main.special(key)
        report.specials[key] = {"draft": [dt, di], "main": [mt, mi],
                                "agree": dt == mt and di == mi}
    for i in range(min(draft.vocab_size, main.vocab_size)):
        d, m = draft.tokenizer.id_to_token(i), main.tokenizer.id_to_token(i)
        if d != m:
            report.differing_ids += 1
            if len(report.first_differing) < 10:
                report.first_differing.append([i, d, m])
    report.differing_ids += abs(draft.vocab_size - main.vocab_size)
    for text in dict.fromkeys((*strings, *RISKY)):
        (di, dt), (mi, mt) = segment(draft, text), segment(main, text)
        diverge = next((j for j, (a, b) in enumerate(zip(di, mi)) if a != b),
                       None if len(di) == len(mi) else min(len(di), len(mi)))
        report.segmentations.append(Segmentation(text, dt, mt, diverge))
    report.mappable = int((token_map(draft, main).draft_to_main >= 0).sum())
    return report


def token_map(draft: Loaded, main: Loaded) -> TokenMap:
    """Draft id -> main id for every draft token whose string is a main token (else -1)."""
    import numpy as np

    table = np.full(draft.vocab_size, -1, dtype=np.int64)
    for i in range(draft.vocab_size):
        text = draft.tokenizer.id_to_token(i)
        j = main.tokenizer.token_to_id(text) if text is not None else None
        if j is not None:
            table[i] = j
    unk = draft.special("unk_token")[1]
    expand = {}
    spelled = set(table[table >= 0].tolist())
    for m in range(main.vocab_size):
        if m in spelled or main.tokenizer.id_to_token(m) is None:
            continue
        text = main.tokenizer.decode([m], skip_special_tokens=False)
        ids = draft.tokenizer.encode(text, add_special_tokens=False).ids if text else []
        if ids:
            expand[m] = ids
    return TokenMap(table, main.vocab_size, unk if unk is not None else 0, expand)
