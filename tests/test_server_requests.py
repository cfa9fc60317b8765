"""What `nvchat serve` makes of a request before generating: every field of OpenAI's API is served or
refused by name (none silently ignored), the audit's bad bodies get a 400 or 413 and leave the
connection and the other streams alone, a long prompt is tokenized off the event loop, and the
routes beside the completions (/v1/models/{id}, /tokenize, /detokenize, /metrics) answer as vLLM's."""
import json
import threading
import time

import httpx
import openai
import pytest

from engine import EngineThread
from nvchat.server.app import ServerState, create_app
from nvchat.server.schemas import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from tests.serving import serving

CONTEXT = 1024
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def engine(demo_model_path):
    engine = EngineThread(str(demo_model_path), device="cpu", max_model_len=CONTEXT, max_num_seqs=8).start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    with serving(create_app(ServerState("demo", engine))) as url:
        yield url


@pytest.fixture
def client(url):
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def post(url, path, body, **kwargs):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60, **kwargs)


def assert_refused(response, status: int, *words: str, param: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    for word in words:
        assert word in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    return error


CHAT_BODY = {"model": "demo", "messages": CHAT, "max_tokens": 2}
COMPLETION_BODY = {"model": "demo", "prompt": "x", "max_tokens": 2}

# OpenAI's fields this server does not implement, each set to a value that asks for something.
UNSUPPORTED = [
    ("chat", "audio", {"voice": "alloy", "format": "wav"}),
    ("chat", "modalities", ["text", "audio"]),
    ("chat", "prediction", {"type": "content", "content": "x"}),
    ("chat", "web_search_options", {}),
    ("chat", "reasoning_effort", "high"),
    ("chat", "verbosity", "low"),
    ("chat", "functions", [{"name": "f", "parameters": {}}]),
    ("chat", "function_call", "auto"),
    ("chat", "store", True),
    ("chat", "service_tier", "flex"),
    ("chat", "prompt_cache_retention", "24h"),
    ("completions", "best_of", 3),
    ("completions", "suffix", "the end"),
    # Not OpenAI's, not an extension this server implements:
    ("chat", "guided_json", {"type": "object"}),
    ("completions", "typical_p", 0.9),
    ("chat", "stream_options.include_obfuscation", True),
    ("chat", "messages[0].audio", None),
]


@pytest.mark.parametrize("endpoint,field,value", UNSUPPORTED, ids=[f"{e}-{f}" for e, f, _ in UNSUPPORTED])
def test_every_field_the_server_does_not_implement_is_a_400_naming_it(url, endpoint, field, value):
    body = json.loads(json.dumps(CHAT_BODY if endpoint == "chat" else COMPLETION_BODY))
    *outer, name = field.replace("[0]", ".0").split(".")
    place = body
    for key in outer:
        place = place[int(key)] if key.isdigit() else place.setdefault(key, {})
    place[name] = value
    response = post(url, "/chat/completions" if endpoint == "chat" else "/completions", body)
    assert_refused(response, 400, field, param=field)


IDLE = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "store": False,
        "modalities": ["text"], "service_tier": "auto", "logprobs": False, "top_logprobs": None, "audio": None,
        "response_format": {"type": "text"}, "user": "someone", "metadata": {"k": "v"}, "prompt_cache_key": "k",
        "safety_identifier": "id", "parallel_tool_calls": True, "stream_options": {"include_obfuscation": False}}


def test_a_field_that_asks_for_nothing_is_accepted(url):
    """Clients that send every field send their defaults: those ask for nothing this server lacks."""
    response = post(url, "/chat/completions", {**CHAT_BODY, **IDLE})
    assert response.status_code == 200, response.text
    response = post(url, "/completions", {**COMPLETION_BODY, "best_of": 1, "echo": False, "suffix": None, "n": 1})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("literal", [b"Infinity", b"-Infinity", b"NaN", b"1e400"])
def test_a_number_that_is_not_finite_is_a_400_naming_its_field(url, literal):
    body = b'{"model": "demo", "messages": [{"role": "user", "content": "x"}], "temperature": %s}' % literal
    assert_refused(post(url, "/chat/completions", body), 400, "temperature", "not a finite number", param="temperature")
    body = b'{"model": "demo", "prompt": "x", "top_p": [%s]}' % literal
    assert_refused(post(url, "/completions", body), 400, "top_p[0]", "not a finite number")


