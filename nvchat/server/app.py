"""The OpenAI-compatible HTTP API over one Backend that tokenizes (the in-process EngineThread), as a
FastAPI app.

A request's body is read as a stream up to a size limit (413 past it), then decoded, checked,
tokenized (the chat template too) and submitted on a worker thread, so a big body holds up neither
the event loop (other streams, /health) nor the engine. Its RequestStream is then read on the event
loop (`async for`), so concurrent clients batch together in the engine and share its prefix cache.
A request ends with its client: a disconnect aborts it and the engine frees its blocks.
"""
import asyncio
import json
import logging
import math
import secrets
import time
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import RequestStream
from engine.backend import Backend
from nvchat.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from nvchat.server.metrics import ServerMetrics
from nvchat.server.replies import (
    CompletionLogprobs,
    TokenTexts,
    chat_logprobs,
    merged,
    usage,
)
from nvchat.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    refused_fields,
    without_idle_fields,
)
from nvchat.server.sse import TEXT_SLOT, EventStreamResponse, sse_event, text_events

DONE = "data: [DONE]\n\n"
logger = logging.getLogger("nvchat.server")

# A bigger body is refused (413) as it arrives, before it is parsed. A prompt that fills a 128k-token
# context is well under 1 MB of JSON in English and about 4.5 MB as \u-escaped CJK text.
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
# JSON nests no deeper than this (a JSON schema in response_format or a tool's parameters nests far
# less); past it a body is a 400, not a RecursionError.
MAX_JSON_DEPTH = 100


