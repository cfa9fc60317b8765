"""RemoteBackend: any OpenAI-compatible server (nvchat serve, vLLM, SGLang...) as a Backend
(engine/backend.py), the interface the app, the REPL and pipe mode use, with streams that have
RequestStream's interface. It can't tokenize (the server does) or show the server's KV cache, and its
capabilities say so.

One asyncio loop on a background thread runs every request as a task over one httpx client, so
tabs stream concurrently; aborting a stream cancels its task, which closes the HTTP stream (the
server then aborts the request). Failures end the stream with finish_reason "error" and a message
that says what went wrong, as the engine's own failures do.
"""
import asyncio
import dataclasses
import itertools
import json
import re
import threading
import time

import httpx

from engine import SamplingParams
from engine.backend import BackendCapabilities
from engine.request_stream import Delta, RequestStream
from engine.text.tool_calls import ToolCall, Tools

# Long enough for a big server's queue or a long prefill before the first token; the user can stop
# a reply that waits.
_READ_TIMEOUT_S = 600.0
_CONNECT_TIMEOUT_S = 10.0


class RemoteStream(RequestStream):
    """A RequestStream fed from server-sent chunks. The server sends text, not token ids, so until its
    usage report arrives a chunk counts as one token (as OpenAI-compatible servers stream them). The
    prompt's tokens and those the server's prefix cache held are None (unknown) unless it reports
    them: some servers send no usage (llama-cpp-python's), and 0 would claim an empty prompt."""

    def __init__(self, request_id: int, abort_fn, tag=None):
        super().__init__(request_id, None, abort_fn, tag)
        self.num_cached_tokens = None
        self._chunks = 0
        self._reported_tokens: int | None = None

    def _push_text(self, text: str) -> None:
        with self._cond:
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self.text += text
            self._chunks += 1
            self._pending.append(Delta(text))
            self._wake()

    def _push_tool_calls(self, calls: list[ToolCall]) -> None:
        with self._cond:
            self._append("", [], None, calls)
            self._wake()

    def _set_usage(self, usage: dict) -> None:
        self.num_prompt_tokens = usage.get("prompt_tokens")
        self.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        self._reported_tokens = usage.get("completion_tokens")

    @property
    def num_completion_tokens(self) -> int:
        return self._chunks if self._reported_tokens is None else self._reported_tokens

    @property
    def tokens_per_second(self) -> float | None:
        n = self.num_completion_tokens
        if self.first_token_at is None or n < 2:
            return None
        end = self.finished_at or time.perf_counter()
        return (n - 1) / max(end - self.first_token_at, 1e-9)


# /v1/models' owned_by of llama.cpp's own server (llama-server): with one slot it serves one request
# at a time. llama-cpp-python's server names itself "me", and is found by its behaviour instead.
ONE_AT_A_TIME_OWNERS = ("llamacpp",)
ENDED_BY_ANOTHER_REQUEST = ("the server ended this reply early, when another request reached it: it serves one "
                            "request at a time, so replies in other tabs now wait for each other")
ENDED_EARLY = "the server ended the stream before the reply was finished (it sent no finish reason)"

# Request fields past OpenAI's own API that vLLM, SGLang and `nvchat serve` understand.
EXTENSION_FIELDS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "chat_template_kwargs")


def _error_message(response: httpx.Response) -> str:
    """What the server said, from OpenAI's error shape or the others in use: vLLM's older one
    ({"message"} at the top), FastAPI's ({"detail"}), a bare {"error": "..."}, a proxy's HTML page."""
    try:
        body = response.json()
    except ValueError:
        body = None
    message = None
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        message = message or body.get("message") or body.get("detail")
    if not isinstance(message, str) or not message.strip():
        text = response.text
        title = re.search(r"<title>(.*?)</title>", text, re.IGNORECASE | re.DOTALL)
        message = title.group(1) if title else text
        message = " ".join(re.sub(r"<[^>]*>", " ", message).split())[:200] or response.reason_phrase
    return f"the server answered {response.status_code}: {message}"


