"""engine/text/tool_calls.py: a model's tool-call text parsed back into calls, whole or streamed in any
pieces; OpenAI messages made into what a chat template takes; the format picked from the template;
and the grammars that hold calls to their schemas, checked with llguidance against real text."""
import json
import random

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from engine.text.tool_calls import (
    HermesFormat,
    LlamaJsonFormat,
    ToolCall,
    Tools,
    template_renders_tools,
    tool_call_format,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = Tools([WEATHER, TIME])

HERMES_REPLY = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
                '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n')


def streamed(parser, text: str, rng: random.Random) -> tuple[str, list[ToolCall]]:
    """The text pushed through parser in random pieces, then finished."""
    out, calls, i = [], [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        piece, new_calls = parser.push(text[i:i + n])
        out.append(piece)
        calls += new_calls
        i += n
    tail, more = parser.finish()
    return "".join(out) + tail, calls + more


def summary(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_calls_are_parsed_from_a_whole_reply():
    content, calls = HermesFormat().parse(HERMES_REPLY)
    assert content == "Let me look."
    assert summary(calls) == [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert HermesFormat().parse("Just text, <b>bold</b> and a < sign.") == ("Just text, <b>bold</b> and a < sign.", [])


@pytest.mark.parametrize("seed", range(5))
def test_hermes_calls_streamed_in_any_pieces_match_the_whole_reply(seed):
    text, calls = streamed(HermesFormat().parser(), HERMES_REPLY, random.Random(seed))
    assert text == "Let me look.\n"
    assert summary(calls) == summary(HermesFormat().parse(HERMES_REPLY)[1])


def test_text_that_may_begin_a_call_is_held_back_until_decided():
    parser = HermesFormat().parser()
    assert parser.push("Hello <tool") == ("Hello ", [])
    assert parser.push("s are fun") == ("<tools are fun", [])
    assert parser.push(" <tool_call>\n{\"name\": \"get_time\",") == (" ", [])
    text, calls = parser.push(' "arguments": {}}\n</tool_call>')
    assert text == "" and summary(calls) == [("get_time", {})]


def test_a_block_that_is_no_call_is_text_and_an_unclosed_call_still_counts():
    assert HermesFormat().parse("<tool_call>not json</tool_call> ok") == ("<tool_call>not json</tool_call> ok", [])
    content, calls = HermesFormat().parse('<tool_call>\n{"name": "get_time", "arguments": {}}')
    assert content is None and summary(calls) == [("get_time", {})]
    assert HermesFormat().parse("<tool_call>\n{\"name\": \"get_ti") == ("<tool_call>\n{\"name\": \"get_ti", [])


def test_llama3_json_replies_are_calls_and_other_replies_stream_as_text():
    fmt = LlamaJsonFormat()
    content, calls = fmt.parse(' {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "F"}}', TOOLS)
    assert content is None and summary(calls) == [("get_weather", {"city": "Oslo", "unit": "F"})]
    _, calls = fmt.parse('{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}', TOOLS)
    assert len(calls) == 2
    parser = fmt.parser(TOOLS)
    assert parser.push("The answer") == ("The answer", [])  # decided at its first character
    assert fmt.parse('{"name": "unknown", "parameters": {}}', TOOLS) == ('{"name": "unknown", "parameters": {}}', [])
    assert fmt.parse('{"a": 1}', TOOLS) == ('{"a": 1}', [])


QWEN_LIKE = (  # renders tools and calls as Qwen's template does, written for this test
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n{%- endfor %}"
    "<|im_start|>assistant\n")
LLAMA_LIKE = ("{%- if tools is not none %}Given the following functions, respond with a JSON "
              "{\"name\": function name, \"parameters\": dictionary}.{% endif %}"
              "{%- for m in messages %}{{ m.content }}{% endfor %}")


def test_the_format_is_read_from_the_chat_template():
    assert tool_call_format(QWEN_LIKE).name == "hermes" and tool_call_format(QWEN_LIKE).renders_tools
    assert tool_call_format(LLAMA_LIKE).name == "llama3_json"
    plain = tool_call_format("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert plain.name == "hermes" and not plain.renders_tools
    assert not template_renders_tools(None) and not template_renders_tools("{% broken")


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
]


def test_a_template_that_renders_tools_gets_them_and_the_calls_as_objects(demo_model_path):
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path)
    messages, tools = tool_call_format(QWEN_LIKE).template_messages(CONVERSATION, TOOLS)
    assert tools == [WEATHER, TIME]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "C"}
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=QWEN_LIKE, tokenize=False)
    assert '"name": "get_weather"' in text.split("</tools>")[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n21 degrees" in text
    _, none = tool_call_format(QWEN_LIKE).template_messages(CONVERSATION, Tools([WEATHER], choice="none"))
    assert none is None


def test_a_template_without_tools_reads_them_and_the_calls_as_text():
    fmt = tool_call_format("{% for m in messages %}{{ m.content }}{% endfor %}")
    messages, tools = fmt.template_messages([{"role": "system", "content": "Be brief."}, *CONVERSATION], TOOLS)
    assert tools is None
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in system and "<tool_call>" in system
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                                      '"unit": "C"}}\n</tool_call>')
    assert messages[3]["content"] == "<tool_response>\n21 degrees\n</tool_response>"
    # The calls it writes are the ones its parser reads back.
    assert summary(fmt.parse(messages[2]["content"])[1]) == [("get_weather", {"city": "Paris", "unit": "C"})]


