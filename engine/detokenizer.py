"""Turns a growing list of completion tokens into text, a piece at a time.

Each piece is decoded in a small window that starts at the previous piece, so tokenizers that
treat a leading token specially still join up, and a partial UTF-8 character at its end is held
back until its last byte arrives. Stop strings are searched as text arrives; the tail of the text
that could be the start of a stop string is held back until it is known not to be one, so a stop
string is never shown and no other text waits for it.
"""
import contextlib
from collections.abc import Callable
from functools import partial

REPLACEMENT = "\ufffd"


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """tokenizer.decode(ids, skip_special_tokens=True) as one function. For a stock transformers
    fast tokenizer that decode is the Rust backend's plus an optional clean-up pass; with the pass
    off, calling the backend directly gives the same text in ~1 us instead of ~5 (transformers
    converts and checks its arguments first), and it runs twice per streamed token. Anything else
    (a subclass with its own decode, clean-up on) goes through tokenizer.decode."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        PreTrainedTokenizerFast = PreTrainedTokenizerBase = None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (PreTrainedTokenizerFast is not None and isinstance(tokenizer, PreTrainedTokenizerFast)
            and cls.decode is PreTrainedTokenizerBase.decode and cls._decode is PreTrainedTokenizerFast._decode
            and not tokenizer.clean_up_tokenization_spaces and backend is not None):
        return partial(backend.decode, skip_special_tokens=True)
    return partial(tokenizer.decode, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None, lock=None, decode=None):
        """decode: text_decoder(tokenizer), when the caller has made it already."""
        self.tokenizer = tokenizer
        self.decode = decode or text_decoder(tokenizer)
        # HF fast tokenizers are not safe to use from two threads at once; callers that encode
        # elsewhere share this lock with us.
        self.lock = lock or contextlib.nullcontext()
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.taken = 0  # characters of the window past its `before` part already in text
        self.text = ""
        self.emitted = 0
        self.stop = stop or []
        self.stopped = False

    def _advance(self, final: bool) -> None:
        ids, decode = self.ids, self.decode
        with self.lock:
            before = decode(ids[self.prefix_offset:self.read_offset])
            window = decode(ids[self.prefix_offset:])
        whole = final or not window.endswith(REPLACEMENT)
        # A token can end in part of a character after whole ones (SmolLM2 has " " plus a lead
        # byte): the whole ones count now, or a stop string they complete would be found a token
        # late (or only at flush, after a "length" finish).
        known = window if whole else window.rstrip(REPLACEMENT)
        start = len(before) + self.taken
        if len(known) > start:
            self.text += known[start:]
            self.taken = len(known) - len(before)
        if whole and len(window) > len(before):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.taken = 0

    def _find_stop(self) -> None:
        # Released text cannot start a stop string (see _stop_prefix_len), so only the rest is searched.
        hits = [i for i in (self.text.find(s, self.emitted) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
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
        if not self.stop:
            return self._release(len(self.text))
        if len(self.text) > old_len:
            self._find_stop()
        return self._release(len(self.text) if self.stopped else len(self.text) - self._stop_prefix_len())

    def flush(self) -> str:
        """At the end of the request: whatever was held back, partial characters included."""
        if not self.stopped:
            self._advance(final=True)
            if self.stop:
                self._find_stop()
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted:upto]
        self.emitted = upto
        return delta
