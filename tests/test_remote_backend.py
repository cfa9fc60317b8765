"""The remote backend (`--backend URL`) against a real `nvchat serve` app on a socket: streams,
abort, connection and HTTP errors, the REPL's /stats, and pipe mode in a subprocess."""
import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine import EngineThread, SamplingParams
from nvchat.remote_backend import RemoteBackend
from nvchat.server.app import ServerState, create_app
from nvchat.settings import Settings
from nvchat.slash_table import NO_BLOCK_STATS
from tests.serving import serving

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
    deadline = time.monotonic() + 30
    while engine.stats().num_used_blocks or engine.stats().num_running:
        assert time.monotonic() < deadline, "the server kept the aborted request"
        time.sleep(0.02)
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
