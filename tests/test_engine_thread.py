"""EngineThread and RequestStream against the real demo model on CPU."""
import asyncio
import gc
import random
import threading
import weakref

import pytest

from engine import LLM, EngineThread, RequestStream, SamplingParams
from engine.core.block_manager import SHARED, USED
from engine.options import CHAT_PREFILL_CHUNK
from engine.text.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(demo_model_path):
    with LLM(demo_model_path, device="cpu", max_model_len=1024, kvcache_block_size=8, num_kvcache_blocks=600) as llm:
        yield llm


@pytest.fixture
def engine(llm):
    with EngineThread(llm) as engine:
        yield engine
    assert not llm.has_unfinished()


def assert_no_blocks_held(engine):
    engine._publish(force=True)
    snap = engine.llm.stats()
    assert snap.num_running == snap.num_waiting == 0
    assert snap.num_free_blocks == snap.num_blocks


def test_stream_deltas_add_up_and_match_generate(engine, llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=5, ignore_eos=True)
    stream = engine.submit("Tell me a story", params)
    deltas = list(stream)
    assert stream.finish_reason == "length" and len(stream.token_ids) == 40
    assert "".join(d.text for d in deltas) == stream.text
    assert [t for d in deltas for t in d.token_ids] == stream.token_ids
    assert stream.text == llm.tokenizer.decode(stream.token_ids, skip_special_tokens=True)
    assert stream.time_to_first_token > 0 and stream.tokens_per_second > 0
    engine.shutdown()  # generate() and the engine thread must not step the LLM at once
    expected = llm.generate(["Tell me a story"], params)[0]
    assert (expected["text"], expected["token_ids"]) == (stream.text, stream.token_ids)


