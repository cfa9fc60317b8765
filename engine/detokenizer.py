"""Turns a growing list of completion tokens into text, a piece at a time.

Each piece is decoded in a small window that starts at the previous piece, so tokenizers that
treat a leading token specially still join up, and a piece is held back while it ends in a
partial UTF-8 character. Stop strings are searched as text arrives; text that could be the start
of a stop string is held back until it is known not to be one, so a stop string is never shown.
"""
import contextlib

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None, lock=None):
        self.tokenizer = tokenizer
        # HF fast tokenizers are not safe to use from two threads at once; callers that encode
        # elsewhere share this lock with us.
        self.lock = lock or contextlib.nullcontext()
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.emitted = 0
        self.stop = stop or []
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool) -> None:
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if len(window) > len(before) and (final or not window.endswith(REPLACEMENT)):
            self.text += window[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _find_stop(self, search_from: int) -> None:
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def push(self, new_ids: list[int]) -> str:
        """Adds tokens; returns the text that became final."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        old_len = len(self.text)
        self._advance(final=False)
        if self.stop and len(self.text) > old_len:
            self._find_stop(max(0, old_len - self.holdback))
        return self._release(len(self.text) if self.stopped else len(self.text) - self.holdback)

    def flush(self) -> str:
        """At the end of the request: whatever was held back, partial characters included."""
        if not self.stopped:
            old_len = len(self.text)
            self._advance(final=True)
            if self.stop:
                self._find_stop(max(0, old_len - self.holdback))
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted:upto]
        self.emitted = upto
        return delta
