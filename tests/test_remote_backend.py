"""The remote backend (`--backend URL`) against a real `nvchat serve` app on a socket: streams,
abort, connection and HTTP errors, the REPL's /stats, and pipe mode in a subprocess; and against a
stand-in for llama.cpp's servers (tests/one_slot_server.py): no usage reported, one request at a time."""
import json
import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine import EngineThread, SamplingParams
from engine.text.tool_calls import Tools
from nvchat.remote_backend import ENDED_BY_ANOTHER_REQUEST, ENDED_EARLY, RemoteBackend
from nvchat.server.app import ServerState, create_app
from nvchat.settings import Settings
from nvchat.slash_table import NO_BLOCK_STATS
from tests.one_slot_server import MODEL, REPLY, OneSlotServer
from tests.serving import serving
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def engine(demo_model_path):
    with EngineThread(str(demo_model_path), device="cpu", max_model_len=512, max_num_seqs=8) as engine:
        yield engine


@pytest.fixture(scope="module")
def url(engine):
    with serving(create_app(ServerState("demo", engine))) as url:
        yield url


@pytest.fixture
def backend(url):
    with RemoteBackend(url) as backend:
        yield backend


@contextmanager
def _refusing_url():
    """A URL whose port is held bound, never listening, while in use: connections to it are refused,
    and no other socket (another test's server, say) can take the port in the meantime."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def test_streams_match_the_engine_and_run_concurrently(backend, engine):
    assert backend.model_name == "demo"  # the server's first model, asked at start
    assert backend.stats() is None
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=10, seed=5, ignore_eos=True)
    streams = [backend.submit(CHAT, params), backend.submit("Once upon", params)]
    local = engine.submit(CHAT, params)
    assert [s.request_id for s in streams] == [1, 2]
    pieces = [[d.text for d in s] for s in streams]
    local.wait()
    assert all(len(p) > 1 for p in pieces), "the reply arrives in pieces"
    assert streams[0].text == local.text and streams[0].finish_reason == "length"
    assert streams[1].finish_reason == "length" and streams[1].text
    assert streams[0].num_completion_tokens == 10 and streams[0].num_prompt_tokens == local.num_prompt_tokens
    assert streams[0].time_to_first_token is not None and streams[0].tokens_per_second


def test_abort_ends_the_stream_and_frees_the_servers_blocks(backend, engine):
    stream = backend.submit(CHAT, SamplingParams(max_tokens=400, ignore_eos=True))
    first = next(iter(stream))
    assert first.text
    stream.abort()
    assert stream.wait(30) and stream.finish_reason == "abort"
    wait_until(lambda: not (engine.stats().num_used_blocks or engine.stats().num_running), 30,
               "the server to drop the aborted request")
    assert stream.num_completion_tokens < 400


def test_http_and_connection_errors_end_the_stream(url):
    with RemoteBackend(url, model="no-such-model") as wrong_model:
        stream = wrong_model.submit(CHAT, SamplingParams(max_tokens=4))
        assert stream.wait(30) and stream.finish_reason == "error"
        assert "404" in stream.error and "no-such-model" in stream.error
        again = wrong_model.submit(CHAT, SamplingParams(max_tokens=4, temperature=0))
        assert again.wait(30) and again.finish_reason == "error"  # still usable, still answering

    with _refusing_url() as dead:
        with RemoteBackend(dead, model="demo") as unreachable:
            stream = unreachable.submit(CHAT)
            assert stream.wait(30) and stream.finish_reason == "error" and "could not reach" in stream.error
        with pytest.raises(RuntimeError, match="could not reach"):
            RemoteBackend(dead).start()  # no model named: it must ask the server, which isn't there


def test_repl_stats_say_blocks_are_not_available(backend, monkeypatch, tmp_path):
    from tests.test_repl import Driver
    for name in ("XDG_DATA_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    d = Driver(backend, Settings(backend="unused", temperature=0.0, max_tokens=6))
    try:
        d.type("hi\r")
        d.wait_for_messages(2)
        assert d.repl.last_stream.text
        d.type("/stats\r")
        d.wait_for(lambda: "last reply" in d.out.text, "/stats")
        assert NO_BLOCK_STATS in d.out.text
    finally:
        d.close()


def _pipe(url, *args):
    env = {**os.environ, "XDG_DATA_HOME": "/nonexistent-not-used", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "nvchat.cli", "-p", "Say hi", "--backend", url, "--max-tokens", "8",
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_pipe_mode_on_a_backend(url):
    done = _pipe(url, "--json")
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["text"] and reply["model"] == "demo" and reply["prompt_tokens"] > 0
    assert 1 <= reply["tokens"] <= 8

    with _refusing_url() as dead:
        refused = _pipe(dead, "--model", "demo")
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.startswith("nvchat: generation failed: could not reach")
    assert len(refused.stderr.strip().splitlines()) == 1


def _strict_openai_app(bodies: list):
    """A stand-in for OpenAI's own API, which can't run here: it refuses fields it doesn't know
    (as OpenAI answers top_k) and otherwise streams a fixed reply."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "gpt-x", "object": "model"}]})

    async def chat(request):
        body = await request.json()
        bodies.append(body)
        unknown = [f for f in body if f not in ("model", "messages", "stream", "stream_options", "temperature",
                                                "top_p", "max_tokens", "stop", "seed")]
        if unknown:
            return JSONResponse({"error": {"message": f"Unrecognized request argument supplied: {unknown[0]}",
                                           "type": "invalid_request_error", "param": None, "code": None}},
                                status_code=400)

        def events():
            for text, finish in (("Hi", None), (" there", "stop")):
                chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])