@pytest.mark.parametrize("bad,words", [
    ([], "non-empty list"),
    ([{"type": "code_interpreter"}], "tools[0] must be"),
    ([{"type": "function", "function": {"name": "has space"}}], "1 to 64 letters"),
    ([WEATHER, WEATHER], "same name"),
])
def test_bad_tools_are_refused_by_name(bad, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
        Tools(bad)


def test_a_tool_choice_must_name_an_offered_function():
    with pytest.raises(ValueError, match="no tool named 'nope'"):
        Tools([WEATHER], choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="tool_choice must be"):
        Tools([WEATHER], choice="sometimes")


@pytest.fixture(scope="module")
def matcher(demo_model_path):
    """A function making an llguidance matcher of a grammar over the demo model's tokenizer, and
    one telling whether it accepts a text whole."""
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path)
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
        assert not m.is_error(), m.get_error()
        ids = tokenizer.encode(text, add_special_tokens=False)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()
    return accepts


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'


def test_a_required_call_is_held_to_its_schema(matcher):
    grammar = HermesFormat().grammar(Tools([WEATHER, TIME], choice="required"))
    assert matcher(grammar, CALL)
    assert matcher(grammar, CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not matcher(grammar, "Sure! " + CALL)  # a call, nothing else
    assert not matcher(grammar, CALL.replace('"C"', '"K"'))  # unit outside its enum
    assert not matcher(grammar, CALL.replace(', "unit": "C"', ""))  # a required argument left out
    assert not matcher(grammar, CALL.replace("get_weather", "get_wetter"))
    single = HermesFormat().grammar(Tools([WEATHER, TIME], choice="required", parallel=False))
    assert matcher(single, CALL) and not matcher(single, CALL + "\n" + CALL)


def test_a_named_function_is_the_only_call(matcher):
    grammar = HermesFormat().grammar(Tools([WEATHER, TIME], choice={"type": "function", "function": {"name": "get_time"}}))
    assert matcher(grammar, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not matcher(grammar, CALL)
    llama = LlamaJsonFormat().grammar(Tools([WEATHER], choice="required"))
    assert matcher(llama, '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "F"}}')
    assert not matcher(llama, '{"name": "get_weather", "parameters": {"city": 3, "unit": "F"}}')


def test_auto_holds_only_strict_tools_calls_and_leaves_text_free(matcher):
    assert HermesFormat().grammar(Tools([WEATHER, TIME])) is None
    assert HermesFormat().grammar(Tools([WEATHER], choice="none")) is None
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    grammar = HermesFormat().grammar(Tools([strict]))
    assert matcher(grammar, "No call at all, just <b>text</b>.")
    assert matcher(grammar, "Let me check. " + CALL + " Done.")
    assert not matcher(grammar, "Let me check. " + CALL.replace('"Paris"', "Paris"))


def test_a_stream_offered_tools_carries_the_calls_apart_from_its_text():
    from engine.request_stream import RequestStream
    stream = RequestStream(1, 3, abort_fn=lambda s: None, tool_parser=HermesFormat().parser())
    for piece in ("Let me look.\n<tool", "_call>\n{\"name\": \"get_time\", ", '"arguments": {}}\n</tool_call>\n'):
        stream._push(piece, [7])
    stream._finish("stop")
    assert stream.text == "Let me look.\n" and summary(stream.tool_calls) == [("get_time", {})]
    assert stream.finish_reason == "tool_calls" and stream.token_ids == [7, 7, 7]
    deltas = list(stream)
    assert "".join(d.text for d in deltas) == "Let me look.\n"
    assert [c for d in deltas for c in d.tool_calls] == stream.tool_calls
    cut = RequestStream(2, 3, abort_fn=lambda s: None, tool_parser=HermesFormat().parser())
    cut._push("Hi <tool_c", [7])
    cut._finish("length")  # what was held back comes out, and an unfinished call is text
    assert (cut.text, cut.tool_calls, cut.finish_reason) == ("Hi <tool_c", [], "length")


def test_the_engine_renders_tools_for_a_template_without_them(demo_model_path):
    from engine import EngineThread
    with EngineThread(str(demo_model_path), device="cpu", max_model_len=1024) as engine:
        ids = engine.tokenize_chat(CONVERSATION, tools=TOOLS)
        text = engine.detokenize(ids)
        assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(WEATHER) in text
        assert "<tool_response>\n21 degrees\n</tool_response>" in text
        assert engine.detokenize(engine.tokenize_chat(CONVERSATION)).startswith("<|im_start|>user\n")
        with pytest.raises(ValueError, match="Tools"):
            engine.submit(CONVERSATION, tools=[WEATHER])