class APIError(Exception):
    """An OpenAI-style error answer: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")


def _internal_error(e: BaseException) -> APIError:
    return APIError(500, f"internal server error: {type(e).__name__}: {e}", type="server_error")


class ServerState:
    """What the routes share: the engine (None while it loads), the served model's name, the
    requests in flight, which a shutdown ends, and the metrics."""

    def __init__(self, model_name: str, engine: Backend | None = None, *,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        self.model_name = model_name
        self.engine = engine
        self.max_request_bytes = max_request_bytes
        self.load_error: str | None = None
        self.stopping = False
        self.open_streams: set[RequestStream] = set()
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: self.engine.stats() if self.engine is not None else None)
        self.token_texts: TokenTexts | None = None  # made with the first request for log-probabilities

    def ready_engine(self) -> Backend:
        if self.stopping:
            raise _shutting_down()
        if self.load_error:
            raise APIError(503, f"the model could not be loaded: {self.load_error}", type="server_error")
        if self.engine is None:
            raise APIError(503, "the model is still loading", type="server_error", code="model_loading")
        if self.engine.fatal_error:
            raise APIError(503, f"the engine has stopped: {self.engine.fatal_error}", type="server_error")
        return self.engine

    def check_model(self, name: str | None) -> None:
        if name not in (None, self.model_name):
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")

    def begin_shutdown(self) -> None:
        """Refuses new requests and aborts open ones; their responses end with an error."""
        self.stopping = True
        for stream in list(self.open_streams):
            stream.abort()


class BearerAuth:
    """ASGI middleware: every path but /health needs `Authorization: Bearer <key>` (401 otherwise;
    the scheme's case does not matter, as RFC 9110 says), checked before the body is read."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
            if not (scheme.lower() == b"bearer" and secrets.compare_digest(given.strip(), self.expected)):
                error = APIError(401, "a valid API key is required: send `Authorization: Bearer <key>`",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Pydantic's names for the members of a union, which a field's path leaves out ("temperature.float"
# would only confuse).
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal", "function-after", "model"}


def _field_path(loc) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.split("[", 1)[0] not in _TYPE_TAGS and not part[:1].isupper():
            path += f".{part}" if path else part
    return path


def _invalid_field(errors: list) -> APIError:
    first = errors[0] if errors else {}
    path = _field_path(first.get("loc", ()))
    kind = first.get("type")
    if kind == "missing":
        message = "this field is required"
    elif kind == "extra_forbidden":
        message = "unknown field: this server does not support it"
    else:
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        # A check of several fields names the one at fault first ("tool_choice: ...").
        head, sep, rest = message.partition(": ")
        if sep and head.replace("_", "").isalnum():
            path, message = f"{path}.{head}" if path else head, rest
    return APIError(400, f"{path}: {message}" if path else message, param=path or None)


def _bad_values(data) -> str | None:
    """What is wrong with a decoded body's values, if anything: nesting past MAX_JSON_DEPTH, or a
    number that is not finite (JSON has none, but Python's parser takes NaN and Infinity, and
    1e400 overflows to infinity)."""
    todo = [(data, "", 0)]
    while todo:
        value, path, depth = todo.pop()
        if isinstance(value, dict):
            if depth >= MAX_JSON_DEPTH:
                return f"the request body nests deeper than {MAX_JSON_DEPTH} levels"
            todo.extend((v, f"{path}.{k}" if path else str(k), depth + 1) for k, v in value.items())
        elif isinstance(value, list):
            if depth >= MAX_JSON_DEPTH:
                return f"the request body nests deeper than {MAX_JSON_DEPTH} levels"
            todo.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            return f"{path}: {value} is not a finite number"
    return None


def _decode(raw: bytes) -> dict:
    """The JSON body as a dict, whatever Content-Type the client sent (curl -d sends a form's)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    problem = _bad_values(data)
    if problem:
        raise APIError(400, problem, param=problem.split(":")[0] if ":" in problem else None)
    if b"\\ud" in raw.lower() and _has_lone_surrogate(data):
        # JSON's escapes can spell half a UTF-16 pair, which no tokenizer takes (it raised a 500).
        raise APIError(400, "the request body's text holds a lone UTF-16 surrogate (an unpaired escape such as "
                       "\\ud800), which is not a character")
    return data


def _has_lone_surrogate(data) -> bool:
    try:
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False


def _validate(data: dict, schema: type[BaseModel], endpoint: str | None = None):
    if endpoint is not None:
        refused = refused_fields(data, endpoint)
        if refused:
            raise APIError(400, f"{refused[0]}: {refused[1]}", param=refused[0])
        data = without_idle_fields(data, endpoint)
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise _invalid_field(e.errors()) from None


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, read as it arrives and refused (413) once it is past limit bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over this server's limit of {limit} bytes (--max-request-bytes)",
                    code="request_too_large")


async def _off_the_loop(work):
    """work() on a worker thread: tokenizing a long prompt takes seconds, which must not stop the
    event loop. A bug in it is a 500 in OpenAI's shape (a handler for Exception itself would answer
    after Starlette re-raised it, and uvicorn then resets the connection)."""
    try:
        return await asyncio.to_thread(work)
    except APIError:
        raise
    except ValueError as e:  # bad input, as the engine reports it
        raise APIError(400, str(e)) from None
    except RuntimeError as e:  # the engine stopped between the check and the submission
        raise APIError(503, str(e), type="server_error") from None
    except Exception as e:
        logger.exception("preparing a request failed")
        raise _internal_error(e) from None


def _chunk(head: dict, index: int, content: dict | None, finish_reason=None, logprobs=None,
           include_usage: bool = False, usage=None) -> dict:
    """An endpoint's event: head (id, object, created, model) and one choice holding content (none
    in the usage-only chunk); with include_usage, usage as OpenAI sends it: null on every chunk but
    the last."""
    choices = [] if content is None else [{"index": index, **content, "logprobs": logprobs,
                                           "finish_reason": finish_reason}]
    event = {**head, "choices": choices}
    if include_usage:
        event["usage"] = usage
    return event


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _max_tokens(body, context: int, prompt_tokens: int) -> int:
    """The reply's token limit: what the client asked for, which must fit the context beside the
    prompt (400 naming both numbers, as vLLM answers), else all the room the prompt leaves."""
    requested = body.requested_max_tokens
    room = context - prompt_tokens
    if requested is None:
        return max(room, 1)  # a prompt with no room left is refused by the engine, which says why
    name, value = requested
    if value > room > 0:
        raise APIError(400, f"{name} is {value}, but this model's context is {context} tokens and the prompt takes "
                            f"{prompt_tokens} of them, which leaves {room} for the reply", param=name)
    return value


class _App(FastAPI):
    async def __call__(self, scope, receive, send):
        # Starlette answers an unhandled exception with a 500 (OpenAI-shaped: see create_app), then
        # raises it again, and uvicorn resets the client's connection; it ends here instead.
        try:
            await super().__call__(scope, receive, send)
        except Exception:
            if scope["type"] != "http":
                raise
            logger.exception("a request failed")


def _chat_message(stream: RequestStream) -> dict:
    message = {"role": "assistant", "content": stream.text}
    if stream.tool_calls:
        message["tool_calls"] = [call.openai() for call in stream.tool_calls]
        message["content"] = stream.text.strip() or None  # as OpenAI's: null beside calls, unless there was text
    return message


def _endpoint(path: str) -> str:
    return {"/v1/chat/completions": "chat", "/v1/completions": "completions"}.get(path, "other")


def create_app(state: ServerState, *, api_key: str | None = None) -> FastAPI:
    app = _App(title="nvchat", docs_url=None, redoc_url=None, openapi_url=None)
    v1 = APIRouter(prefix="/v1")

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        state.metrics.request_refused(_endpoint(request.url.path), exc.status)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _bug(request, exc: Exception):
        return _internal_error(exc).response()

    @app.get("/health")
    async def health():
        state.ready_engine()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def answer_checked(request: Request, schema, respond, endpoint: str | None = None):
        """respond(body, engine) for a request whose body is read, then checked against schema (and
        endpoint's refused fields), the engine's readiness and the model, on a worker thread."""
        raw = await _read_body(request, state.max_request_bytes)

        def work():
            body = _validate(_decode(raw), schema, endpoint)
            engine = state.ready_engine()
            state.check_model(body.model)
            return respond(body, engine)
        return await _off_the_loop(work)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        def respond(body: TokenizeRequest, engine):
            if body.messages is not None:
                ids = engine.tokenize_chat(body.engine_messages(), body.enable_thinking, body.engine_tools())
            else:
                ids = engine.tokenize(body.prompt, body.add_special_tokens)
            return {"count": len(ids), "max_model_len": engine.capabilities.context_length, "tokens": ids,
                    "token_strs": None}
        return await answer_checked(request, TokenizeRequest, respond)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await answer_checked(request, DetokenizeRequest,
                                    lambda body, engine: {"prompt": engine.detokenize(body.tokens)})

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str):
        state.check_model(model_id)
        return _model_card(state)

    async def start(request: Request, schema, endpoint: str, prepare):
        """Reads, checks and submits a request on a worker thread: (its body, its prompt's ids, a
        stream per choice). prepare(body, engine): the prompt's token ids and submit()'s keywords."""
        def submit(body, engine):
            ids, keywords = prepare(body, engine)
            capabilities = engine.capabilities
            params = body.sampling_params(_max_tokens(body, capabilities.context_length, len(ids)),
                                          capabilities.recommended_sampling)
            if params.n == 1:
                return body, ids, [engine.submit(ids, params, **keywords)]
            return body, ids, engine.submit_n(ids, params, **keywords)

        body, ids, streams = await answer_checked(request, schema, submit, endpoint)
        if state.stopping:  # begin_shutdown() ran while the request was being prepared
            for stream in streams:
                stream.abort()
            raise _shutting_down()
        state.open_streams.update(streams)
        return body, ids, streams

    def finish(streams: list[RequestStream], endpoint: str) -> None:
        for stream in streams:
            stream.abort()  # nothing if it ended; otherwise the client left or the server is stopping
        if streams[0] in state.open_streams:
            state.open_streams.difference_update(streams)
            state.metrics.request_ended(endpoint, streams)

    async def complete(streams: list[RequestStream], request: Request, endpoint: str) -> None:
        """Waits for every choice's whole reply, or for the client to leave (then aborts them)."""
        async def consume(stream):
            async for _ in stream:
                pass

        reading = asyncio.ensure_future(asyncio.gather(*(consume(s) for s in streams)))
        leaving = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({reading, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            reading.cancel()
            finish(streams, endpoint)
        for stream in streams:
            if stream.finish_reason == "abort":  # the engine stopped (had the client left, no one reads this)
                raise _shutting_down()
            if stream.finish_reason == "error":
                raise APIError(500, f"generation failed: {stream.error}", type="server_error")

    def ending_badly(stream: RequestStream) -> str | None:
        """The error event that ends a stream which did not finish normally, if it did not."""
        if stream.finish_reason == "error":
            return sse_event(APIError(500, f"generation failed: {stream.error}", type="server_error").body())
        if stream.finish_reason == "abort":
            return sse_event(_shutting_down().body())
        return None

    def streamed(streams: list[RequestStream], endpoint: str, chunk, nothing, opening: list[str], piece_events,
                 include_usage: bool) -> EventStreamResponse:
        """A streamed reply, as both endpoints send it: the opening events; then each choice's pieces
        as piece_events(choice index, text, tool calls, logprobs) encodes them, and its end: a chunk
        with its finish reason and `nothing` for content, or the error event that ends the whole
        stream where a choice did not finish normally; then the usage, if asked for, and [DONE].
        chunk(index, content, finish_reason, usage=): the endpoint's chunk. The streams end with the
        response, however it ends."""
        async def events():
            for event in opening:
                yield event
            async for i, piece in merged(streams):
                if piece is None:
                    failure = ending_badly(streams[i])
                    if failure is not None:
                        yield failure
                        return
                    yield sse_event(chunk(i, nothing, streams[i].finish_reason))
                    continue
                for event in piece_events(i, *piece):
                    yield event
            if include_usage:
                yield sse_event(chunk(0, None, usage=usage(streams)))
            yield DONE

        return EventStreamResponse(events(), on_close=lambda: finish(streams, endpoint))

    def token_texts() -> TokenTexts:
        if state.token_texts is None:
            state.token_texts = TokenTexts(state.engine.detokenize)
        return state.token_texts

    def chat_prompt(body: ChatCompletionRequest, engine: Backend):
        tools = body.engine_tools()
        # Rendered here, so submit() takes the token ids and the tools only to read the calls.
        return engine.tokenize_chat(body.engine_messages(), body.enable_thinking, tools), {"tools": tools}

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body, _, streams = await start(request, ChatCompletionRequest, "chat", chat_prompt)
        reply_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        with_logprobs = body.engine_logprobs is not None
        if not body.stream:
            await complete(streams, request, "chat")
            return {"id": reply_id, "object": "chat.completion", "created": created, "model": state.model_name,
                    "choices": [{"index": i, "message": _chat_message(s),
                                 "logprobs": chat_logprobs(s.logprobs or [], token_texts()) if with_logprobs else None,
                                 "finish_reason": s.finish_reason} for i, s in enumerate(streams)],
                    "usage": usage(streams)}

        head = {"id": reply_id, "object": "chat.completion.chunk", "created": created, "model": state.model_name}

        def chunk(index: int, delta: dict | None, finish_reason=None, logprobs=None, usage=None) -> dict:
            return _chunk(head, index, None if delta is None else {"delta": delta}, finish_reason, logprobs,
                          include_usage, usage)

        # The common event, a piece of text, is encoded once but for its text (see text_events).
        content_events = [text_events(chunk(i, {"content": TEXT_SLOT})) for i in range(len(streams))]
        calls = [0] * len(streams)

        def piece_events(i: int, text: str, tool_calls, logprobs):
            if logprobs:
                yield sse_event(chunk(i, {"content": text}, logprobs=chat_logprobs(logprobs, token_texts())))
            elif text:
                yield content_events[i](text)
            for call in tool_calls:  # each whole, in one delta (OpenAI's may split the arguments)
                yield sse_event(chunk(i, {"tool_calls": [{"index": calls[i], **call.openai()}]}))
                calls[i] += 1

        opening = [sse_event(chunk(i, {"role": "assistant", "content": ""})) for i in range(len(streams))]
        return streamed(streams, "chat", chunk, {}, opening, piece_events, include_usage)

    def completion_prompt(body: CompletionRequest, engine: Backend):
        prompt = body.engine_prompt()
        return (engine.tokenize(prompt) if isinstance(prompt, str) else prompt), {}

    @v1.post("/completions")
    async def completions(request: Request):
        body, ids, streams = await start(request, CompletionRequest, "completions", completion_prompt)
        reply_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        with_logprobs = body.engine_logprobs is not None
        echoed = ""
        if body.echo:
            prompt = body.engine_prompt()
            echoed = prompt if isinstance(prompt, str) else await asyncio.to_thread(state.engine.detokenize, ids)
        head = {"id": reply_id, "object": "text_completion", "created": created, "model": state.model_name}

        def chunk(index: int, text: str | None, finish_reason=None, logprobs=None, usage=None) -> dict:
            return _chunk(head, index, None if text is None else {"text": text}, finish_reason, logprobs,
                          include_usage, usage)

        if not body.stream:
            await complete(streams, request, "completions")
            choices = [chunk(i, echoed + s.text, s.finish_reason,
                             CompletionLogprobs(token_texts())(s.logprobs or []) if with_logprobs else None)["choices"][0]
                       for i, s in enumerate(streams)]
            return {**head, "choices": choices, "usage": usage(streams)}

        text_event = [text_events(chunk(i, TEXT_SLOT)) for i in range(len(streams))]
        offsets = [CompletionLogprobs(token_texts()) for _ in streams] if with_logprobs else None

        def piece_events(i: int, text: str, _tool_calls, logprobs):
            if logprobs:
                yield sse_event(chunk(i, text, logprobs=offsets[i](logprobs)))
            elif text:
                yield text_event[i](text)

        opening = [text_event[i](echoed) for i in range(len(streams))] if echoed else []
        return streamed(streams, "completions", chunk, "", opening, piece_events, include_usage)

    app.include_router(v1)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    return app


def _model_card(state: ServerState) -> dict:
    card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "nvchat"}
    if state.engine is not None and state.engine.capabilities.context_length is not None:
        card["max_model_len"] = state.engine.capabilities.context_length
    return card
