"""One sequence's grammar state, kept in step with its verified tokens.

    masks      verification masks position i of a round with the grammar state after the
               round's drafts 0..i-1 (consumed on demand: acceptance reads rows in order and
               stops at the first rejection), then rolls them back and consumes the tokens
               accepted, the main model's token included
    drafts     a draft the grammar forbids ends the window (it could never be accepted);
               tokens the grammar forces are proposed as free drafts (source "grammar")
With every position masked the same way whether or not it was drafted, constrained output
with speculation equals constrained output without it, token for token (greedy), or is
distributed as it (sampled: acceptance uses the masked p).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark.runtime.errors import RequestError

SOURCE = "grammar"


class GrammarBook:
    """The bundle tokenizer as llguidance sees it (built once, on first use)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids: frozenset[int]):
        self.path = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._tokenizer = None

    @classmethod
    def of(cls, bundle, tokenizer) -> GrammarBook | None:
        """The bundle's (None without a tokenizer: no structured output)."""
        if tokenizer is None:
            return None
        return cls(bundle.tokenizer_dir / "tokenizer.json", bundle.model("main").vocab_size,
                   frozenset(tokenizer.eos_ids))

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from llguidance import LLTokenizer

            # a bundle without EOS still needs one for the grammar's end: a model id past
            # the tokenizer's vocabulary (the engine stops on it, see Constraint.eos)
            eos = sorted(self.eos_ids) or [self.vocab_size - 1]
            try:
                self._tokenizer = LLTokenizer(self.path.read_text(), n_vocab=self.vocab_size,
                                              eos_token=eos)
            except ValueError as e:
                raise RequestError(f"structured output: this bundle's tokenizer cannot drive "
                                   f"a grammar ({e})", param="response_format") from None
        return self._tokenizer

    def check(self, grammar: str, param: str) -> None:
        """RequestError naming `param` and the construct when the grammar cannot be built."""
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise RequestError(f"{param}: {error}", param=param, code="invalid_json_schema")

    def constraint(self, grammar: str) -> Constraint:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"response_format: {matcher.get_error()}",
                               param="response_format", code="invalid_json_schema")
        return Constraint(matcher, self.vocab_size, frozenset(self.tokenizer.eos_tokens))


class Constraint:
    def __init__(self, matcher, vocab_size: int, eos: frozenset[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos = eos  # the grammar's end tokens: the sequence stops on them
        self.bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self.consumed = 0  # drafts of the current round consumed for masking
        self.masks = 0  # masks computed (statistics)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return self.matcher.is_stopped()

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows."""
        return self.matcher.validate_tokens(drafts) if drafts else 0

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (possibly none)."""
        return self.matcher.compute_ff_tokens()

    def allowed(self) -> np.ndarray:
        """The next position's mask, one bool per model token."""
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        self.masks += 1
        allowed = np.unpackbits(self.bits.view(np.uint8), bitorder="little")[
            :self.vocab_size].astype(bool)
        if not allowed.any():  # the grammar needs text this tokenizer cannot spell
            raise RequestError("the requested format allows no token of this model's "
                               "vocabulary here", param="response_format")
        return allowed

    def rows(self, logits: np.ndarray, drafts: list[int]) -> MaskedRows:
        self.consumed = 0
        return MaskedRows(self, logits, drafts)

    def commit(self, tokens: list[int]) -> None:
        """After acceptance: forget the round's drafts, consume what was emitted (through
        an end token: nothing after it is emitted)."""
        if self.consumed:
            self.matcher.rollback(self.consumed)
        self.consumed = 0
        end = next((i for i, t in enumerate(tokens) if t in self.eos), len(tokens) - 1)
        if not self.matcher.consume_tokens(tokens[:end + 1]):
            raise RuntimeError(f"grammar refused verified tokens {tokens}: "
                               f"{self.matcher.get_error()}")


class MaskedRows:
    """rows[i]: logits row i with what the grammar forbids there at -inf."""

    def __init__(self, constraint: Constraint, logits: np.ndarray, drafts: list[int]):
        self.c, self.logits, self.drafts = constraint, logits, drafts
        self.rows: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, i: int) -> np.ndarray:
        if i not in self.rows:
            c = self.c
            if any(d in c.eos for d in self.drafts[:i]):
                # past an accepted end token nothing is emitted; the matcher never consumes
                # an end token here (it would not count in its rollback history)
                self.rows[i] = self.logits[i]
                return self.rows[i]
            while c.consumed < i:  # acceptance reads in order: drafts 0..i-1 were accepted
                c.matcher.consume_token(self.drafts[c.consumed])
                c.consumed += 1
            self.rows[i] = np.where(c.allowed(), self.logits[i], -np.inf).astype(
                self.logits.dtype)
        return self.rows[i]