def test_a_server_that_refuses_top_k_gets_the_request_again_without_it():
    bodies = []
    with serving(_strict_openai_app(bodies)) as url, RemoteBackend(url) as backend:
        params = SamplingParams(temperature=0.7, top_k=20, max_tokens=8)
        first = backend.submit(CHAT, params)
        first.wait()
        assert (first.text, first.finish_reason) == ("Hi there", "stop")
        assert [("top_k" in b) for b in bodies] == [True, False]
        second = backend.submit(CHAT, params)
        second.wait()
        assert second.text == "Hi there" and len(bodies) == 3 and "top_k" not in bodies[2]


def _flaky_app():
    """A server that breaks in the ways real ones and the proxies before them do: it drops the
    connection mid-reply, or refuses with error bodies of other shapes than OpenAI's."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    refusals = {
        "vllm-style": JSONResponse({"object": "error", "message": "max_tokens is too large", "type": "BadRequestError",
                                    "param": None, "code": 400}, status_code=400),
        "fastapi-style": JSONResponse({"detail": "Not Found"}, status_code=404),
        "plain-error": JSONResponse({"error": "rate limited"}, status_code=429),
        "proxy": Response("<html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad Gateway</h1>"
                          "</center><hr><center>nginx</center></body></html>", status_code=502, media_type="text/html"),
    }

    async def chat(request):
        kind = (await request.json())["messages"][0]["content"]
        if kind in refusals:
            return refusals[kind]

        async def events():
            yield 'data: {"choices":[{"index":0,"delta":{"content":"Half a"},"finish_reason":null}]}\n\n'
            raise RuntimeError("the server process died")  # uvicorn cuts the connection mid-body
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.mark.parametrize("kind,expected", [
    ("vllm-style", "the server answered 400: max_tokens is too large"),
    ("fastapi-style", "the server answered 404: Not Found"),
    ("plain-error", "the server answered 429: rate limited"),
    ("proxy", "the server answered 502: 502 Bad Gateway"),
])
def test_error_bodies_of_any_shape_become_a_clear_message(kind, expected):
    with serving(_flaky_app()) as url, RemoteBackend(url, model="m") as backend:
        stream = backend.submit([{"role": "user", "content": kind}])
        assert stream.wait(30) and stream.finish_reason == "error"
        assert stream.error == expected


def test_a_server_gone_mid_reply_keeps_the_text_and_says_what_happened():
    with serving(_flaky_app()) as url, RemoteBackend(url, model="m") as backend:
        stream = backend.submit([{"role": "user", "content": "die"}])
        assert stream.wait(30) and stream.finish_reason == "error"
        assert stream.text == "Half a"
        # It was reached: "could not reach" would send the user looking at the wrong thing.
        assert "could not reach" not in stream.error
        assert stream.error.startswith(f"the connection to {url} broke mid-reply")


def test_what_a_server_does_not_report_is_unknown_not_zero():
    from nvchat.app.message_view import footer_text
    from nvchat.conversation import reply_stats
    from nvchat.slash_table import format_stats
    server = OneSlotServer(held=False)
    with serving(server.app) as url, RemoteBackend(url) as backend:
        stream = backend.submit(CHAT)
        assert stream.wait(30) and stream.finish_reason == "stop" and stream.text == "".join(REPLY)
    assert stream.num_prompt_tokens is None and stream.num_cached_tokens is None
    stats = reply_stats(stream)
    assert stats["prompt_tokens"] is None and stats["cached_tokens"] is None
    assert stats["tokens"] == len(REPLY)  # one a chunk, as the server streamed them
    assert "prompt size unknown" in footer_text(stats) and "prompt 0" not in footer_text(stats)
    assert "prompt size unknown" in format_stats(None, stream)
    assert "0 from the prefix cache" not in format_stats(None, stream)


def test_a_reported_prompt_without_cached_tokens_leaves_the_cache_unknown(backend):
    from nvchat.app.message_view import footer_text
    from nvchat.conversation import reply_stats
    stream = backend.submit(CHAT, SamplingParams(max_tokens=4))
    assert stream.wait(60) and stream.num_prompt_tokens > 0 and stream.num_cached_tokens is not None
    stream._set_usage({"prompt_tokens": 12, "completion_tokens": 4})  # as a server with no prompt_tokens_details
    assert stream.num_cached_tokens is None
    assert "prompt 12 (cached unknown)" in footer_text(reply_stats(stream))


def test_a_server_that_ends_a_stream_for_the_next_request_is_found_and_then_queued():
    server = OneSlotServer(owned_by="me")
    with serving(server.app) as url, RemoteBackend(url) as backend:
        assert backend.model_name == MODEL and not backend.capabilities.one_request_at_a_time
        first = backend.submit(CHAT)
        wait_until(lambda: first.text, 30, "the first reply's first chunk")
        second = backend.submit(CHAT)
        assert first.wait(30) and first.finish_reason == "error"
        assert first.error == ENDED_BY_ANOTHER_REQUEST and first.text == REPLY[0]  # its text is kept
        assert backend.capabilities.one_request_at_a_time
        server.release()
        assert second.wait(30) and second.finish_reason == "stop"
        # From now on tabs' requests wait for each other: none is cut off by the next.
        streams = [backend.submit(CHAT) for _ in range(3)]
        for stream in streams:
            assert stream.wait(30) and (stream.finish_reason, stream.text) == ("stop", "".join(REPLY))
        assert server.interrupted == 1 and server.requests == 5


def test_llama_servers_models_answer_queues_requests_from_the_start():
    server = OneSlotServer(owned_by="llamacpp", held=False)
    with serving(server.app) as url, RemoteBackend(url) as backend:
        assert backend.capabilities.one_request_at_a_time
        streams = [backend.submit(CHAT) for _ in range(4)]
        for stream in streams:
            assert stream.wait(30) and (stream.finish_reason, stream.text) == ("stop", "".join(REPLY))
        assert server.interrupted == 0 and server.most_at_once == 1


def test_a_stream_ended_without_a_finish_reason_says_so():
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def chat(request):
        async def events():
            yield 'data: {"choices":[{"index":0,"delta":{"content":"Half"},"finish_reason":null}]}\n\n'
        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    with serving(app) as url, RemoteBackend(url, model="m") as backend:
        stream = backend.submit(CHAT)
        assert stream.wait(30) and (stream.finish_reason, stream.error, stream.text) == ("error", ENDED_EARLY, "Half")
        assert not backend.capabilities.one_request_at_a_time


def test_pipe_mode_names_the_servers_model_and_prints_unknown_usage_as_null():
    server = OneSlotServer(held=False)
    with serving(server.app) as url:
        done = _pipe(url, "--json")
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["model"] == MODEL and reply["text"] == "".join(REPLY)
    assert reply["prompt_tokens"] is None and reply["cached_tokens"] is None






def test_n_replies_are_requests_sent_at_once_each_with_the_seed_the_engine_gives_that_sample(backend, engine):
    params = SamplingParams(temperature=1.0, top_k=20, max_tokens=6, seed=9, n=3, ignore_eos=True)
    with pytest.raises(ValueError, match="submit_n"):
        backend.submit(CHAT, params)
    streams = backend.submit_n(CHAT, params)
    local = engine.submit_n(CHAT, params)
    for stream in (*streams, *local):
        stream.wait()
    assert [s.sample_index for s in streams] == [0, 1, 2]
    assert [s.text for s in streams] == [s.text for s in local] and len({s.text for s in streams}) == 3
    assert all(s.finish_reason == "length" for s in streams)


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _tool_calling_app(bodies: list):
    """A stand-in for OpenAI's API streaming two tool calls as it does: per call an index, the id
    and name in its first piece, then its arguments' text in parts."""
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    pieces = [
        {"content": "Checking."},
        {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]},
        {"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    ]

    async def chat(request):
        bodies.append(await request.json())

        def events():
            for delta in pieces:
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta, 'finish_reason': None}]})}\n\n"
            yield 'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}\n\n'
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def test_tools_go_to_the_server_and_its_streamed_calls_come_back_whole():
    bodies = []
    tools = Tools([WEATHER_TOOL], choice="required", parallel=False)
    with serving(_tool_calling_app(bodies)) as url, RemoteBackend(url, model="m") as backend:
        stream = backend.submit(CHAT, SamplingParams(max_tokens=50), tools=tools)
        assert stream.wait(30)
        deltas = stream.drain()
    assert bodies[0]["tools"] == [WEATHER_TOOL] and bodies[0]["tool_choice"] == "required"
    assert bodies[0]["parallel_tool_calls"] is False
    assert (stream.text, stream.finish_reason) == ("Checking.", "tool_calls")
    assert [(c.id, c.name, json.loads(c.arguments)) for c in stream.tool_calls] == [
        ("call_a", "get_weather", {"city": "Oslo"}), ("call_b", "get_weather", {"city": "Rome"})]
    assert deltas.tool_calls == stream.tool_calls
