"""Turns a growing list of completion tokens into text, a piece at a time.

Each piece is decoded in a small window that starts at the previous piece, so tokenizers that
treat a leading token specially still join up, and a partial UTF-8 character at its end is held
back until its last byte arrives. With a byte-fallback decoder (SentencePiece vocabularies), a run
of byte tokens at the end is held back whole until a token of another kind ends it: the decoder
turns the whole run into U+FFFD if any of its bytes is bad, characters it had completed included.
Stop strings are searched as text arrives (a held run's text included); the tail of the text that
could be the start of a stop string is held back until it is known not to be one, so a stop string
is never shown and no other text waits for it.
"""
import json
import re
import sys
from collections.abc import Callable
from functools import partial

from engine.text.chat_tokenizer import ChatTokenizer

REPLACEMENT = "\ufffd"


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """tokenizer.decode(ids, skip_special_tokens=True) as one function. A ChatTokenizer's, and a
    stock transformers fast tokenizer's, is the Rust backend's (plus, in transformers, an optional
    clean-up pass); with the pass off, calling the backend directly gives the same text in ~1 us
    instead of ~5 (transformers converts and checks its arguments first), and it runs twice per
    streamed token. Anything else (a subclass with its own decode, clean-up on) goes through
    tokenizer.decode."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(tokenizer, ChatTokenizer):
        return partial(backend.decode, skip_special_tokens=True)
    if "transformers" not in sys.modules:  # so the tokenizer is not one of its classes
        return partial(tokenizer.decode, skip_special_tokens=True)
    from transformers import (
        PreTrainedTokenizerFast,  # start-up: loaded already, see above
    )
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    cls = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast)
            and cls.decode is PreTrainedTokenizerBase.decode and cls._decode is PreTrainedTokenizerFast._decode
            and not tokenizer.clean_up_tokenization_spaces and backend is not None):
        return partial(backend.decode, skip_special_tokens=True)
    return partial(tokenizer.decode, skip_special_tokens=True)


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _has_decoder(config: dict, kind: str) -> bool:
    return config.get("type") == kind or any(_has_decoder(d, kind) for d in config.get("decoders") or ())


def byte_run_ids(tokenizer) -> frozenset[int]:
    """The ids a run of byte-fallback tokens is made of, for a tokenizer whose decoder has
    tokenizers' ByteFallback step (Llama-2, Mistral, TinyLlama): the byte tokens <0x00>..<0xFF>,
    which it decodes a run at a time, and the special tokens, which decode skips and so leave a run
    open. Empty for any other decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None or not _has_decoder(json.loads(decoder.__getstate__()), "ByteFallback"):
        return frozenset()
    ids = {i for token, i in backend.get_vocab().items() if _BYTE_TOKEN.fullmatch(token)}
    ids.update(i for i, token in backend.get_added_tokens_decoder().items() if token.special)
    return frozenset(ids)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None, decode=None, run_ids=None, min_tokens: int = 0):
        """decode: text_decoder(tokenizer), and run_ids: byte_run_ids(tokenizer), when the caller
        has made them already. min_tokens: stop strings count only from that many tokens on (the
        text before is released as it comes), as vLLM's min_tokens has it."""
        self.tokenizer = tokenizer
        self.decode = decode or text_decoder(tokenizer)
        self.run_ids = byte_run_ids(tokenizer) if run_ids is None else run_ids
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.taken = 0  # characters of the window past its `before` part already in text
        self.text = ""  # final: no later token changes it
        self.pending = ""  # the held run's text so far, which stop strings see (see _advance)
        self.emitted = 0
        self.stop = stop or []
        self.stopped = False
        self.min_tokens = min_tokens

    def _settled_end(self) -> int:
        """Where the byte-fallback run at the end of the tokens starts (their end if none)."""
        end = len(self.ids)
        if self.run_ids:
            while end > self.read_offset and self.ids[end - 1] in self.run_ids:
                end -= 1
        return end

    def _advance(self, final: bool) -> None:
        ids, decode = self.ids, self.decode
        end = len(ids) if final else self._settled_end()
        before = decode(ids[self.prefix_offset:self.read_offset])
        window = decode(ids[self.prefix_offset:end])
        # The held run's text: if the request ends now (a stop string in it, or the last token) it
        # is the text, and a stop string must be found at the token that completes it.
        held = decode(ids[self.prefix_offset:]) if end < len(ids) else ""
        whole = final or not window.endswith(REPLACEMENT)
        # A token can end in part of a character after whole ones (SmolLM2 has " " plus a lead
        # byte): the whole ones count now, or a stop string they complete would be found a token
        # late (or only at flush, after a "length" finish).
        known = window if whole else window.rstrip(REPLACEMENT)
        start = len(before) + self.taken
        if len(known) > start:
            self.text += known[start:]
            self.taken = len(known) - len(before)
        self.pending = held.rstrip(REPLACEMENT)[len(before) + self.taken:]
        if whole and len(window) > len(before):
            self.prefix_offset, self.read_offset = self.read_offset, end
            self.taken = 0

    def _find_stop(self) -> None:
        # Released text cannot start a stop string (see _stop_prefix_len), so only the rest is searched.
        text = self.text + self.pending
        hits = [i for i in (text.find(s, self.emitted) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.pending = text[:min(hits)], ""
            self.stopped = True

    def _stop_prefix_len(self) -> int:
        """Characters at the end of the unreleased text that begin some stop string: all that must
        wait. Any earlier character starts text that is neither a stop string's beginning nor holds
        one, so no later text can make it the start of one."""
        text, longest = self.text, 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text) - self.emitted), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def push(self, new_ids: list[int]) -> str:
        """Adds tokens; returns the text that became final."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        old_len = len(self.text)
        self._advance(final=False)
        if not self.stop or len(self.ids) < self.min_tokens:
            return self._release(len(self.text))
        if len(self.text) > old_len or self.pending:
            self._find_stop()
        return self._release(len(self.text) if self.stopped else len(self.text) - self._stop_prefix_len())

    def flush(self) -> str:
        """At the end of the request: whatever was held back, partial characters included."""
        if not self.stopped:
            self._advance(final=True)
            if self.stop and len(self.ids) >= self.min_tokens:
                self._find_stop()
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted:upto]
        self.emitted = upto
        return delta
