"""`nvchat serve` over real sockets: the official openai client against the demo model on CPU,
concurrent and abandoned streams, every bad input's status code, the API key, and a real
`nvchat serve` process stopped by SIGTERM mid-stream."""
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from engine import EngineThread
from nvchat.server.app import ServerState, create_app
from tests.serving import serving
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
ENGINE_ARGS = dict(device="cpu", max_model_len=256, max_num_seqs=16)
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def engine(demo_model_path):
    engine = EngineThread(str(demo_model_path), **ENGINE_ARGS).start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    """The served app and its URL; `submitted` collects every engine stream the server starts."""
    state = ServerState("demo", engine)
    submitted = []
    submit = engine.submit

    def recording_submit(*args, **kwargs):
        stream = submit(*args, **kwargs)
        submitted.append(stream)
        return stream

    engine.submit = recording_submit
    with serving(create_app(state)) as url:
        yield url, state, submitted
    del engine.submit


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server[0], api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def wait_idle(engine, timeout=30.0):
    """Until the engine has no request and holds no block (its snapshot trails by a step)."""
    def idle_snapshot():
        snap = engine.stats()
        return snap if snap.num_running == snap.num_waiting == 0 and snap.num_used_blocks == 0 else None
    return wait_until(idle_snapshot, timeout, "the engine to have no request and hold no block")


def test_chat_streamed_equals_non_streamed(client):
    args = dict(model="demo", messages=CHAT, max_tokens=12, seed=7, temperature=0.9, top_p=0.95,
                extra_body={"top_k": 40, "ignore_eos": True})
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed and streamed
    assert whole.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens > 0
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 12
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    # The second identical prompt found the first's blocks in the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_completion_streamed_equals_non_streamed(client):
    args = dict(model="demo", prompt="Once upon a time", max_tokens=10, seed=3, temperature=1.0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True))
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks) != ""
    assert chunks[-1].choices[0].finish_reason == "length"
    # As OpenAI: usage only when asked for, then null on every chunk but a last one of its own.
    assert not any("usage" in c.model_fields_set for c in chunks)
    counted = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert all("usage" in c.model_fields_set and c.usage is None for c in counted[:-1])
    assert counted[-1].choices == [] and counted[-1].usage.completion_tokens == whole.usage.completion_tokens == 10
    assert "".join(c.choices[0].text for c in counted[:-1]) == whole.choices[0].text