def test_json_nested_thousands_deep_is_a_400_and_the_connection_lives_on(url):
    with httpx.Client(timeout=60) as http:
        for depth in (5000, 150):
            body = '{"model": "demo", "prompt": "x", "user": ' + "[" * depth + "]" * depth + "}"
            response = http.post(url + "/completions", content=body)
            assert_refused(response, 400, "nests deeper than 100 levels")
        # The same keep-alive connection serves the next request.
        assert http.post(url + "/completions", json=COMPLETION_BODY).status_code == 200


def test_stop_strings_are_bounded_in_number_and_length(url):
    too_many = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    assert_refused(post(url, "/completions", {**COMPLETION_BODY, "stop": too_many}), 400,
                   f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    too_long = "x" * (MAX_STOP_LENGTH + 1)
    assert_refused(post(url, "/chat/completions", {**CHAT_BODY, "stop": too_long}), 400,
                   f"at most {MAX_STOP_LENGTH} characters", param="stop")
    at_the_bounds = ["x" * MAX_STOP_LENGTH] + [f"s{i}" for i in range(MAX_STOP_STRINGS - 1)]
    assert post(url, "/completions", {**COMPLETION_BODY, "stop": at_the_bounds}).status_code == 200


def test_max_tokens_past_the_context_is_a_400_naming_both_numbers(client, url):
    prompt_tokens = client.completions.create(model="demo", prompt="abc", max_tokens=1).usage.prompt_tokens
    room = CONTEXT - prompt_tokens
    error = assert_refused(post(url, "/completions", {**COMPLETION_BODY, "prompt": "abc", "max_tokens": room + 1}),
                           400, f"max_tokens is {room + 1}", f"context is {CONTEXT} tokens", param="max_tokens")
    assert f"leaves {room}" in error["message"]
    assert_refused(post(url, "/chat/completions", {**CHAT_BODY, "max_tokens": None, "max_completion_tokens": 10**6}),
                   400, "max_completion_tokens is 1000000", param="max_completion_tokens")
    exact = client.completions.create(model="demo", prompt="abc", max_tokens=room, extra_body={"ignore_eos": True})
    assert exact.usage.completion_tokens == room and exact.choices[0].finish_reason == "length"


@pytest.mark.parametrize("part,words", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, ["images are not supported"]),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, ["audio input is not supported"]),
    ({"type": "file", "file": {"file_id": "f"}}, ["files are not supported"]),
])
def test_a_content_part_other_than_text_is_a_400_saying_so(url, part, words):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    assert_refused(post(url, "/chat/completions", {**CHAT_BODY, "messages": messages}), 400, "messages[0].content",
                   *words)


def test_the_bearer_scheme_is_case_insensitive(engine):
    with serving(create_app(ServerState("demo", engine), api_key="s3cret")) as url:
        for scheme in ("Bearer", "bearer", "BEARER"):
            response = httpx.get(url + "/models", headers={"Authorization": f"{scheme} s3cret"})
            assert response.status_code == 200, scheme
        assert httpx.get(url + "/models", headers={"Authorization": "Basic s3cret"}).status_code == 401
        assert httpx.get(url + "/models", headers={"Authorization": "bearer"}).status_code == 401


def test_a_model_is_retrieved_by_its_id(client):
    model = client.models.retrieve("demo")
    assert model.id == "demo" and model.owned_by == "nvchat"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-9")


def test_a_body_over_the_limit_is_a_413_whether_its_length_is_declared_or_not(engine):
    with serving(create_app(ServerState("demo", engine, max_request_bytes=4096))) as url:
        big = json.dumps({**COMPLETION_BODY, "prompt": "word " * 2000}).encode()
        assert_refused(post(url, "/completions", big), 413, "limit of 4096 bytes")

        def chunked():  # no Content-Length: the limit is found as the body arrives
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]
        response = httpx.post(url + "/completions", content=chunked(), timeout=60)
        assert_refused(response, 413, "limit of 4096 bytes")
        assert post(url, "/completions", COMPLETION_BODY).status_code == 200


