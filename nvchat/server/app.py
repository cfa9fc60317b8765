"""The OpenAI-compatible HTTP API over one Backend (the in-process EngineThread), as a FastAPI app.

Every request becomes one engine request whose RequestStream is read on the event loop
(`async for`), so concurrent clients batch together in the engine and share its prefix cache.
A request ends with its client: a disconnect aborts it and the engine frees its blocks.
"""
import asyncio
import json
import logging
import secrets
import time
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import RequestStream
from engine.backend import Backend
from nvchat.server.schemas import ChatCompletionRequest, CompletionRequest
from nvchat.server.sse import TEXT_SLOT, EventStreamResponse, sse_event, text_events

DONE = "data: [DONE]\n\n"
logger = logging.getLogger("nvchat.server")


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


class ServerState:
    """What the routes share: the engine (None while it loads), the served model's name, and the
    requests in flight, which a shutdown ends."""

    def __init__(self, model_name: str, engine: Backend | None = None):
        self.model_name = model_name
        self.engine = engine
        self.load_error: str | None = None
        self.stopping = False
        self.open_streams: set[RequestStream] = set()
        self.created = int(time.time())

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

    def begin_shutdown(self) -> None:
        """Refuses new requests and aborts open ones; their responses end with an error."""
        self.stopping = True
        for stream in list(self.open_streams):
            stream.abort()


class BearerAuth:
    """ASGI middleware: every path but /health needs `Authorization: Bearer <key>` (401 otherwise),
    checked before the body is read."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = APIError(401, "a valid API key is required: send `Authorization: Bearer <key>`",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _invalid_field(errors: list) -> APIError:
    first = errors[0] if errors else {}
    # The top-level field: a union's member names ("temperature.float") would only confuse.
    param = str(first["loc"][0]) if first.get("loc") else None
    message = "this field is required" if first.get("type") == "missing" else first.get("msg", "invalid request")
    return APIError(400, f"{param}: {message}" if param else message, param=param)


async def _parse(request: Request, schema: type[BaseModel]):
    """The JSON body as `schema`, whatever Content-Type the client sent (curl -d sends a form's)."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if b"\\ud" in raw.lower() and _has_lone_surrogate(data):
        # JSON's escapes can spell half a UTF-16 pair, which no tokenizer takes (it raised a 500).
        raise APIError(400, "the request body's text holds a lone UTF-16 surrogate (an unpaired escape such as "
                       "\\ud800), which is not a character")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise _invalid_field(e.errors()) from None


def _has_lone_surrogate(data) -> bool:
    try:
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False


def _usage(stream: RequestStream) -> dict:
    return {"prompt_tokens": stream.num_prompt_tokens, "completion_tokens": stream.num_completion_tokens,
            "total_tokens": stream.num_prompt_tokens + stream.num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stream.num_cached_tokens}}