def test_stop_and_greedy(client):
    greedy = client.completions.create(model="demo", prompt="abc", max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    assert greedy == client.completions.create(model="demo", prompt="abc", max_tokens=16, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].text
    stop = next((c for c in greedy[3:] if c.strip()), None)
    if stop is None:
        pytest.skip("the demo model's greedy text has no visible character to stop on")
    cut = client.completions.create(model="demo", prompt="abc", max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert greedy.startswith(cut.choices[0].text) and stop not in cut.choices[0].text


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert httpx.get(server[0].removesuffix("/v1") + "/health").json() == {"status": "ok"}
    # OpenAI requires "model"; like vLLM, this server takes its absence to mean the model it serves.
    reply = _post(server[0], "/completions", {"prompt": "x", "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["model"] == "demo"


def test_concurrent_streams_with_disconnects(server, engine):
    url, state, submitted = server
    submitted.clear()
    rng = random.Random(0)
    # Clients that leave do so after a few chunks, long before their max_tokens could run out.
    leave_after = [rng.randint(1, 4) if i % 3 == 0 else None for i in range(16)]

    async def one(client, i):
        stream = await client.chat.completions.create(
            model="demo", messages=[{"role": "system", "content": "Shared system prompt. " * 4},
                                    {"role": "user", "content": f"client {i}"}],
            max_tokens=120 if leave_after[i] else 8, stream=True, extra_body={"ignore_eos": True})
        text, n = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                n += 1
                if leave_after[i] and n >= leave_after[i]:
                    await stream.close()  # the client goes away mid-stream
                    return None
        return text

    async def all_clients():
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    texts = asyncio.run(all_clients())
    assert all(t for t, leaves in zip(texts, leave_after) if not leaves)
    snap = wait_idle(engine)
    assert snap.num_free_blocks == snap.num_blocks  # nothing leaked
    assert len(submitted) == 16 and all(s.finished for s in submitted)
    reasons = [s.finish_reason for s in submitted]
    assert reasons.count("abort") == sum(1 for x in leave_after if x) and reasons.count("length") == 16 - reasons.count("abort")
    assert all(s.num_completion_tokens < 120 for s in submitted)
    assert sum(s.num_cached_tokens for s in submitted) > 0  # the shared system prompt was reused
    assert not state.open_streams


def test_a_client_that_leaves_a_non_streamed_request_aborts_it(server, engine):
    url, state, submitted = server
    submitted.clear()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    body = json.dumps({"model": "demo", "prompt": "x", "max_tokens": 220, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: submitted and submitted[0].num_completion_tokens, 30, "the request to start generating")
    # The connection is closed while the reply is far from done.
    assert submitted[0].wait(30) and submitted[0].finish_reason == "abort"
    assert submitted[0].num_completion_tokens < 220
    wait_idle(engine)
    assert not state.open_streams


def _post(url, path, body, **kwargs):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60,
                      **kwargs)


BAD_REQUESTS = [
    ("bad json", "/chat/completions", b'{"model": "demo", "messages": [', 400),
    ("not an object", "/chat/completions", b"[1, 2]", 400),
    ("wrong type", "/chat/completions", {"model": "demo", "messages": CHAT, "temperature": "hot"}, 400),
    ("messages not a list", "/chat/completions", {"model": "demo", "messages": "hi"}, 400),
    ("missing messages", "/chat/completions", {"model": "demo"}, 400),
    ("bad role", "/chat/completions", {"model": "demo", "messages": [{"role": "robot", "content": "x"}]}, 400),
    ("negative temperature", "/chat/completions", {"model": "demo", "messages": CHAT, "temperature": -1}, 400),
    ("top_p of 0", "/completions", {"model": "demo", "prompt": "x", "top_p": 0}, 400),
    ("max_tokens of 0", "/completions", {"model": "demo", "prompt": "x", "max_tokens": 0}, 400),
    ("max_completion_tokens of 0", "/chat/completions", {"model": "demo", "messages": CHAT, "max_completion_tokens": 0},
     400),
    ("temperature past a float", "/completions", {"model": "demo", "prompt": "x", "temperature": 10**400}, 400),
    # JSON may escape a lone UTF-16 surrogate, which is no character and no tokenizer takes.
    ("lone surrogate", "/completions", b'{"model": "demo", "prompt": "a\\ud800b", "max_tokens": 2}', 400),
    ("lone surrogate in chat", "/chat/completions",
     b'{"model": "demo", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', 400),
    ("negative top_k", "/completions", {"model": "demo", "prompt": "x", "top_k": -2}, 400),
    ("n past its bound", "/completions", {"model": "demo", "prompt": "x", "n": 17}, 400),
    ("empty prompt", "/completions", {"model": "demo", "prompt": ""}, 400),
    ("prompt over the context", "/completions", {"model": "demo", "prompt": "word " * 400}, 400),
    ("chat over the context", "/chat/completions",
     {"model": "demo", "messages": [{"role": "user", "content": "word " * 400}], "stream": True}, 400),
    ("unknown model", "/chat/completions", {"model": "gpt-9", "messages": CHAT}, 404),
]


@pytest.mark.parametrize("name,path,body,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_its_status_and_the_server_keeps_serving(server, name, path, body, status):
    url = server[0]
    response = _post(url, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    ok = _post(url, "/completions", {"model": "demo", "prompt": "still there?", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_a_top_k_past_int64_harms_no_other_stream(client, server):
    """A top_k past int64 once overflowed the sampler's tensor, failing the step and with it every
    stream in the batch. Any top_k from the vocabulary's size up keeps every token; -1 (vLLM's
    "off") too."""
    args = dict(model="demo", prompt="a long one", max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
    with client.completions.create(**args, stream=True) as other:
        chunks = iter(other)
        next(chunks)  # under way, with ~200 steps to go
        huge = _post(server[0], "/completions", {"model": "demo", "prompt": "x", "max_tokens": 4, "top_k": 2**64})
        off = _post(server[0], "/completions", {"model": "demo", "prompt": "x", "max_tokens": 4, "top_k": -1})
        rest = list(chunks)
    assert huge.status_code == 200 and huge.json()["usage"]["completion_tokens"] == 4, huge.text
    assert off.status_code == 200, off.text
    assert rest[-1].choices[0].finish_reason == "length"


NULLABLE = {"n": None, "stream": None, "stream_options": None, "seed": None, "stop": None, "temperature": None,
            "top_p": None, "max_tokens": None, "logprobs": None, "user": None}


@pytest.mark.parametrize("path,body", [("/completions", {"prompt": "x"}), ("/chat/completions", {"messages": CHAT})])
def test_null_means_the_default_for_every_field_the_spec_makes_nullable(server, path, body):
    """OpenAI's spec gives these fields 'or null', and clients that send every field send nulls."""
    response = _post(server[0], path, {**body, **NULLABLE, "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_a_chat_template_that_refuses_the_messages_gets_a_400(client, engine, monkeypatch):
    """Templates raise on conversations they can't render (Gemma's on a system message, Llama 2's on
    roles out of turn); that is the client's error to read, not a bare 500."""
    tokenizer = engine.llm.tokenizer
    monkeypatch.setattr(tokenizer, "chat_template", "{% for m in messages %}{% if m['role'] == 'system' %}"
                        "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(openai.BadRequestError, match="System role not supported"):
        client.chat.completions.create(model="demo", messages=CHAT, max_tokens=2)
    monkeypatch.undo()
    # Served again (the demo model may draw EOS first, so the reply's text can be empty).
    assert client.chat.completions.create(model="demo", messages=CHAT, max_tokens=2).usage.completion_tokens >= 1


def test_an_unexpected_error_in_a_submission_is_a_500_in_openais_shape_and_the_server_keeps_serving(client, engine, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("a bug")
    monkeypatch.setattr(engine.llm, "render_chat", broken)
    with pytest.raises(openai.InternalServerError) as error:
        client.chat.completions.create(model="demo", messages=CHAT, max_tokens=2)
    assert error.value.status_code == 500
    assert error.value.body == {"message": "internal server error: KeyError: 'a bug'", "type": "server_error",
                                "param": None, "code": None}
    monkeypatch.undo()
    # Served again (the demo model may draw EOS first, so the reply's text can be empty).
    assert client.chat.completions.create(model="demo", messages=CHAT, max_tokens=2).usage.completion_tokens >= 1


def test_openai_client_raises_on_bad_input(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="demo", messages=CHAT, temperature=-0.5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)


def test_503_while_loading_and_api_key(engine):
    loading = ServerState("demo")
    with serving(create_app(loading)) as url:
        assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 503
        response = _post(url, "/chat/completions", {"model": "demo", "messages": CHAT})
        assert response.status_code == 503 and response.json()["error"]["code"] == "model_loading"
        loading.engine = engine  # loaded: the same server answers
        assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200

    with serving(create_app(ServerState("demo", engine), api_key="s3cret")) as url:
        assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200
        assert httpx.get(url + "/models").status_code == 401
        assert httpx.get(url + "/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert _post(url, "/completions", b"{not json").status_code == 401
        with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        with openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0) as good:
            reply = good.chat.completions.create(model="demo", messages=CHAT, max_tokens=3)
            assert reply.usage.completion_tokens >= 1


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads child processes from /proc")
@pytest.mark.parametrize("sig,tp", [(signal.SIGTERM, 2), (signal.SIGINT, 1)], ids=["sigterm-tp2", "ctrl-c"])
def test_a_signal_mid_stream_ends_it_and_leaves_no_process(demo_model_path, tmp_path, sig, tp):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "nvchat").symlink_to(demo_model_path.parent, target_is_directory=True)
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "XDG_CONFIG_HOME": str(tmp_path / "config"),
           "OMP_NUM_THREADS": "1"}
    # With two tensor-parallel ranks over gloo, one worker process, which must go too.
    # A child of a non-interactive shell may start with SIGINT ignored; give it the default back.
    proc = subprocess.Popen([sys.executable, "-m", "nvchat.cli", "serve", "--model", "demo", "--port", "0",
                             "--device", "cpu", "--tp", str(tp), "--max-model-len", "512"],
                            cwd=REPO, env=env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        url = None
        for line in proc.stderr:
            if "ready: serving" in line:
                url = line.rsplit(" at ", 1)[1].strip()
                break
        assert url, "the server never said it was ready"
        workers = _children(proc.pid)
        assert len(workers) >= tp - 1, "expected a tensor-parallel worker process"
        body = {"model": "demo", "prompt": "x", "max_tokens": 400, "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", url + "/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data:"):
                    events.append(line)
                    break
            proc.send_signal(sig)
            events += [line for line in lines if line.startswith("data:")]
        assert proc.wait(timeout=60) == 0
        assert "data: [DONE]" not in events
        last = json.loads(events[-1].removeprefix("data:"))
        assert last["error"]["code"] == "shutting_down"
        assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in workers)
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_reply_cut_off_by_the_engine_stopping_is_a_503_not_a_short_200(demo_model_path):
    """The engine can stop under a request the server did not end (an embedding app shuts it down)."""
    engine = EngineThread(str(demo_model_path), **ENGINE_ARGS).start()
    streams = []
    submit = engine.submit

    def submit_then_stop_the_engine(*args, **kwargs):
        streams.append(submit(*args, **kwargs))
        engine.shutdown()
        return streams[-1]

    engine.submit = submit_then_stop_the_engine
    with serving(create_app(ServerState("demo", engine))) as url:
        body = {"model": "demo", "prompt": "x", "max_tokens": 200, "ignore_eos": True}
        response = httpx.post(url + "/completions", json=body, timeout=60)
    assert streams[0].finish_reason == "abort"
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "shutting_down"