class RemoteBackend:
    fatal_error = None  # never set: a failure ends the requests it hits, not the backend

    def __init__(self, base_url: str, *, api_key: str | None = None, model: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.model_name = model
        self._ids = itertools.count(1)
        self._tasks: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None
        self._closed = False
        self._lock = threading.Lock()  # a submission and a shutdown don't interleave
        self._openai_fields_only = False  # the server refused a field of EXTENSION_FIELDS
        # Set when the server is known to serve one request at a time (by its /v1/models answer, or
        # when a stream ended early while another of ours arrived): requests then queue here.
        self.one_request_at_a_time = False
        self._turn: asyncio.Semaphore | None = None  # made on the client's loop
        self._started_requests = 0  # requests sent so far, to tell whether another arrived during one

    # --- lifetime ------------------------------------------------------------------------------------

    def start(self) -> "RemoteBackend":
        """Starts the client's loop; with no model named, asks the server for its first model
        (raises RuntimeError if it can't be reached)."""
        if self._thread is not None:
            return self
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nvchat-remote", daemon=True)
        self._thread.start()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        timeout = httpx.Timeout(_CONNECT_TIMEOUT_S, read=_READ_TIMEOUT_S)
        self._client = self._call(self._make_client(headers, timeout))
        try:
            self._call(self._read_models())
        except BaseException:
            self.shutdown()
            raise
        return self

    async def _make_client(self, headers, timeout) -> httpx.AsyncClient:
        self._turn = asyncio.Semaphore(1)
        return httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=32))

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _read_models(self) -> None:
        """The server's models: the first is the one used when none is named (RuntimeError if the
        server can't be reached or lists none), and their owner tells llama.cpp's server. With a
        model named, a server without /models, or not reachable yet, is still used."""
        try:
            response = await self._client.get("/models")
        except httpx.HTTPError as e:
            if self.model_name is not None:  # a request says it can't reach the server, as it happens
                return
            raise RuntimeError(f"could not reach {self.base_url}: {e or type(e).__name__}") from None
        try:
            models = response.json()["data"] if response.status_code < 400 else None
            first = models[0]
        except (ValueError, KeyError, IndexError, TypeError):
            models = first = None
        if isinstance(first, dict) and first.get("owned_by") in ONE_AT_A_TIME_OWNERS:
            self.one_request_at_a_time = True
        if self.model_name is not None:
            return
        if response.status_code >= 400:
            raise RuntimeError(f"{self.base_url}/models: {_error_message(response)}")
        if not isinstance(first, dict) or not isinstance(first.get("id"), str):
            raise RuntimeError(f"{self.base_url}/models lists no model; name one with --model")
        self.model_name = first["id"]

    def shutdown(self) -> None:
        """Stops every open reply (finish_reason "abort") and the client's loop."""
        with self._lock:
            if self._closed or self._loop is None:
                return
            self._closed = True
            open_requests = list(self._tasks.values())
        for future in open_requests:
            future.cancel()
        if self._client is not None:
            self._call(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.shutdown()

    # --- caller side ---------------------------------------------------------------------------------

    @property
    def capabilities(self) -> BackendCapabilities:
        # The server tokenizes its prompts and keeps its KV cache to itself; its context length
        # is not part of the OpenAI API.
        return BackendCapabilities(model_name=self.model_name, context_length=None, tokenizes=False,
                                   block_stats=False, one_request_at_a_time=self.one_request_at_a_time)

    def tokenize_chat(self, messages: list[dict], enable_thinking: bool | None = None,
                      tools: Tools | None = None) -> list[int]:
        raise RuntimeError("a remote server tokenizes its prompts itself")

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise RuntimeError("a remote server tokenizes its prompts itself")

    def detokenize(self, token_ids: list[int]) -> str:
        raise RuntimeError("a remote server's tokenizer is not reachable through the OpenAI API")

    def prefetch(self, prompt_token_ids: list[int]) -> None:
        """Nothing: a server keeps its KV cache to itself."""

    def stats(self) -> None:
        """None: a remote server's KV-cache blocks are not visible through the OpenAI API."""
        return None

    def submit(self, prompt, sampling_params: SamplingParams | None = None, *, enable_thinking: bool | None = None,
               tools: Tools | None = None, tag=None) -> RemoteStream:
        """Starts a request and returns its stream at once; chat messages go to /chat/completions,
        text or token ids to /completions. tools go as OpenAI's tools, tool_choice and
        parallel_tool_calls; the server parses the calls, which come back as the stream's tool_calls.
        One reply only: submit_n() takes n > 1."""
        if self._closed or self._loop is None:  # checked again under the lock below
            raise RuntimeError("the remote backend is not running")
        params = sampling_params or SamplingParams()
        if params.n > 1:
            raise ValueError(f"submit() streams one reply; use submit_n() for n={params.n}")
        body = {"model": self.model_name, "stream": True, "stream_options": {"include_usage": True},
                "temperature": params.temperature, "top_p": params.top_p, "max_tokens": params.max_tokens}
        # Not in OpenAI's own API (which refuses unknown fields): sent only when they change
        # something, and no longer once the server has refused one (see _run).
        for name in ("presence_penalty", "frequency_penalty"):  # OpenAI's own
            if getattr(params, name):
                body[name] = getattr(params, name)
        if not self._openai_fields_only:
            if params.top_k:
                body["top_k"] = params.top_k
            if params.min_p:
                body["min_p"] = params.min_p
            if params.repetition_penalty != 1.0:
                body["repetition_penalty"] = params.repetition_penalty
            if params.ignore_eos:
                body["ignore_eos"] = True
            if enable_thinking is not None:
                body["chat_template_kwargs"] = {"enable_thinking": enable_thinking}
        if params.stop:
            body["stop"] = params.stop
        if params.seed is not None:
            body["seed"] = params.seed
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            path, body["messages"] = "/chat/completions", prompt
            if tools is not None:
                body["tools"], body["tool_choice"] = tools.definitions, tools.choice
                if not tools.parallel:
                    body["parallel_tool_calls"] = False
        elif tools is not None:
            raise ValueError("tools go with chat messages: a server renders them through its chat template")
        else:
            path, body["prompt"] = "/completions", prompt
        stream = RemoteStream(next(self._ids), self._abort, tag)
        # Under the lock, a request is either scheduled and listed before a shutdown lists what to
        # cancel, or refused: none is left on a stopped loop with a stream that never ends.
        with self._lock:
            if self._closed:
                raise RuntimeError("the remote backend is not running")
            future = asyncio.run_coroutine_threadsafe(self._run(stream, path, body), self._loop)
            self._tasks[stream.request_id] = future
        # Added once listed, so a request that ended before this line still leaves the list.
        future.add_done_callback(lambda f: self._request_done(stream, f))
        return stream

    def submit_n(self, prompt, sampling_params: SamplingParams | None = None, *, enable_thinking: bool | None = None,
                 tools: Tools | None = None, tag=None) -> list[RemoteStream]:
        """submit() for sampling_params.n replies: a request each, sent at once, each with the seed
        the engine gives that sample (SamplingParams.sample_seed), so that `nvchat serve` answers as
        the in-process engine does. Not the API's own `n`: it interleaves the replies in one stream and
        leaves each reply's seed to the server."""
        params = sampling_params or SamplingParams()
        streams: list[RemoteStream] = []
        try:
            for index in range(params.n):
                one = dataclasses.replace(params, n=1, seed=params.sample_seed(index))
                stream = self.submit(prompt, one, enable_thinking=enable_thinking, tools=tools, tag=tag)
                stream.sample_index = index
                streams.append(stream)
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    def _request_done(self, stream: RemoteStream, future) -> None:
        self._tasks.pop(stream.request_id, None)
        if future.cancelled():  # a task cancelled before it first ran never enters _run
            stream._finish("abort")

    def _abort(self, stream: RequestStream) -> None:
        future = self._tasks.get(stream.request_id)
        if future is not None:
            future.cancel()

    # --- the client's loop ---------------------------------------------------------------------------

    async def _run(self, stream: RemoteStream, path: str, body: dict) -> None:
        try:
            if self.one_request_at_a_time:
                async with self._turn:
                    finish_reason, others_arrived = await self._send(stream, path, body)
            else:
                finish_reason, others_arrived = await self._send(stream, path, body)
            if finish_reason is not None:
                stream._finish(finish_reason)
            elif others_arrived:
                # llama-cpp-python's server ends a stream when the next request arrives.
                self.one_request_at_a_time = True
                stream._finish("error", ENDED_BY_ANOTHER_REQUEST)
            else:
                stream._finish("error", ENDED_EARLY)
        except asyncio.CancelledError:
            stream._finish("abort")
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            stream._finish("error", f"could not reach {self.base_url}: {e or type(e).__name__}")
        except httpx.HTTPError as e:  # reached, then lost: the server died, or a proxy cut it off
            when = " mid-reply" if stream.text else ""
            stream._finish("error", f"the connection to {self.base_url} broke{when}: {e or type(e).__name__}")
        except _StreamError as e:
            stream._finish("error", str(e))
        except Exception as e:  # a malformed event: the stream must still end
            stream._finish("error", f"unreadable answer from {self.base_url}: {type(e).__name__}: {e}")

    async def _send(self, stream: RemoteStream, path: str, body: dict) -> tuple[str | None, bool]:
        """The request's finish reason (None if the stream ended without one), and whether another
        request of this backend was sent while it streamed."""
        self._started_requests += 1
        sent_before = self._started_requests
        try:
            finish_reason = await self._read(stream, path, body)
        except _RefusedExtension:
            # vLLM and SGLang take top_k and the rest; OpenAI's own API refuses them (400). The
            # request goes again without them, and later ones leave them out.
            self._openai_fields_only = True
            finish_reason = await self._read(stream, path, {k: v for k, v in body.items()
                                                            if k not in EXTENSION_FIELDS})
        return finish_reason, self._started_requests > sent_before

    async def _read(self, stream: RemoteStream, path: str, body: dict) -> str | None:
        finish_reason = None
        calls = _StreamedToolCalls(stream)
        async with self._client.stream("POST", path, json=body) as response:
            if response.status_code >= 400:
                await response.aread()
                message = _error_message(response)
                if response.status_code == 400 and any(f in body and f in message for f in EXTENSION_FIELDS):
                    raise _RefusedExtension(message)
                raise _StreamError(message)
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    error = event["error"]
                    raise _StreamError(f"the server ended the reply: {error.get('message', error)}"
                                       if isinstance(error, dict) else f"the server ended the reply: {error}")
                if event.get("usage"):
                    stream._set_usage(event["usage"])
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or choice.get("text") or ""
                    if text:
                        stream._push_text(text)
                    for piece in delta.get("tool_calls") or ():
                        calls.add(piece)
                    finish_reason = choice.get("finish_reason") or finish_reason
        calls.flush()
        return finish_reason


class _StreamedToolCalls:
    """OpenAI's streamed tool calls, pieces of which arrive per index (the id and name first, the
    arguments' text in parts): a call is handed to the stream once the next one begins or the
    reply ends."""

    def __init__(self, stream: RemoteStream):
        self.stream = stream
        self.index = None
        self.id, self.name, self.arguments = None, "", []

    def add(self, piece: dict) -> None:
        index = piece.get("index", 0)
        if index != self.index:
            self.flush()
            self.index = index
        function = piece.get("function") or {}
        self.id = piece.get("id") or self.id
        self.name += function.get("name") or ""
        self.arguments.append(function.get("arguments") or "")

    def flush(self) -> None:
        if self.index is not None and self.name:
            call = ToolCall(self.name, "".join(self.arguments) or "{}", **({"id": self.id} if self.id else {}))
            self.stream._push_tool_calls([call])
        self.index, self.id, self.name, self.arguments = None, None, "", []


class _StreamError(Exception):
    """The server refused the request or ended its stream with an error event."""


class _RefusedExtension(_StreamError):
    """The server refused a field past OpenAI's own API (a 400 that names it)."""