def test_async_iteration(engine):
    async def collect():
        stream = engine.submit("async", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        return stream, [d async for d in stream]
    stream, deltas = asyncio.run(collect())
    assert stream.finish_reason == "length" and "".join(d.text for d in deltas) == stream.text


def test_many_streams_read_on_one_loop_each_get_all_their_text(engine):
    """One step pushes to every stream; their loop is woken once per step for all of them."""
    async def collect():
        streams = [engine.submit(f"prompt {i}", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
                   for i in range(16)]

        async def read(stream):
            return "".join([d.text async for d in stream])
        return streams, await asyncio.gather(*(read(s) for s in streams))
    streams, texts = asyncio.run(collect())
    assert all(s.finish_reason == "length" and len(s.token_ids) == 20 for s in streams)
    assert texts == [s.text for s in streams]


def test_a_push_after_the_readers_loop_closed_is_dropped():
    """A reader that gave up and whose loop then ended must not make the engine thread's next push
    raise (it would take the engine down)."""
    stream = RequestStream(1, 3, abort_fn=lambda s: None)

    async def start_reading_then_leave():
        reading = asyncio.ensure_future(stream.__aiter__().__anext__())
        await asyncio.sleep(0)  # the reader runs until it waits for a delta
        assert stream._async_waiters
        reading.cancel()
    asyncio.run(start_reading_then_leave())
    stream._push("late", [7])
    stream._finish("stop")
    assert stream.text == "late" and stream.finished


def test_a_loop_that_read_streams_is_not_kept_alive_after_it_closes():
    """The table of per-loop wakers must not keep every loop that ever read a stream (an app that runs
    asyncio.run per task, or a test suite, would hold them all)."""
    stream = RequestStream(1, 3, abort_fn=lambda s: None)
    loop = asyncio.new_event_loop()

    async def read():
        return [d.text async for d in stream]

    reading = loop.create_task(read())
    loop.run_until_complete(asyncio.sleep(0))  # the reader waits, registered with its loop's waker
    stream._push("hi", [7])
    stream._finish("stop")
    assert loop.run_until_complete(reading) == ["hi"]
    loop.close()
    gone = weakref.ref(loop)
    del loop, reading
    gc.collect()
    assert gone() is None


def test_concurrent_submissions_from_many_threads(engine):
    streams, errors = [], []
    lock = threading.Lock()

    def client(i):
        try:
            s = engine.submit(f"client {i} says hello", SamplingParams(temperature=0.7, max_tokens=10 + i, seed=i,
                                                                       ignore_eos=True))
            text = "".join(d.text for d in s)
            with lock:
                streams.append((i, s, text))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(streams) == 12
    for i, s, text in streams:
        assert s.finish_reason == "length" and len(s.token_ids) == 10 + i and text == s.text
    assert_no_blocks_held(engine)


def test_aborts_at_random_points_leak_no_blocks(engine):
    rng = random.Random()
    streams = [engine.submit(f"abort me {i} " * rng.randint(1, 30),
                             SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True)) for i in range(8)]
    for s in streams:
        wait_for = rng.randint(0, 20)
        for n, _ in enumerate(s):
            if n >= wait_for:
                break
        s.abort()
    for s in streams:
        assert s.wait(60)
        assert s.finish_reason == "abort" and len(s.token_ids) < 200
    assert_no_blocks_held(engine)
    # The engine keeps serving afterwards.
    after = engine.submit("still there?", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert after.wait(60) and after.finish_reason == "length"


def test_stop_string_split_across_tokens_is_not_emitted(engine, llm):
    free = engine.submit("stop test", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    free.wait(60)
    text = free.text
    assert len(text) > 12
    stop = text[5:9]  # four byte tokens: the stop string always spans several tokens
    stream = engine.submit("stop test", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    deltas = [d.text for d in stream]
    assert stream.finish_reason == "stop"
    assert stream.text == text[:text.index(stop)]
    assert "".join(deltas) == stream.text and stop not in "".join(deltas)


def test_utf8_streams_whole_characters_through_a_byte_level_tokenizer(llm):
    text = "naïve café 🎉🚀 中文字符 ok"
    ids = llm.tokenizer.encode(text)
    assert len(ids) == len(text.encode())  # one token per byte
    detok = IncrementalDetokenizer(llm.tokenizer)
    deltas = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # Emoji and CJK arrive as whole characters only once their last byte is in.
    assert "🎉" in deltas and "中" in deltas


def test_only_a_tail_that_could_begin_a_stop_string_waits(llm):
    """A long stop string holds back only text that could be its start, not its length less one."""
    detok = IncrementalDetokenizer(llm.tokenizer, stop=["\n\nUser:", "END"])
    deltas = [detok.push([t]) for t in llm.tokenizer.encode("Hello there.\n\nUs")]
    assert "".join(deltas) == "Hello there."  # "\n\nUs" may yet become the stop string
    assert deltas[:5] == ["H", "e", "l", "l", "o"]  # no other character waits
    assert detok.push(llm.tokenizer.encode("e")) == ""
    assert detok.push(llm.tokenizer.encode("d")) == "\n\nUsed"  # it did not
    assert detok.push(llm.tokenizer.encode(" E")) == " "
    assert detok.push(llm.tokenizer.encode("ND!")) == "" and detok.stopped
    assert detok.text == "Hello there.\n\nUsed " and detok.flush() == ""


def test_random_bytes_stream_the_same_text_as_one_decode(engine, llm):
    """Hot sampling picks bytes that form broken UTF-8; deltas must still add up exactly."""
    stream = engine.submit("bytes", SamplingParams(temperature=8.0, max_tokens=80, ignore_eos=True, seed=3))
    deltas = [d.text for d in stream]
    assert "".join(deltas) == llm.tokenizer.decode(stream.token_ids, skip_special_tokens=True)


def test_engine_error_ends_every_stream_and_engine_recovers(engine, llm, monkeypatch):
    streams = [engine.submit(f"doomed {i}", SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
               for i in range(3)]
    next(iter(streams[0]))  # generation is under way
    real_execute = llm.runner.execute

    def failing_execute(plan):  # fault injection: the next step's forward pass fails
        monkeypatch.setattr(llm.runner, "execute", real_execute)
        raise RuntimeError("injected GPU fault")

    monkeypatch.setattr(llm.runner, "execute", failing_execute)
    for s in streams:
        assert s.wait(60)
        assert s.finish_reason == "error" and "injected GPU fault" in s.error
    assert_no_blocks_held(engine)
    ok = engine.submit("recovered", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert ok.wait(60) and ok.finish_reason == "length"


def test_bad_requests_raise_in_the_caller(engine):
    with pytest.raises(ValueError, match="too long"):
        engine.submit("x" * 2000)
    with pytest.raises(ValueError, match="temperature"):
        engine.submit("x", SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="chat messages"):
        engine.submit([{"role": "user"}])


def test_second_turn_computes_only_its_new_tokens(engine, llm):
    system = {"role": "system", "content": "You are a test assistant with a fairly long system prompt. " * 3}
    history = [system, {"role": "user", "content": "first question"}]
    first = engine.submit(history, SamplingParams(temperature=0, max_tokens=30))
    first.wait(60)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and a follow-up"}]
    before = llm.stats().prefix_hit_tokens
    second = engine.submit(history, SamplingParams(temperature=0, max_tokens=5))
    second.wait(60)
    hits = llm.stats().prefix_hit_tokens - before
    # All full blocks of turn one (prompt and reply) hit; at most one partial block is recomputed.
    turn_one = first.num_prompt_tokens + len(first.token_ids)
    assert hits == (turn_one - 1) // 8 * 8 or hits == turn_one // 8 * 8
    assert second.num_prompt_tokens - hits < (second.num_prompt_tokens - turn_one) + 8 + 1
    assert second.num_cached_tokens == hits


def test_conversations_sharing_a_system_prompt_compute_it_once(engine, llm):
    system = {"role": "system", "content": "Shared system prompt for every tab, long enough for blocks. " * 4}
    first = engine.submit([system, {"role": "user", "content": "warm"}], SamplingParams(temperature=0, max_tokens=2))
    first.wait(60)
    shared = llm.render_chat([system, {"role": "user", "content": ""}])
    prefix_tokens = len(llm.tokenizer.encode(shared.split("<|im_start|>user")[0]))
    before = llm.stats().prefix_hit_tokens
    streams = [engine.submit([system, {"role": "user", "content": f"tab {i}"}], SamplingParams(temperature=0, max_tokens=3))
               for i in range(5)]
    for s in streams:
        s.wait(60)
    hits = llm.stats().prefix_hit_tokens - before
    assert hits >= 5 * (prefix_tokens // 8 * 8)


def test_stats_snapshot_shows_who_holds_which_block(engine):
    s = engine.submit("hold some blocks " * 10, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    next(iter(s))
    seen = None
    for _ in range(200):
        snap = engine.stats()
        if s.request_id in snap.block_holders:
            seen = snap
            break
        next(iter(s))
    assert seen is not None
    held = seen.block_holders[s.request_id]
    assert held and all(seen.block_states[b] in (USED, SHARED) for b in held)
    assert seen.kv_bytes_used > 0 and seen.num_running >= 1
    next(iter(s))  # a token decoded just now: the rate counts the steps of the last two seconds
    assert engine.stats().decode_tokens_per_s > 0
    s.abort()
    s.wait(30)


def test_shutdown_aborts_open_requests_and_frees_their_blocks(llm):
    engine = EngineThread(llm).start()
    stream = engine.submit("a long one", SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    next(iter(stream))
    engine.shutdown()
    assert stream.finish_reason == "abort"
    stats = llm.stats()
    assert not llm.has_unfinished() and stats.num_free_blocks == stats.num_blocks
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit("again")


@pytest.mark.parametrize("given, expected", [({}, CHAT_PREFILL_CHUNK), ({"max_prefill_chunk": 200}, 200)])
def test_an_engine_built_from_arguments_prefills_in_chat_sized_chunks(demo_model_path, given, expected):
    with EngineThread(demo_model_path, device="cpu", max_model_len=256, **given) as engine:
        assert engine.llm.scheduler.max_prefill_chunk == expected
