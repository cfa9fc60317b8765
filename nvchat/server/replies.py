"""What the completion routes make of a request's streams (one per choice): their pieces as they
arrive, their usage, and their log-probabilities in OpenAI's two shapes (chat's and the legacy
completions')."""
import asyncio

from engine import RequestStream
from engine.core.sequence import TokenLogprobs

# What a log-probability of minus infinity (a token a constraint ruled out) is sent as: JSON has no
# infinity, and vLLM sends the same.
_RULED_OUT = -9999.0


def usage(streams: list[RequestStream]) -> dict:
    """OpenAI's usage: the prompt once (the choices share it), every choice's tokens."""
    prompt, completion = streams[0].num_prompt_tokens, sum(s.num_completion_tokens for s in streams)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": streams[0].num_cached_tokens}}


async def pieces(stream: RequestStream):
    """(text, tool calls, log-probabilities or None) as they arrive; whatever queued up while the
    loop was busy comes as one piece."""
    async for delta in stream:
        more = stream.drain()
        if more is None:
            yield delta.text, delta.tool_calls, delta.logprobs
        else:
            logprobs = None if delta.logprobs is None and more.logprobs is None else \
                (delta.logprobs or []) + (more.logprobs or [])
            yield delta.text + more.text, delta.tool_calls + more.tool_calls, logprobs


async def merged(streams: list[RequestStream]):
    """(choice index, piece) from every stream as it arrives, and (index, None) when one ends."""
    if len(streams) == 1:
        async for piece in pieces(streams[0]):
            yield 0, piece
        yield 0, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream):
        try:
            async for piece in pieces(stream):
                await queue.put((index, piece))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(streams)):
            while True:
                index, piece = await queue.get()
                yield index, piece
                if piece is None:
                    break
    finally:
        for task in tasks:
            task.cancel()


class TokenTexts:
    """Each token's text for log-probabilities (its decoding alone, special tokens included),
    decoded once per token id: top log-probabilities ask for up to 21 a token."""

    def __init__(self, detokenize):
        self.detokenize = detokenize
        self.known: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.known.get(token_id)
        if text is None:
            text = self.known[token_id] = self.detokenize([token_id])
        return text


def _logprob(value: float) -> float:
    return max(_RULED_OUT, value)


def chat_logprobs(entries: list[TokenLogprobs], text) -> dict:
    """Chat's choice.logprobs for these tokens: their text, log-probability, UTF-8 bytes and top
    alternatives. text: TokenTexts."""
    def entry(token_id: int, logprob: float) -> dict:
        token = text(token_id)
        return {"token": token, "logprob": _logprob(logprob), "bytes": list(token.encode())}

    return {"content": [{**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


class CompletionLogprobs:
    """The legacy completions' choice.logprobs, built piece by piece: each token's text,
    log-probability, top alternatives ({text: log-probability}) and offset in the choice's text."""

    def __init__(self, text, offset: int = 0):
        self.text, self.offset = text, offset

    def __call__(self, entries: list[TokenLogprobs]) -> dict:
        tokens, offsets = [], []
        for e in entries:
            token = self.text(e.token_id)
            tokens.append(token)
            offsets.append(self.offset)
            self.offset += len(token)
        return {"tokens": tokens, "token_logprobs": [_logprob(e.logprob) for e in entries],
                "top_logprobs": [{self.text(t): _logprob(lp) for t, lp in e.top} for e in entries],
                "text_offset": offsets}
