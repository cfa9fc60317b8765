"""Tool calls in a model's own text format: the one module that knows how tools reach a model and how
its calls come back, for `nvchat serve` (OpenAI's tools) and the app (MCP tools) alike.

A request offers `Tools`: OpenAI function definitions, a choice ("auto", "required", "none", or one
function by name) and whether several calls may come at once. Given the model's chat template,
`tool_call_format()` picks the format its calls take:

- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, anywhere in the reply
  and as often as the model likes (Qwen2.5, Qwen3, Hermes, and every template that writes
  <tool_call>). A template that renders no tools at all (SmolLM2's) gets this format too: the tools
  and the way to call them are written into its system message instead (`renders_tools` false).
- "llama3_json": the whole reply is `{"name": ..., "parameters": {...}}` (Llama 3.1 to 3.3).

A format then does four things, all plain text and JSON (no tokenizer, no grammar library):

    fmt = tool_call_format(tokenizer.chat_template)
    messages, tools_arg = fmt.template_messages(messages, tools)  # for apply_chat_template(tools=tools_arg)
    parser = fmt.parser(tools)       # parser.push(text) -> (text, [ToolCall]); parser.finish() likewise
    content, calls = fmt.parse(text, tools)   # the same for a whole reply
    grammar = fmt.grammar(tools)     # a Lark grammar (llguidance's dialect) constraining the calls, or None

template_messages() takes OpenAI-shaped chat messages, an assistant's `tool_calls` (arguments as JSON
text) and `tool` messages included, and returns what the template expects (arguments as objects),
or for a template without tools, the same turns in plain text. The parser holds back text that may
begin a call until it is decided, so streamed text never shows half a call tag. grammar() is
None where nothing is constrained: tool_choice "none", or "auto" without a `strict` tool. With
"required" the reply is one call or more (one where parallel calls are off), with a function named,
exactly one call of it, each call's arguments held to its function's parameter schema; with "auto"
and a strict tool, free text in which any call, once begun, is held to its schema.
"""
import functools
import json
import re
import uuid
from dataclasses import dataclass, field


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict:
        """As an OpenAI message's tool_calls entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Tools:
    """What a request offers the model. definitions: OpenAI function tools ({"type": "function",
    "function": {"name", "description", "parameters", "strict"}}); choice: "auto", "required",
    "none" or {"type": "function", "function": {"name": ...}}; parallel: whether a reply may hold
    several calls. Raises ValueError naming what is wrong."""

    definitions: list[dict]
    choice: str | dict = "auto"
    parallel: bool = True

    def __post_init__(self):
        if not isinstance(self.definitions, list) or not self.definitions:
            raise ValueError("tools must be a non-empty list of function tools")
        names = []
        for i, tool in enumerate(self.definitions):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)):
                raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
            name = function.get("name")
            if not (isinstance(name, str) and _FUNCTION_NAME.fullmatch(name)):
                raise ValueError(f"tools[{i}]: a function's name is 1 to 64 letters, digits, underscores or dashes")
            if not isinstance(function.get("parameters", {}), dict):
                raise ValueError(f"tools[{i}]: parameters must be a JSON schema object")
            names.append(name)
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        if self.forced_name is None and self.choice not in ("auto", "required", "none"):
            raise ValueError(f"tool_choice must be auto, required, none or a function, got {self.choice!r}")
        if self.forced_name is not None and self.forced_name not in names:
            raise ValueError(f"tool_choice: there is no tool named {self.forced_name!r}")

    @property
    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.definitions]

    @property
    def forced_name(self) -> str | None:
        """The function tool_choice names, if it names one."""
        if isinstance(self.choice, dict):
            function = self.choice.get("function")
            if self.choice.get("type") == "function" and isinstance(function, dict):
                return function.get("name")
            raise ValueError(f"tool_choice must be auto, required, none or a function, got {self.choice!r}")
        return None

    @property
    def offered(self) -> bool:
        """Whether the model is told of the tools and its calls are looked for (not with "none")."""
        return self.choice != "none"

    def parameters(self, name: str) -> dict:
        function = next(tool["function"] for tool in self.definitions if tool["function"]["name"] == name)
        return function.get("parameters") or _NO_ARGUMENTS

    def called(self) -> list[str]:
        """The functions a call may name: the one tool_choice names, else all."""
        forced = self.forced_name
        return [forced] if forced else self.names

    @property
    def any_strict(self) -> bool:
        return any(tool["function"].get("strict") for tool in self.definitions)


# --- chat templates ---------------------------------------------------------------------------------

def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the template reads a `tools` variable (else apply_chat_template drops the tools)."""
    if not chat_template:
        return False
    import jinja2.meta  # start-up: RequestStream imports this module, and a remote backend needs no jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(chat_template))
    except jinja2.TemplateSyntaxError:
        return False


