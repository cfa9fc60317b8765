"""A stand-in for llama.cpp's OpenAI-compatible servers, which can't be built within CI's budget: an
OpenAI-compatible app (run it with tests/serving.py) that behaves as they do where nvchat must cope.

- It sends no `usage` (llama-cpp-python's server sends none when streaming).
- It serves one request at a time: a request that arrives while another streams ends that stream at
  once, with no finish reason (as llama-cpp-python's server does).
- Its /v1/models names the owner given ("me" as llama-cpp-python's, "llamacpp" as llama-server's).

A reply is REPLY's words, one chunk each. The first chunk goes out at once; every later one waits
until the test lets it go (release()) or another request interrupts the stream, so a test decides
when a reply is in flight instead of racing a timer."""
import asyncio
import json
import threading

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

MODEL = "SmolLM2-135M-Instruct-Q4_1.gguf"
REPLY = ["Hello", " from", " one", " slot", "."]


class OneSlotServer:
    def __init__(self, owned_by: str = "me", held: bool = True):
        """held: later chunks wait for release(); without it, a reply streams straight through."""
        self.owned_by = owned_by
        self._released = threading.Event()
        if not held:
            self._released.set()
        self._current: asyncio.Event | None = None  # the streaming request's interrupt
        self.requests = 0
        self.interrupted = 0
        self.most_at_once = 0  # the most requests ever streaming together
        self._streaming = 0
        self.app = Starlette(routes=[Route("/v1/models", self._models),
                                     Route("/v1/chat/completions", self._chat, methods=["POST"])])

    def release(self) -> None:
        """Lets every reply stream to its end."""
        self._released.set()

    async def _models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": self.owned_by,
                                                         "permissions": []}]})

    async def _chat(self, request: Request):
        await request.json()
        self.requests += 1
        if self._current is not None:
            self._current.set()  # a new request ends the one streaming
        interrupt = self._current = asyncio.Event()

        async def events():
            self._streaming += 1
            self.most_at_once = max(self.most_at_once, self._streaming)
            try:
                for i, word in enumerate(REPLY):
                    if i and not self._released.is_set():
                        while not (self._released.is_set() or interrupt.is_set()):
                            await asyncio.sleep(0.01)  # the server's own pace, not a test's wait
                    if interrupt.is_set():
                        self.interrupted += 1
                        return  # the stream ends here: no finish reason, no [DONE]
                    finish = "stop" if i == len(REPLY) - 1 else None
                    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": MODEL,
                             "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": finish}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                self._streaming -= 1
        return StreamingResponse(events(), media_type="text/event-stream")
