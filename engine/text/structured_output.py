"""Structured output: a request's StructuredOutput compiled for the model's tokenizer, and the
token masks that keep each constrained row's next token within it.

Built on llguidance (Microsoft's, also a vLLM and llama.cpp backend). Against xgrammar and
outlines-core on SmolLM2's tokenizer and a 151,669-token Qwen vocabulary
(benchmarks/bench_grammar_libs.py, on a shared 2-core CPU box): it compiles a JSON schema, a
regex or a grammar in 1-20 ms where xgrammar took 30-300 ms for JSON and about 2 s for a regex
with a bounded repeat, and outlines-core 2.6-55 s (it has no grammars at all); its masks take
20-50 us a token at the median (200-600 for a regex whose repeated class admits most tokens) where
xgrammar's take 4-16, and the engine computes them while the GPU runs the step's forward pass
(engine.llm). Its one cost: building its view of the tokenizer
(all token bytes, a trie) takes seconds for a large vocabulary and holds the GIL throughout, so
it is built once per engine, on first use or when prepare() is called.
"""
import json
import threading

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from tokenizers import Tokenizer, decoders

from engine.core.sampling_params import StructuredOutput


# JSON is written compact (no whitespace between tokens) unless a schema's "x-guidance" options say
# otherwise: with whitespace free, SmolLM2 asked to "Describe a cat as a JSON object" wandered into
# runs of newlines and repeated keys until its 150-token limit; compact, it closed the object in 46
# (greedy, int4 weights).
_JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_text(spec: StructuredOutput) -> str:
    """The constraint as llguidance grammar text."""
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, _JSON_OPTIONS)
    if spec.json_schema is not None:
        schema = json.loads(spec.json_schema) if isinstance(spec.json_schema, str) else spec.json_schema
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, _JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"json_schema: {e}") from None
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


def _is_byte_level(pre_tokenizer: dict) -> bool:
    """Whether a pre-tokenizer's JSON is ByteLevel, or a Sequence with a ByteLevel part."""
    return pre_tokenizer.get("type") == "ByteLevel" or any(map(_is_byte_level, pre_tokenizer.get("pretokenizers") or ()))


def _is_inert_on_byte_level(step: dict) -> bool:
    """Whether a decoder step leaves every token of a byte-level vocabulary as it is. Such a
    vocabulary spells its tokens in ByteLevel's 256-character alphabet (printable ASCII and Latin-1,
    U+0100-U+0143 for the other bytes), so a Replace of "▁" (U+2581) never finds one; Fuse joins the
    tokens into one string, which ByteLevel maps back to bytes character by character, as it does
    token by token; ByteFallback rewrites only tokens spelled "<0xNN>", and what such a token stands
    for, to the ByteLevel pre-tokenizer that produces it, is those six characters."""
    kind = step.get("type")
    if kind in ("ByteFallback", "Fuse"):
        return True
    return kind == "Replace" and step.get("pattern") == {"String": "▁"} and step.get("content") == " "


def grammar_tokenizer_json(backend: Tokenizer) -> str:
    r"""The backend's JSON as llguidance should read it. transformers 5.17 converts a byte-level GGUF
    vocabulary (SmolLM2's) with the decoder Sequence[ByteFallback, Fuse, Replace("▁", " "),
    ByteLevel]; llguidance reads such a Sequence as a byte-fallback vocabulary and takes each
    token's bytes to be its spelling's UTF-8 ("Ċ", id 198, became b"\xc4\x8a" instead of b"\n"):
    a grammar forcing a newline ended SmolLM2's stream with a parser error. When the pre-tokenizer
    is byte-level and the decoder's other steps change no token of its vocabulary, llguidance gets
    a copy whose decoder is ByteLevel alone, the exact inverse of that pre-tokenizer."""
    # The backend's JSON straight from it: llguidance.hf.from_tokenizer copies the backend first, a
    # pickle round trip that took longer than the rest for a 151K vocabulary.
    text = backend.to_str()
    if backend.decoder is None or backend.pre_tokenizer is None:
        return text
    decoder = json.loads(backend.decoder.__getstate__())
    if decoder.get("type") != "Sequence" or not _is_byte_level(json.loads(backend.pre_tokenizer.__getstate__())):
        return text
    steps = decoder.get("decoders") or []
    byte_level = [step for step in steps if step.get("type") == "ByteLevel"]
    if len(byte_level) != 1 or not all(step in byte_level or _is_inert_on_byte_level(step) for step in steps):
        return text
    copy = Tokenizer.from_str(text)
    copy.decoder = decoders.ByteLevel()
    return copy.to_str()


class GrammarCompiler:
    """Compiles StructuredOutputs into matchers for one model's tokenizer, and fills their masks.

    tokenizer: a transformers fast tokenizer; vocab_size: the logits' width (masks cover it, and
    tokens past the tokenizer's are never allowed); eos_ids: the tokens that may end a reply once
    the constraint is satisfied."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_ids = sorted(eos_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._executor = None

    def prepare(self) -> None:
        """Builds llguidance's tokenizer now (seconds for a large vocabulary, holding the GIL), so
        that no request waits for it later."""
        self._tokenizer_for_grammars()

    def _tokenizer_for_grammars(self):
        with self._lock:
            if self._ll_tokenizer is None:
                if not hasattr(self._tokenizer, "backend_tokenizer"):
                    raise ValueError("structured output needs a fast (tokenizers) tokenizer; this model's is "
                                     f"{type(self._tokenizer).__name__}")
                text = grammar_tokenizer_json(self._tokenizer.backend_tokenizer)
                self._ll_tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self._eos_ids)
                self._executor = llguidance.LLExecutor()
            return self._ll_tokenizer

    def matchers(self, spec: StructuredOutput, count: int = 1) -> list:
        """`count` matchers at the start of the constraint (ValueError if it does not compile)."""
        grammar = grammar_text(spec)
        tokenizer = self._tokenizer_for_grammars()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured output does not compile: {matcher.get_error()}")
        return [matcher] + [matcher.deep_copy() for _ in range(count - 1)]

    @property
    def words(self) -> int:
        """int32 words in a row of masks."""
        return (self.vocab_size + 31) // 32

    def masks(self, matchers: list, out: torch.Tensor | None = None) -> torch.Tensor:
        """[len(matchers), ceil(vocab / 32)] int32 bitmasks of the tokens each matcher allows next,
        computed on llguidance's threads without the GIL, in `out` when given (a contiguous CPU
        tensor of that shape, such as the runner's pinned staging rows). A matcher that is None
        (its sequence has ended; nothing reads its row) allows everything."""
        words = self.words
        if out is None:
            out = torch.empty((len(matchers), words), dtype=torch.int32)
        elif out.shape != (len(matchers), words):
            raise ValueError(f"mask buffer of shape {tuple(out.shape)}, not {(len(matchers), words)}")
        live = []
        for i, m in enumerate(matchers):
            if m is not None:
                live.append((m, i))  # llguidance writes every word of the row
            else:
                out[i] = -1
        if live:
            llguidance.torch.fill_next_token_bitmask_par(self._executor, live, out)
        return out