@functools.lru_cache(maxsize=8)  # a template is parsed once, not at every request
def tool_call_format(chat_template: str | None) -> "ToolCallFormat":
    """The format the model with this chat template writes its calls in (see the module's doc)."""
    renders = template_renders_tools(chat_template)
    if renders and "<tool_call>" not in chat_template and (
            "<|python_tag|>" in chat_template or '"parameters": ' in chat_template):
        return LlamaJsonFormat()
    return HermesFormat(renders_tools=renders)


def _arguments_object(arguments):
    """A call's arguments as templates print them (`| tojson`): the object its JSON text spells."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments  # not JSON: the template prints it as it came
    return arguments


def _compact(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _call_from_json(value, arguments_key: str, names: list[str] | None) -> ToolCall | None:
    """A call from a decoded JSON value {"name": ..., arguments_key: {...}} ("arguments" or
    "parameters" either way), or None if it is not one (or, with names, names no such function)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if names is not None and value["name"] not in names:
        return None
    for key in (arguments_key, "arguments", "parameters"):
        if key in value:
            arguments = value[key]
            break
    else:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], _compact(arguments))


# Kept in the grammar's JSON as the models write it: compact but spaced, one line.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


def _call_schema(name: str, parameters: dict, arguments_key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False, "x-guidance": _JSON_STYLE}


class ToolCallFormat:
    name: str
    renders_tools: bool
    arguments_key: str

    def template_messages(self, messages: list[dict], tools: Tools | None) -> tuple[list[dict], list[dict] | None]:
        """OpenAI chat messages as the template takes them, and the tools to pass it (None where it
        takes none: the tools are not offered, or written into the messages)."""
        offered = tools is not None and tools.offered
        converted = [self._message(m) for m in messages]
        return converted, (list(tools.definitions) if offered else None)

    def _message(self, message: dict) -> dict:
        message = dict(message)
        if message.get("content") is None:
            message["content"] = ""
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "function": {**call["function"],
                                      "arguments": _arguments_object(call["function"].get("arguments"))}}
                for call in message["tool_calls"]]
        return message

    def parser(self, tools: Tools | None = None):
        raise NotImplementedError

    def parse(self, text: str, tools: Tools | None = None) -> tuple[str | None, list[ToolCall]]:
        """A whole reply's text (None if it holds only calls) and its calls."""
        parser = self.parser(tools)
        head, calls = parser.push(text)
        tail, more = parser.finish()
        content = head + tail
        calls += more
        if calls:
            content = content.strip() or None
        return content, calls

    def grammar(self, tools: Tools) -> str | None:
        raise NotImplementedError


class HermesFormat(ToolCallFormat):
    name = "hermes"
    arguments_key = "arguments"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, renders_tools: bool = True):
        self.renders_tools = renders_tools

    def template_messages(self, messages, tools):
        if self.renders_tools:
            return super().template_messages(messages, tools)
        # The template knows neither tools nor calls: both become the text the model reads.
        converted = []
        for message in messages:
            message = self._message(message)
            if message["role"] == "tool":
                response = f"<tool_response>\n{message['content']}\n</tool_response>"
                if converted and converted[-1].get("tool_responses"):
                    converted[-1]["content"] += "\n" + response
                else:
                    converted.append({"role": "user", "content": response, "tool_responses": True})
                continue
            if message.get("tool_calls"):
                calls = "\n".join(self._call_text(call["function"]) for call in message.pop("tool_calls"))
                message["content"] = f"{message['content']}\n{calls}" if message["content"] else calls
            converted.append(message)
        for message in converted:
            message.pop("tool_responses", None)
        if tools is not None and tools.offered:
            instructions = self._instructions(tools)
            if converted and converted[0]["role"] == "system":
                converted[0] = {**converted[0], "content": f"{converted[0]['content']}\n\n{instructions}"}
            else:
                converted.insert(0, {"role": "system", "content": instructions})
        return converted, None

    def _call_text(self, function: dict) -> str:
        arguments = function.get("arguments")
        arguments = arguments if isinstance(arguments, str) else _compact(arguments)
        return f'{self.OPEN}\n{{"name": {_compact(function["name"])}, "arguments": {arguments}}}\n{self.CLOSE}'

    @staticmethod
    def _instructions(tools: Tools) -> str:
        signatures = "\n".join(_compact(tool) for tool in tools.definitions)
        return ("# Tools\n\nYou may call functions to answer. Their signatures, as JSON, are within <tools></tools>:"
                f"\n<tools>\n{signatures}\n</tools>\n\nTo call one, write a JSON object with its name and "
                "arguments within <tool_call></tool_call> tags, a call a block:\n<tool_call>\n"
                '{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>')

    def parser(self, tools: Tools | None = None) -> "HermesParser":
        return HermesParser()

    def grammar(self, tools: Tools) -> str | None:
        choice = tools.choice
        if choice == "none" or (choice == "auto" and not tools.any_strict):
            return None
        bodies = " | ".join(f"fn_{i}" for i in range(len(tools.called())))
        rules = "".join(
            f"fn_{i}: %json {_compact(_call_schema(name, tools.parameters(name), self.arguments_key))}\n"
            for i, name in enumerate(tools.called()))
        call = f'"\\n" ({bodies}) "\\n</tool_call>"'
        if choice == "auto":
            # Free text, in which a call, once its tag is written, is held to its function's schema.
            return ("%llguidance {}\nstart: call* TEXT\n"
                    f"call: call_tag {call}\ncall_tag[lazy]: TEXT \"<tool_call>\"\nTEXT: /(.|\\n)*/\n{rules}")
        several = tools.forced_name is None and tools.parallel
        start = 'start: call ("\\n" call)*' if several else "start: call"
        return f'%llguidance {{}}\n{start}\ncall: "<tool_call>" {call}\n{rules}'


