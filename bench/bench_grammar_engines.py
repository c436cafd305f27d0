"""Grammar engines side by side on SmolLM2's tokenizer: llguidance (what DSpark uses) and
xgrammar (vLLM's and SGLang's default), over the JSON-schema cases DSpark is measured on.

    pip install --target build/grammar-peers --no-deps xgrammar apache-tvm-ffi
    PYTHONPATH=build/grammar-peers python bench/bench_grammar_engines.py

For each case the text is SmolLM2's constrained greedy answer (from DSpark, compact JSON
with json.dumps' separators); each engine compiles the schema with the same separators and
no free whitespace, then replays the answer token by token: a mask before every token
(timed), the token accepted (it must be: the text is valid), and the end token accepted
after the last (the grammar is complete). Prints compile time and mask time per token
(median, p99), and the cases an engine could not compile or replay.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "samples" / "schemas" / "structured_cases.jsonl"
SEPARATORS = (", ", ": ")


def answers(bundle: Path, cases: list[dict], max_tokens: int) -> list[list[int]]:
    from dspark.runtime.engine.loader import load_engine
    from dspark.runtime.grammar.formats import schema_grammar
    from dspark.runtime.sequence.prompt import prompt_ids
    from dspark.runtime.sequence.request import GenerationRequest

    engine, tokenizer = load_engine(bundle, warmup=False)
    seqs = engine.generate([GenerationRequest(
        tuple(prompt_ids(tokenizer, None, c["prompt"], None)), max_tokens,
        grammar=schema_grammar(c["schema"], "schema")) for c in cases])
    return [s.generated for s in seqs]


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: Path, vocab: int, eos: int):
        import llguidance

        self.ll = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab,
                                          eos_token=[eos])
        self.bits = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def compile(self, schema: dict):
        from dspark.runtime.grammar.formats import schema_grammar

        matcher = self.ll.LLMatcher(self.tok, schema_grammar(schema, "schema"), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def mask(self, m) -> None:
        m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: Path, vocab: int, eos: int):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info)
        self.bits = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                     separators=SEPARATORS)
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, m) -> None:
        m.fill_next_token_bitmask(self.bits)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=ROOT / "build" / "smollm2.dsmodel")
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    from dspark.runtime.bundle.bundle import open_bundle
    from dspark.runtime.bundle.tokenizer import load_tokenizer

    cases = [json.loads(line) for line in CASES.read_text().splitlines() if line.strip()]
    texts = answers(args.bundle, cases, args.max_tokens)
    bundle = open_bundle(args.bundle)
    eos = min(load_tokenizer(bundle.tokenizer_dir).eos_ids)
    tokenizer_json = bundle.tokenizer_dir / "tokenizer.json"
    vocab = bundle.model("main").vocab_size
    print(f"{len(cases)} cases, {sum(map(len, texts))} tokens of SmolLM2 answers, vocab {vocab}")
    print(f"{'engine':11} {'compile ms':>10} {'mask us med':>11} {'p99':>7} {'replayed':>9} "
          f"failures")
    for make in (LLGuidance, XGrammar):
        try:
            engine = make(tokenizer_json, vocab, eos)
        except ImportError as e:
            print(f"{make.name:11} not installed ({e})")
            continue
        compile_ms, mask_us, ok, failures = [], [], 0, []
        for n, (case, tokens) in enumerate(zip(cases, texts)):
            t0 = time.perf_counter()
            try:
                m = engine.compile(case["schema"])
            except Exception as e:  # noqa: BLE001 - reported per case
                failures.append(f"{n}: compile ({str(e)[:60]})")
                continue
            compile_ms.append((time.perf_counter() - t0) * 1e3)
            for i, token in enumerate(tokens):
                t0 = time.perf_counter()
                engine.mask(m)
                mask_us.append((time.perf_counter() - t0) * 1e6)
                if not engine.accept(m, token):
                    failures.append(f"{n}: refused token {i}")
                    break
            else:  # complete: the end token is accepted now
                if engine.accept(m, eos):
                    ok += 1
                else:
                    failures.append(f"{n}: incomplete")
        print(f"{make.name:11} {np.median(compile_ms):10.1f} {np.median(mask_us):11.1f} "
              f"{np.percentile(mask_us, 99):7.1f} {ok:>4}/{len(cases):<4} "
              f"{'; '.join(failures) or '-'}")


if __name__ == "__main__":
    main()
