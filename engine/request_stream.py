"""RequestStream: one request's tokens as they are produced, for any thread or event loop.

The engine thread appends deltas; readers iterate (blocking or async), or drain whatever has
arrived without waiting, which is how a UI batches many tokens into one repaint.
"""
import asyncio
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

from engine.text.tool_calls import ToolCall


class _LoopWaker:
    """Sets asyncio events of one loop from other threads, one call_soon_threadsafe per burst: a
    step that pushes to 64 streams read on one loop wakes it once rather than 64 times (on the
    2-core CI box 64 calls cost the engine thread ~220 µs a step, one call 3.5 µs)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        # Weak: _wakers is keyed weakly by the loop, and a strong reference here would keep every
        # loop that ever read a stream alive for good.
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._due: list[asyncio.Event] = []

    def set_soon(self, event: asyncio.Event) -> None:
        loop = self._loop()
        with self._lock:
            if loop is None or loop.is_closed():  # nobody is left on it to wake
                self._due.clear()  # (events of a call the closing loop dropped: they hold it)
                return
            self._due.append(event)
            if len(self._due) > 1:
                return  # a call is already on its way and will take this event too
        try:
            loop.call_soon_threadsafe(self._set_due)
        except RuntimeError:  # the loop closed just now
            with self._lock:
                self._due.clear()

    def _set_due(self) -> None:
        with self._lock:
            due, self._due = self._due, []
        for event in due:
            event.set()


_wakers: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker]" = weakref.WeakKeyDictionary()
_wakers_lock = threading.Lock()


def _waker(loop: asyncio.AbstractEventLoop) -> _LoopWaker:
    with _wakers_lock:
        waker = _wakers.get(loop)
        if waker is None:
            waker = _wakers[loop] = _LoopWaker(loop)
        return waker


@dataclass
class Delta:
    text: str
    token_ids: list[int] = field(default_factory=list)
    # With SamplingParams.logprobs: a TokenLogprobs (engine.core.sequence) per token, else None.
    logprobs: list | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls the text since the last delta made


class RequestStream:
    def __init__(self, request_id: int, num_prompt_tokens: int | None, abort_fn, tag=None, sample_index: int = 0,
                 tool_parser=None):
        """tool_parser: a parser of engine.text.tool_calls, for a request that offers tools: the
        stream's text is then the reply's without its calls, which are in tool_calls."""
        self.request_id = request_id
        self.tag = tag
        self.sample_index = sample_index  # which of its request's n samples (EngineThread.submit_n)
        # The prompt's tokens and those the prefix cache held: None in a backend that can't know them
        # (a remote server that reports no usage; nvchat/remote_backend.py), never a made-up 0.
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list | None = None  # every token's TokenLogprobs so far, when asked for
        self.tool_calls: list[ToolCall] = []
        self._tool_parser = tool_parser
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._abort_fn = abort_fn
        self._pending: deque[Delta] = deque()
        self._cond = threading.Condition()
        self._async_waiters: list[tuple[_LoopWaker, asyncio.Event]] = []

    # --- producer side (engine thread) -------------------------------------------------------------

    def _wake(self) -> None:
        self._cond.notify_all()
        for waker, event in self._async_waiters:
            waker.set_soon(event)
        self._async_waiters.clear()

    def _push(self, text: str, token_ids: list[int], logprobs: list | None = None, *,
              tool_calls: list[ToolCall] = ()) -> None:
        with self._cond:
            if self._tool_parser is not None and text:
                text, parsed = self._tool_parser.push(text)
                tool_calls = [*tool_calls, *parsed]
            self._append(text, token_ids, logprobs, list(tool_calls))
            self._wake()

    def _append(self, text: str, token_ids: list[int], logprobs: list | None, tool_calls: list[ToolCall]) -> None:
        if self.first_token_at is None and token_ids:
            self.first_token_at = time.perf_counter()
        self.text += text
        self.token_ids += token_ids
        self.tool_calls += tool_calls
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += logprobs
        last = self._pending[-1] if self._pending else None
        if (last is not None and not (last.text or text or last.tool_calls or tool_calls)
                and (last.logprobs is None) == (logprobs is None)):
            last.token_ids += token_ids
            if logprobs is not None:
                last.logprobs += logprobs
        else:
            self._pending.append(Delta(text, list(token_ids), None if logprobs is None else list(logprobs),
                                       tool_calls))

    def _finish(self, reason: str, error: str | None = None) -> None:
        with self._cond:
            if self.finish_reason is not None:
                return
            if self._tool_parser is not None:
                text, calls = self._tool_parser.finish()  # what it held back: text, or a call left unclosed
                if text or calls:
                    self._append(text, [], None, calls)
            if self.tool_calls and reason == "stop":
                reason = "tool_calls"  # as OpenAI ends a reply that calls tools
            self.finish_reason, self.error = reason, error
            self.finished_at = time.perf_counter()
            self._wake()

    # --- consumer side ---------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def abort(self) -> None:
        """Stops generation; the engine frees the request's blocks at its next step."""
        if not self.finished:
            self._abort_fn(self)

    def drain(self) -> Delta | None:
        """Everything that arrived since the last drain, merged into one delta, or None."""
        with self._cond:
            if not self._pending:
                return None
            parts = list(self._pending)
            self._pending.clear()
        logprobs = [lp for p in parts for lp in p.logprobs or ()] if any(p.logprobs is not None for p in parts) else None
        return Delta("".join(p.text for p in parts), [t for p in parts for t in p.token_ids], logprobs,
                     [c for p in parts for c in p.tool_calls])

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the request ends; True if it did."""
        with self._cond:
            return self._cond.wait_for(lambda: self.finished, timeout)

    def __iter__(self):
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self.finished)
                if not self._pending:
                    return
                delta = self._pending.popleft()
            yield delta

    async def __aiter__(self):
        waker = _waker(asyncio.get_running_loop())
        while True:
            with self._cond:
                if self._pending:
                    delta = self._pending.popleft()
                elif self.finished:
                    return
                else:
                    delta = None
                    event = asyncio.Event()
                    self._async_waiters.append((waker, event))
            if delta is None:
                await event.wait()
            else:
                yield delta

    # --- numbers for the reply's footer ------------------------------------------------------------

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def tokens_per_second(self) -> float | None:
        """Decode rate after the first token."""
        if self.first_token_at is None or len(self.token_ids) < 2:
            return None
        end = self.finished_at or time.perf_counter()
        return (len(self.token_ids) - 1) / max(end - self.first_token_at, 1e-9)

    def __repr__(self):
        return (f"RequestStream(id={self.request_id}, tokens={len(self.token_ids)}, "
                f"finish_reason={self.finish_reason!r})")
