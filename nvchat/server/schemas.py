"""The request bodies of the OpenAI API routes nvchat serves, as pydantic models.

No silent ignoring: every field of OpenAI's chat and completions APIs is either implemented here or
refused with a 400 that names it (REFUSED says why), unless it holds the value that asks for
nothing (null, false, its default). Past OpenAI's fields, vLLM's extensions that this server
implements are accepted (EXTENSIONS); any other field is refused as unknown.

Strict types: a string where a number belongs is a client's bug to report (400), not to coerce.
"""
import re
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from engine import SamplingParams
from engine.text.tool_calls import Tools

# Stop strings are searched for in the text at every token (engine/text/detokenizer.py): 20,000 of
# them slowed another stream from 0.8 to 5.5 s. OpenAI takes at most 4.
MAX_STOP_STRINGS = 32
MAX_STOP_LENGTH = 256


def _is_off(*values):
    """A check that a refused field's value asks for nothing: null, or one of values."""
    return lambda value: value is None or any(value == v and type(value) is type(v) for v in values)


# OpenAI's fields that this server does not implement: (holds a value that asks for nothing, why not).
_REFUSED_CHAT = {
    "audio": (_is_off(), "audio output is not supported: the model answers in text"),
    "modalities": (_is_off(["text"]), "only text output is supported (modalities: [\"text\"])"),
    "prediction": (_is_off(), "predicted outputs are not supported"),
    "web_search_options": (_is_off(), "web search is not supported"),
    "reasoning_effort": (_is_off(), "reasoning effort is not supported; a model that thinks takes "
                                    "chat_template_kwargs: {\"enable_thinking\": true or false}"),
    "verbosity": (_is_off(), "verbosity is not supported"),
    "functions": (_is_off([]), "the deprecated functions API is not supported: send tools"),
    "function_call": (_is_off(), "the deprecated functions API is not supported: send tool_choice"),
    "store": (_is_off(False), "this server stores no completions"),
    "service_tier": (_is_off("auto", "default"), "service tiers are not supported"),
    "prompt_cache_retention": (_is_off(), "prompt cache retention is not configurable: the prefix cache keeps "
                                          "blocks until it needs their room"),
    "logprobs": (_is_off(False), "log-probabilities are not supported"),
    "top_logprobs": (_is_off(0), "log-probabilities are not supported"),
    "response_format": (_is_off({"type": "text"}), "only {\"type\": \"text\"} is supported"),
}
_REFUSED_BOTH = {
    "n": (_is_off(1), "one choice per request"),
    "frequency_penalty": (_is_off(0, 0.0), "penalties are not supported"),
    "presence_penalty": (_is_off(0, 0.0), "penalties are not supported"),
    "logit_bias": (_is_off({}), "logit_bias is not supported"),
}
_REFUSED_CHAT.update(_REFUSED_BOTH)
_REFUSED_COMPLETIONS = {
    "best_of": (_is_off(1), "best_of is not supported"),
    "suffix": (_is_off(""), "suffix (inserting text) is not supported"),
    "logprobs": (_is_off(), "log-probabilities are not supported"),
    "echo": (_is_off(False), "echo is not supported"),
    **_REFUSED_BOTH,
}
# Fields past OpenAI's that this server implements (vLLM's names and meanings).
EXTENSIONS = ("top_k", "ignore_eos", "chat_template_kwargs")


def refused_fields(data: dict, endpoint: str) -> tuple[str, str] | None:
    """The first field of a request body that asks for what this server does not do: (name, why)."""
    refused = _REFUSED_CHAT if endpoint == "chat" else _REFUSED_COMPLETIONS
    for name, value in data.items():
        if name in refused and not refused[name][0](value):
            return name, refused[name][1]
    return None


def without_idle_fields(data: dict, endpoint: str) -> dict:
    """The body without the refused fields that hold a value asking for nothing."""
    refused = _REFUSED_CHAT if endpoint == "chat" else _REFUSED_COMPLETIONS
    return {k: v for k, v in data.items() if k not in refused}


def _float(name: str, value: float | int | None, default: float) -> float:
    if value is None:
        return default
    try:
        return float(value)
    except OverflowError:  # an integer past what a float holds
        raise ValueError(f"{name}: {str(value)[:20]}... is too large a number") from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_UNSUPPORTED_PARTS = {
    "image_url": "images are not supported: this server's model reads text only",
    "input_audio": "audio input is not supported: this server's model reads text only",
    "file": "files are not supported: send their text",
}


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


def _content_parts(value):
    """Content parts: text only; an image, audio or file part is refused by name."""
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _UNSUPPORTED_PARTS:
                raise ValueError(_UNSUPPORTED_PARTS[kind])
    return value


