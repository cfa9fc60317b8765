"""The request bodies of the OpenAI API routes nvchat serves, as pydantic models.

No silent ignoring: every field of OpenAI's chat and completions APIs is either implemented here or
refused with a 400 that names it (_REFUSED_* say why), unless it holds the value that asks for
nothing (null, false, its default). Past OpenAI's fields, the vLLM extensions this server implements
are accepted (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, chat_template_kwargs); any
other field is refused as unknown.

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
from engine.core.sampling_params import MAX_LOGPROBS, StructuredOutput
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
}
_REFUSED_COMPLETIONS = {
    "best_of": (_is_off(1), "best_of is not supported: send n"),
    "suffix": (_is_off(""), "suffix (inserting text) is not supported"),
}
# The most choices one request may ask for (each is a sequence the engine runs at once).
MAX_N = 16


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
    # The openai client's stream helper keeps each streamed call's delta index in the message it
    # assembles; the call's place in the list says the same, so it is accepted and not needed.
    index: StrictInt | None = None


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
            message["tool_calls"] = [call.model_dump(exclude={"index"}) for call in self.tool_calls]
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
    n: StrictInt | None = None
    frequency_penalty: StrictFloat | StrictInt | None = None
    presence_penalty: StrictFloat | StrictInt | None = None
    logit_bias: dict[StrictStr, StrictFloat | StrictInt] | None = None  # token id (as JSON's keys are text) -> bias
    # vLLM's extensions:
    min_p: StrictFloat | StrictInt | None = None
    repetition_penalty: StrictFloat | StrictInt | None = None
    min_tokens: StrictInt | None = None
    ignore_eos: StrictBool = False  # replies of a known length, for benchmarks
    user: StrictStr | None = None  # an end user's id for abuse monitoring: nothing to do here

    @field_validator("n")
    @classmethod
    def _bounded_n(cls, n):
        if n is not None and not 1 <= n <= MAX_N:
            raise ValueError(f"n must be from 1 to {MAX_N}, got {n}")
        return n

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

    @property
    def choices(self) -> int:
        return self.n or 1

    def sampling_params(self, max_tokens: int, recommended: dict | None = None) -> SamplingParams:
        """The engine's SamplingParams (raises ValueError naming a bad value). A value the request
        leaves out is the model's recommended one (recommended: {SamplingParams field: value}, as
        vLLM takes a checkpoint's generation_config), else OpenAI's default: temperature 1, no
        filter, no penalty."""
        recommended = recommended or {}

        def number(name: str, default: float) -> float:
            value = getattr(self, name)
            return _float(name, value, recommended.get(name, default))

        top_k = recommended.get("top_k", 0) if self.top_k is None else self.top_k
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or None)
        return SamplingParams(
            temperature=number("temperature", 1.0), top_p=number("top_p", 1.0), top_k=0 if top_k == -1 else top_k,
            min_p=number("min_p", 0.0), repetition_penalty=number("repetition_penalty", 1.0),
            presence_penalty=number("presence_penalty", 0.0), frequency_penalty=number("frequency_penalty", 0.0),
            logit_bias=self.logit_bias or None, min_tokens=self.min_tokens or 0, max_tokens=max_tokens,
            stop=stop, seed=self.seed, ignore_eos=self.ignore_eos, n=self.choices, logprobs=self.engine_logprobs,
            structured_output=self.structured_output)

    @property
    def engine_logprobs(self) -> int | None:
        """SamplingParams.logprobs: how many top alternatives each token reports, None for none."""
        return None

    @property
    def structured_output(self) -> StructuredOutput | None:
        return None


class JsonSchemaFormat(_Strict):
    name: StrictStr
    description: StrictStr | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None  # the reply is held to the schema whether or not it is set


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: goes with type json_schema, which needs it")
        return self

    def engine_constraint(self) -> StructuredOutput | None:
        if self.type == "json_object" or (self.type == "json_schema" and self.json_schema.schema_ is None):
            return StructuredOutput(json_object=True)
        if self.type == "json_schema":
            return StructuredOutput(json_schema=self.json_schema.schema_)
        return None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    # Accepted and unused: they ask nothing of the reply (metadata goes with store, which is refused).
    metadata: dict[str, StrictStr] | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None  # the prefix cache finds shared prompts by their tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def structured_output(self) -> StructuredOutput | None:
        return self.response_format.engine_constraint() if self.response_format else None

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: goes with logprobs: true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs: must be from 0 to {MAX_LOGPROBS}, got {self.top_logprobs}")
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
    logprobs: StrictInt | None = None  # how many alternatives each token reports
    echo: StrictBool | None = None

    @model_validator(mode="after")
    def _echo_without_logprobs(self):
        if self.echo and self.logprobs is not None:
            raise ValueError("echo: the engine does not compute the prompt's log-probabilities, so echo cannot go "
                             "with logprobs")
        return self

    @property
    def engine_logprobs(self) -> int | None:
        return self.logprobs

    def engine_prompt(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("prompt: one prompt per request; send a list of prompts as separate requests")
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
