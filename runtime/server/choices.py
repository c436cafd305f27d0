"""A request's choices as OpenAI's API shapes them: logprobs, echo, usage.

    chat         choice.logprobs = {"content": [{"token", "logprob", "bytes",
                 "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": None}
    completions  choice.logprobs = {"tokens", "token_logprobs", "top_logprobs" ({token:
                 logprob} per token), "text_offset"}; with echo the prompt's tokens first,
                 the very first with None
A token's text is its bytes (the tokenizer's, BundleTokenizer.token_bytes) decoded, invalid
UTF-8 replaced; a token's offset counts the characters of the text before it. Usage counts
the prompt once and every choice's tokens (`n`).
"""

from __future__ import annotations

from dspark.runtime.bundle.tokenizer import BundleTokenizer
from dspark.runtime.sequence.logprobs import TokenLogprob
from dspark.runtime.sequence.request import Sequence


def _entry(tok: BundleTokenizer, token: int, logprob: float) -> dict:
    raw = tok.token_bytes(token)
    return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(tok: BundleTokenizer, entries: list[TokenLogprob]) -> dict:
    return {"content": [{**_entry(tok, e.token, e.logprob),
                         "top_logprobs": [_entry(tok, t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(tok: BundleTokenizer, entries: list[TokenLogprob | None],
                        tokens: list[int], start: int = 0) -> dict:
    """Legacy completions logprobs of `tokens` (an entry None: the first prompt token's),
    offsets counted from `start` characters."""
    texts = [tok.token_bytes(t) for t in tokens]
    offsets, length, pending = [], start, b""
    for raw in texts:  # characters before each token: whole ones, of the bytes so far
        offsets.append(length)
        pending += raw
        text = pending.decode("utf-8", "ignore")
        if text.encode() == pending:
            length, pending = length + len(text), b""
    return {"tokens": [raw.decode("utf-8", "replace") for raw in texts],
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else {
                tok.token_bytes(t).decode("utf-8", "replace"): lp for t, lp in e.top}
                for e in entries],
            "text_offset": offsets}


def kept_tokens(seq: Sequence, decode, text: str) -> int:
    """How many output tokens the returned text holds (a stop string may cut it)."""
    if seq.text_end is None:
        return len(seq.generated)
    count = 0
    while count < len(seq.generated) and len(decode(seq.generated[:count + 1])) <= len(text):
        count += 1
    return count


def usage(seqs: list[Sequence]) -> dict:
    prompt, completion = seqs[0].prompt_len, sum(len(s.generated) for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": seqs[0].cached_tokens}}