Content = Annotated[StrictStr | list[TextPart] | None, Field(default=None)]


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCallMessagePart(_Strict):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content
    name: StrictStr | None = None
    tool_calls: list[ToolCallMessagePart] | None = None  # assistant
    tool_call_id: StrictStr | None = None  # tool
    refusal: None = None  # assistant: only null (this server's replies never refuse)
    reasoning_content: StrictStr | None = None  # assistant: the thinking a reasoning model's template may show

    _parts = field_validator("content", mode="before")(lambda cls, v: _content_parts(v))

    @model_validator(mode="after")
    def _fields_fit_the_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message holds tool calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("reasoning_content: only an assistant message holds reasoning")
        if self.role == "tool":
            if self.tool_call_id is None:
                raise ValueError("tool_call_id: a tool message names the call it answers")
        elif self.tool_call_id is not None:
            raise ValueError("tool_call_id: only a tool message answers a call")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: this field is required")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def engine_message(self) -> dict:
        # "developer" is the newer name OpenAI gives the system role; chat templates know "system".
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        for name in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return message


class StreamOptions(_Strict):
    include_usage: StrictBool | None = False
    # OpenAI pads streamed chunks against length side channels unless told not to; this server
    # sends no padding, so it takes only false.
    include_obfuscation: Literal[False] | None = None


_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class FunctionDefinition(_Strict):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON schema; none means a function of no arguments
    strict: StrictBool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _FUNCTION_NAME.fullmatch(name):
            raise ValueError("a function's name is 1 to 64 letters, digits, underscores or dashes")
        return name


class ToolDefinition(_Strict):
    type: StrictStr
    function: FunctionDefinition

    @field_validator("type")
    @classmethod
    def _function_tools_only(cls, kind: str) -> str:
        if kind != "function":
            raise ValueError(f"{kind!r} tools are not supported: only function tools")
        return kind


class NamedFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateKwargs(_Strict):
    """What the server passes to the model's chat template: Qwen3's thinking switch."""
    enable_thinking: StrictBool | None = None


class _Sampling(_Strict):
    model: StrictStr | None = None  # OpenAI requires it; left out, it means the one model served
    stream: StrictBool | None = False  # OpenAI's spec makes most fields nullable: null means the default
    stream_options: StreamOptions | None = None
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    top_k: StrictInt | None = None  # -1 is vLLM's "off", as 0 is ours
    max_tokens: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    ignore_eos: StrictBool = False  # vLLM's extension: replies of a known length, for benchmarks
    user: StrictStr | None = None  # an end user's id for abuse monitoring: nothing to do here

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_LENGTH:
            raise ValueError(f"a stop string is at most {MAX_STOP_LENGTH} characters, got one of {longest}")
        return stop

    @property
    def requested_max_tokens(self) -> tuple[str, int] | None:
        """The reply's length limit the client set, with the field that set it."""
        return None if self.max_tokens is None else ("max_tokens", self.max_tokens)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams (raises ValueError naming a bad value). OpenAI's defaults:
        temperature 1, no top-p/top-k filter, a reply as long as the context allows."""
        requested = self.requested_max_tokens
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or None)
        return SamplingParams(
            temperature=_float("temperature", self.temperature, 1.0),
            top_p=_float("top_p", self.top_p, 1.0),
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            max_tokens=default_max_tokens if requested is None else requested[1],
            stop=stop, seed=self.seed, ignore_eos=self.ignore_eos)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    # Accepted and unused: they ask nothing of the reply (metadata goes with store, which is refused).
    metadata: dict[str, StrictStr] | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None  # the prefix cache finds shared prompts by their tokens

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice: a tool choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {tool.function.name for tool in self.tools}:
                raise ValueError(f"tool_choice: there is no tool named {name!r}")
        return self

    @property
    def requested_max_tokens(self) -> tuple[str, int] | None:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().requested_max_tokens

    @property
    def enable_thinking(self) -> bool | None:
        return self.chat_template_kwargs.enable_thinking if self.chat_template_kwargs else None

    def engine_messages(self) -> list[dict]:
        return [m.engine_message() for m in self.messages]

    def engine_tools(self) -> Tools | None:
        if not self.tools:
            return None
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        return Tools([tool.model_dump(exclude_none=True) for tool in self.tools], choice or "auto",
                     self.parallel_tool_calls is not False)


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] = Field(min_length=1)

    def engine_prompt(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("prompt: one prompt per request (n=1); send a list of prompts as separate requests")
            return self.prompt[0]
        return self.prompt


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt's tokens, or chat messages' as the chat template renders them
    (with the assistant's turn begun)."""
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    add_special_tokens: StrictBool = True  # a prompt's: its tokenizer's BOS first, where it adds one
    messages: list[ChatMessage] | None = None
    add_generation_prompt: Literal[True] = True
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: Literal[False] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: send either a prompt or messages")
        if self.messages is not None and "add_special_tokens" in self.model_fields_set:
            raise ValueError("add_special_tokens: messages are tokenized as their chat template writes them")
        if self.tools and self.messages is None:
            raise ValueError("tools: tools are rendered with messages")
        return self

    def engine_tools(self) -> Tools | None:
        return Tools([tool.model_dump(exclude_none=True) for tool in self.tools]) if self.tools else None

    @property
    def enable_thinking(self) -> bool | None:
        return self.chat_template_kwargs.enable_thinking if self.chat_template_kwargs else None

    def engine_messages(self) -> list[dict]:
        return [m.engine_message() for m in self.messages]


class DetokenizeRequest(_Strict):
    model: StrictStr | None = None
    tokens: list[StrictInt]