def _partial_tail(text: str, tag: str) -> int:
    """How many characters at the end of text could begin tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesParser:
    """Calls in <tool_call> blocks, anywhere in the text. Text that may begin a block is held back
    until it is decided; a block whose JSON is not a call is given back as text; text of blank
    space between or after calls is dropped."""

    def __init__(self):
        self.buffer = ""
        self.in_call = False
        self.seen_call = False
        self.blank = ""  # blank text after a call, held until text that is not blank follows

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        out = []
        while True:
            if not self.in_call:
                start = self.buffer.find(HermesFormat.OPEN)
                if start < 0:
                    keep = _partial_tail(self.buffer, HermesFormat.OPEN)
                    out.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                out.append(self.buffer[:start])
                self.buffer = self.buffer[start + len(HermesFormat.OPEN):]
                self.in_call = True
            else:
                end = self.buffer.find(HermesFormat.CLOSE)
                if end < 0:
                    break
                body, self.buffer = self.buffer[:end], self.buffer[end + len(HermesFormat.CLOSE):]
                self.in_call = False
                call = self._call(body)
                if call is None:
                    out.append(HermesFormat.OPEN + body + HermesFormat.CLOSE)
                else:
                    out.append(call)
        return self._text_and_calls(out)

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        try:
            return _call_from_json(json.loads(body), "arguments", None)
        except json.JSONDecodeError:
            return None

    def _text_and_calls(self, pieces: list) -> tuple[str, list[ToolCall]]:
        text, calls = [], []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                calls.append(piece)
                self.seen_call, self.blank = True, ""
            elif self.seen_call and not (self.blank + piece).strip():
                self.blank += piece
            elif piece:
                text.append(self.blank + piece)
                self.blank = ""
        return "".join(text), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the reply: what was held back. A call whose closing tag never came (the
        reply stopped right after its JSON) still counts if its JSON is whole."""
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return self._text_and_calls([rest])
        self.in_call = False
        call = self._call(rest)
        return self._text_and_calls([call if call is not None else HermesFormat.OPEN + rest])


class LlamaJsonFormat(ToolCallFormat):
    name = "llama3_json"
    arguments_key = "parameters"
    renders_tools = True

    def parser(self, tools: Tools | None = None) -> "JsonReplyParser":
        return JsonReplyParser(tools.names if tools is not None else None, self.arguments_key)

    def grammar(self, tools: Tools) -> str | None:
        if tools.choice in ("none", "auto"):
            # The whole reply is the call, so a call cannot be held to its schema once begun
            # without holding every reply that starts with "{" to it.
            return None
        bodies = " | ".join(f"fn_{i}" for i in range(len(tools.called())))
        rules = "".join(
            f"fn_{i}: %json {_compact(_call_schema(name, tools.parameters(name), self.arguments_key))}\n"
            for i, name in enumerate(tools.called()))
        return f"%llguidance {{}}\nstart: {bodies}\n{rules}"


class JsonReplyParser:
    """A reply that is a JSON call (or several, separated by ";"), or else text: held back from
    its first character if that is "{", until the reply ends; streamed as it comes otherwise."""

    def __init__(self, names: list[str] | None, arguments_key: str):
        self.names, self.arguments_key = names, arguments_key
        self.buffer = ""
        self.mode: str | None = None  # None until the first character that is not blank: "json" or "text"

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.mode == "text":
            return text, []
        self.buffer += text
        if self.mode is None:
            head = self.buffer.lstrip()
            if not head:
                return "", []
            self.mode = "json" if head[0] == "{" else "text"
            if self.mode == "text":
                text, self.buffer = self.buffer, ""
                return text, []
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buffer = self.buffer, ""
        if self.mode != "json":
            return rest, []
        calls = []
        decoder = json.JSONDecoder()
        position, rest_stripped = 0, rest.strip()
        while position < len(rest_stripped):
            try:
                value, position = decoder.raw_decode(rest_stripped, position)
            except json.JSONDecodeError:
                return rest, []
            call = _call_from_json(value, self.arguments_key, self.names)
            if call is None:
                return rest, []
            calls.append(call)
            while position < len(rest_stripped) and rest_stripped[position] in " \t\r\n;":
                position += 1
        return "", calls
