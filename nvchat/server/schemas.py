"""The request bodies of the OpenAI API routes nvchat serves, as pydantic models FastAPI validates.

Strict types: a string where a number belongs is a client's bug to report (400), not to coerce.
Fields the engine has no use for (penalties, logprobs...) are accepted and ignored, as other
OpenAI-compatible servers do, except where ignoring one would change the answer (n > 1).
"""
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)

from engine import SamplingParams


def _float(name: str, value: float | int | None, default: float) -> float:
    if value is None:
        return default
    try:
        return float(value)
    except OverflowError:  # an integer past what a float holds
        raise ValueError(f"{name}: {str(value)[:20]}... is too large a number") from None


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None  # OpenAI requires it; left out, it means the one model served
    stream: StrictBool | None = False  # OpenAI's spec makes most fields nullable: null means the default
    stream_options: StreamOptions | None = None
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    top_k: StrictInt | None = None  # -1 is vLLM's "off", as 0 is ours
    max_tokens: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    n: Literal[1] | None = Field(1, description="one choice per request")
    ignore_eos: StrictBool = False  # vLLM's extension: replies of a known length, for benchmarks

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams (raises ValueError naming a bad value). OpenAI's defaults:
        temperature 1, no top-p/top-k filter, a reply as long as the context allows."""
        max_tokens = getattr(self, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = self.max_tokens
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or None)
        return SamplingParams(
            temperature=_float("temperature", self.temperature, 1.0),
            top_p=_float("top_p", self.top_p, 1.0),
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            stop=stop, seed=self.seed, ignore_eos=self.ignore_eos)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None

    def engine_messages(self) -> list[dict]:
        # "developer" is the newer name OpenAI gives the system role; chat templates know "system".
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] = Field(min_length=1)

    def engine_prompt(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("prompt: one prompt per request (n=1); send a list of prompts as separate requests")
            return self.prompt[0]
        return self.prompt