def test_a_long_prompt_being_tokenized_holds_up_neither_health_nor_other_streams(url, engine, monkeypatch):
    """A prompt of half a million characters takes seconds to tokenize (6 s on a loaded 2-core box
    with the demo model's byte-level tokenizer): it runs on a worker thread and beside the engine's
    own use of the tokenizer, so /health answers and another stream generates meanwhile. Before,
    both waited for the whole tokenization."""
    tokenizing, tokenized = threading.Event(), threading.Event()
    tokenize, submit = engine.llm.tokenize, engine.submit
    streams = []

    def observed_tokenize(text, *args, **kwargs):
        if len(text) < 100_000:  # the other request's
            return tokenize(text, *args, **kwargs)
        tokenizing.set()
        try:
            return tokenize(text, *args, **kwargs)
        finally:
            tokenized.set()

    def recorded_submit(*args, **kwargs):
        streams.append(submit(*args, **kwargs))
        return streams[-1]
    monkeypatch.setattr(engine.llm, "tokenize", observed_tokenize)
    monkeypatch.setattr(engine, "submit", recorded_submit)

    answers = {}
    big = {"model": "demo", "messages": [{"role": "user", "content": "many words " * 50_000}], "max_tokens": 4}
    body = {"model": "demo", "prompt": "x", "max_tokens": 240, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/completions", json=body) as other:
        lines = other.iter_lines()  # kept: a generator dropped here closes the response
        next(line for line in lines if line.startswith("data:"))  # under way
        sender = threading.Thread(target=lambda: answers.update(big=post(url, "/chat/completions", big)))
        sender.start()
        assert tokenizing.wait(60), "the long prompt never reached the tokenizer"
        generated = streams[0].num_completion_tokens
        health = http.get(url.removesuffix("/v1") + "/health")
        assert health.status_code == 200
        assert not tokenized.is_set(), "/health waited for the tokenizer"
        # The other stream's tokens, counted as the engine hands them over (its text is decoded first).
        deadline = time.monotonic() + 60
        while streams[0].num_completion_tokens < generated + 3 and not streams[0].finished:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert not tokenized.is_set(), "the other stream waited for the tokenizer"
        assert streams[0].num_completion_tokens >= generated + 3
        sender.join(120)
    assert_refused(answers["big"], 400, "too long for max_model_len")


def test_tokenize_and_detokenize_as_vllm_has_them(url, engine):
    base = url.removesuffix("/v1")
    reply = httpx.post(base + "/tokenize", json={"model": "demo", "prompt": "Hello there"}).json()
    assert reply["tokens"] == engine.tokenize("Hello there")
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == CONTEXT
    chat = httpx.post(base + "/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == engine.tokenize_chat(CHAT)
    text = httpx.post(base + "/detokenize", json={"model": "demo", "tokens": chat["tokens"]}).json()["prompt"]
    assert text == "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
    assert_refused(httpx.post(base + "/detokenize", json={"tokens": [10**9]}), 400, "outside the vocabulary")
    assert_refused(httpx.post(base + "/tokenize", json={"prompt": "x", "messages": CHAT}), 400, "either a prompt")
    assert_refused(httpx.post(base + "/tokenize", json={"prompt": "x", "return_token_strs": True}), 400,
                   "return_token_strs", param="return_token_strs")
    assert_refused(httpx.post(base + "/tokenize", json={"model": "gpt-9", "prompt": "x"}), 404, "does not exist")


def metric(text: str, name: str, **labels) -> float:
    """A sample's value from Prometheus's text format (0 if absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head == (f"{name}{{{wanted}}}" if labels else name):
            return float(value)
    return 0.0


def test_metrics_count_requests_tokens_and_latencies_and_show_the_cache(engine):
    with serving(create_app(ServerState("demo", engine))) as url, \
            openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as client:
        base = url.removesuffix("/v1")
        before = httpx.get(base + "/metrics")
        assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
        for _ in range(2):  # the second finds the first's prompt in the prefix cache
            client.completions.create(model="demo", prompt="The same prompt, twice over", max_tokens=5,
                                      extra_body={"ignore_eos": True})
        list(client.chat.completions.create(model="demo", messages=CHAT, max_tokens=3, stream=True,
                                            extra_body={"ignore_eos": True}))
        post(url, "/completions", {"model": "demo", "prompt": "x", "temperature": -1})
        text = httpx.get(base + "/metrics").text
    assert metric(text, "nvchat_requests_total", endpoint="completions", finish_reason="length") == 2
    assert metric(text, "nvchat_requests_total", endpoint="chat", finish_reason="length") == 1
    assert metric(text, "nvchat_requests_refused_total", endpoint="completions", status="400") == 1
    assert metric(text, "nvchat_generation_tokens_total", endpoint="completions") == 10
    assert metric(text, "nvchat_generation_tokens_total", endpoint="chat") == 3
    assert metric(text, "nvchat_prompt_tokens_cached_total", endpoint="completions") > 0
    assert metric(text, "nvchat_time_to_first_token_seconds_count", endpoint="completions") == 2
    assert metric(text, "nvchat_inter_token_latency_seconds_count", endpoint="chat") == 1
    assert metric(text, "nvchat_request_duration_seconds_count", endpoint="chat") == 1
    assert metric(text, "nvchat_kv_cache_blocks") > 0
    assert 0 <= metric(text, "nvchat_kv_cache_usage_ratio") <= 1
    assert 0 < metric(text, "nvchat_prefix_cache_hit_rate") <= 1
    assert metric(text, "nvchat_prefix_cache_hit_tokens_total") > 0


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
]


def test_tools_and_a_conversation_with_calls_reach_the_prompt(url):
    base = url.removesuffix("/v1")
    ids = httpx.post(base + "/tokenize", json={"messages": ROUND_TRIP, "tools": [WEATHER]}).json()["tokens"]
    prompt = httpx.post(base + "/detokenize", json={"tokens": ids}).json()["prompt"]
    # The demo model's template renders no tools: they and the calls are written out as text.
    assert json.dumps(WEATHER) in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n21 degrees\n</tool_response>" in prompt
    for choice in ("auto", "none"):
        response = post(url, "/chat/completions", {**CHAT_BODY, "messages": ROUND_TRIP, "tools": [WEATHER],
                                                    "tool_choice": choice})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("change,words,param", [
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, ["tools[0]"], None),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, ["tools[0].function.name", "1 to 64"],
     None),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     ["tool_choice", "no tool named 'nope'"], "tool_choice"),
    ({"tool_choice": "required"}, ["tool_choice", "needs tools"], "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, ["same name"], None),
    ({"messages": [{"role": "tool", "content": "21"}]}, ["messages[0].tool_call_id"], None),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, ["messages[0].tool_calls"], None),
    ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, ["messages[0].role"], None),
])
def test_bad_tools_and_tool_messages_are_a_400_naming_the_field(url, change, words, param):
    assert_refused(post(url, "/chat/completions", {**CHAT_BODY, **change}), 400, *words, param=param)


@pytest.mark.parametrize("endpoint,change,words", [
    ("chat", {"logprobs": True, "top_logprobs": 25}, ["top_logprobs", "0 to 20", "25"]),
    ("chat", {"top_logprobs": 2}, ["top_logprobs", "logprobs: true"]),
    ("chat", {"response_format": {"type": "xml"}}, ["response_format.type"]),
    ("chat", {"response_format": {"type": "json_schema"}}, ["json_schema"]),
    ("chat", {"logit_bias": {"abc": 3}}, ["logit_bias", "'abc'"]),
    ("chat", {"logit_bias": {"99999999": 3}}, ["logit_bias", "outside the vocabulary", "99999999"]),
    ("chat", {"logit_bias": {"5": 300}}, ["logit_bias[5]", "[-100.0, 100.0]"]),
    ("chat", {"min_tokens": 5}, ["min_tokens", "max_tokens (2)", "5"]),
    ("chat", {"presence_penalty": 3}, ["presence_penalty", "[-2.0, 2.0]"]),
    ("completions", {"n": 0}, ["n must be from 1 to 16"]),
    ("completions", {"logprobs": 21}, ["logprobs", "0 to 20", "21"]),
    ("completions", {"logprobs": 2, "echo": True}, ["echo", "cannot go with logprobs"]),
])
def test_a_bad_sampling_value_is_a_400_naming_its_field(url, endpoint, change, words):
    body = {**(CHAT_BODY if endpoint == "chat" else COMPLETION_BODY), **change}
    assert_refused(post(url, "/chat/completions" if endpoint == "chat" else "/completions", body), 400, *words)
