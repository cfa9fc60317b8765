"""Server-sent events as OpenAI streams them: `data: <json>` events, then `data: [DONE]`."""
import json

from starlette.responses import StreamingResponse

_SEPARATORS = (",", ":")
_SLOT = "\x00text\x00"


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=_SEPARATORS)}\n\n"


def text_events(payload: dict):
    """A maker of the events that differ only in their text: payload holds TEXT_SLOT where the text
    goes. Only the text is encoded per event (the rest, dumped once, is the bulk of each chunk)."""
    head, tail = json.dumps(payload, separators=_SEPARATORS).split(json.dumps(_SLOT))
    return lambda text: f"data: {head}{json.dumps(text)}{tail}\n\n"


TEXT_SLOT = _SLOT


class EventStreamResponse(StreamingResponse):
    """A streamed event response that runs on_close however it ends: finished, client gone, or
    cancelled by a shutdown, so the request behind it never outlives its reader."""

    def __init__(self, events, *, on_close):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