def _chunk(head: dict, content: dict | None, finish_reason, include_usage: bool, usage) -> dict:
    """An endpoint's event: head (id, object, created, model) and its one choice holding content
    (none in the usage-only chunk); with include_usage, usage as OpenAI sends it: null on every
    chunk but the last."""
    choices = [] if content is None else [{"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}]
    event = {**head, "choices": choices}
    if include_usage:
        event["usage"] = usage
    return event


async def _texts(stream: RequestStream):
    """The stream's text as it arrives: whatever queued up while the loop was busy goes out as one piece."""
    async for delta in stream:
        more = stream.drain()
        text = delta.text + (more.text if more else "")
        if text:
            yield text


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(state: ServerState, *, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="nvchat", docs_url=None, redoc_url=None, openapi_url=None)
    v1 = APIRouter(prefix="/v1")

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.get("/health")
    async def health():
        state.ready_engine()
        return {"status": "ok"}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    def start(body, prompt) -> RequestStream:
        engine = state.ready_engine()
        if body.model not in (None, state.model_name):
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {state.model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")
        try:
            params = body.sampling_params(engine.capabilities.context_length)
            stream = engine.submit(prompt() if callable(prompt) else prompt, params)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:  # the engine stopped between the check and the submission
            raise APIError(503, str(e), type="server_error") from None
        except Exception as e:
            # A bug, not the client's fault, but still an answer in OpenAI's shape that clients show
            # (a handler for Exception itself would answer after Starlette re-raised it, and uvicorn
            # then resets the connection before the client reads the answer).
            logger.exception("submitting a request failed")
            raise APIError(500, f"internal server error: {type(e).__name__}: {e}", type="server_error") from None
        state.open_streams.add(stream)
        return stream

    def finish(stream: RequestStream) -> None:
        stream.abort()  # nothing if it ended; otherwise the client left or the server is stopping
        state.open_streams.discard(stream)

    async def complete(stream: RequestStream, request: Request) -> RequestStream:
        """Waits for the whole reply, or for the client to leave (then aborts it)."""
        async def consume():
            async for _ in stream:
                pass

        reading = asyncio.ensure_future(consume())
        leaving = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({reading, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            reading.cancel()
            finish(stream)
        if stream.finish_reason == "abort":  # the engine stopped (had the client left, no one reads this)
            raise _shutting_down()
        if stream.finish_reason == "error":
            raise APIError(500, f"generation failed: {stream.error}", type="server_error")
        return stream

    def closing_events(stream: RequestStream, payload, empty, include_usage: bool) -> list[str]:
        """The events that end a stream: an error event if it did not finish normally; else the
        finish reason, a usage-only chunk if asked for, and [DONE]. payload(empty, ...) builds an
        endpoint's chunk."""
        if stream.finish_reason == "error":
            return [sse_event(APIError(500, f"generation failed: {stream.error}", type="server_error").body())]
        if stream.finish_reason == "abort":
            return [sse_event(_shutting_down().body())]
        events = [sse_event(payload(empty, stream.finish_reason))]
        if include_usage:
            events.append(sse_event(payload(empty, usage=_usage(stream), choices=False)))
        return events + [DONE]

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatCompletionRequest)
        stream = start(body, body.engine_messages)
        reply_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if not body.stream:
            await complete(stream, request)
            return {"id": reply_id, "object": "chat.completion", "created": created, "model": state.model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": stream.text},
                                 "logprobs": None, "finish_reason": stream.finish_reason}],
                    "usage": _usage(stream)}

        head = {"id": reply_id, "object": "chat.completion.chunk", "created": created, "model": state.model_name}

        def payload(delta: dict, finish_reason=None, usage=None, choices=True) -> dict:
            return _chunk(head, {"delta": delta} if choices else None, finish_reason, include_usage, usage)

        content_event = text_events(payload({"content": TEXT_SLOT}))

        async def events():
            yield sse_event(payload({"role": "assistant", "content": ""}))
            async for text in _texts(stream):
                yield content_event(text)
            for event in closing_events(stream, payload, {}, include_usage):
                yield event

        return EventStreamResponse(events(), on_close=lambda: finish(stream))

    @v1.post("/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest)
        stream = start(body, body.engine_prompt)
        reply_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)

        head = {"id": reply_id, "object": "text_completion", "created": created, "model": state.model_name}

        def payload(text: str, finish_reason=None, usage=None, choices=True) -> dict:
            return _chunk(head, {"text": text} if choices else None, finish_reason, include_usage, usage)

        if not body.stream:
            await complete(stream, request)
            return payload(stream.text, stream.finish_reason) | {"usage": _usage(stream)}

        text_event = text_events(payload(TEXT_SLOT))

        async def events():
            async for text in _texts(stream):
                yield text_event(text)
            for event in closing_events(stream, payload, "", include_usage):
                yield event

        return EventStreamResponse(events(), on_close=lambda: finish(stream))

    app.include_router(v1)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    return app


def _model_card(state: ServerState) -> dict:
    card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "nvchat"}
    if state.engine is not None and state.engine.capabilities.context_length is not None:
        card["max_model_len"] = state.engine.capabilities.context_length
    return card
