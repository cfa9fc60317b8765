"""GGUF files with a SentencePiece tokenizer (`tokenizer.ggml.model = "llama"`: Llama-2, TinyLlama,
Mistral): the engine's tokenizer, chat prompts, greedy tokens and streamed text against HF
transformers' own loading of the same file. The vocabulary (tests/gguf_files.py) spells newlines,
CJK and emoji in byte-fallback tokens and writes spaces as "▁"; its decoder drops the text's first
leading space."""
import random

import pytest

from engine import LLM, EngineThread, SamplingParams
from engine.options import default_cache_dir
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import load_tokenizer
from tests.conftest import random_prompts
from tests.gguf_files import (
    SPM_CHAT_TEMPLATE,
    hf_gguf_greedy,
    tokenizer_tokens,
    write_tiny_gguf,
)

NEW_TOKENS = 16
TEXTS = ["Hello world", " Hello  world", "  the   café\n\nis at 中文 🎉!", "Hello\nworld\n", "\n\n in the",
         "é", "ÀÉ 日本語, you?", "👍🏽 it's", "   ", "[INST] I'm here [/INST]", "<s>the</s> world <unk>"]
CHAT = [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hello world"},
        {"role": "assistant", "content": "Hi! 🎉"}, {"role": "user", "content": " café  中文?\n"}]


@pytest.fixture(scope="module", autouse=True)
def cache_home(tmp_path_factory):
    """GGUF tokenizers are cached under XDG_CACHE_HOME/nvchat: keep the tests' out of the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-spm.gguf", arch="llama", tokenizer="llama")


@pytest.fixture(scope="module")
def hf_tokenizer(spm_gguf):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(spm_gguf.parent, gguf_file=spm_gguf.name)


@pytest.fixture(scope="module")
def engine(spm_gguf):
    with LLM(str(spm_gguf), device="cpu", kvcache_block_size=8, num_kvcache_blocks=64) as llm, \
            EngineThread(llm) as engine:
        yield engine


def test_the_file_holds_a_sentencepiece_vocabulary(hf_tokenizer):
    """What the other tests rest on: HF reads the file as SentencePiece with byte fallback."""
    decoder = str(hf_tokenizer.backend_tokenizer.decoder)
    assert "ByteFallback" in decoder and "Strip" in decoder and "Metaspace" in str(hf_tokenizer.backend_tokenizer.pre_tokenizer)
    assert hf_tokenizer.convert_ids_to_tokens(hf_tokenizer.encode("中 the", add_special_tokens=False)) == \
        ["▁", "<0xE4>", "<0xB8>", "<0xAD>", "▁the"]
    assert hf_tokenizer.encode("the")[0] == hf_tokenizer.bos_token_id == tokenizer_tokens("llama").index("<s>")


def test_encode_and_decode_match_hf(engine, spm_gguf, hf_tokenizer):
    """The tokenizer the engine built, and the copy it cached for later starts, against HF's."""
    llm = engine.llm
    assert llm.eos_ids == {hf_tokenizer.eos_token_id}
    cached = load_tokenizer(spm_gguf)
    assert list((default_cache_dir() / "gguf-tokenizers").iterdir())  # what the LLM's start left there
    rng = random.Random(0)
    for tokenizer in (llm.tokenizer, cached):
        assert tokenizer.chat_template == SPM_CHAT_TEMPLATE
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id)
        for text in TEXTS:
            for special in (True, False):
                ids = hf_tokenizer.encode(text, add_special_tokens=special)
                assert tokenizer.encode(text, add_special_tokens=special) == ids, text
                for skip in (True, False):
                    assert tokenizer.decode(ids, skip_special_tokens=skip) == \
                        hf_tokenizer.decode(ids, skip_special_tokens=skip), (text, skip)
            assert llm.encode(text) == hf_tokenizer.encode(text)
        for _ in range(50):  # any ids: lone and split byte-fallback tokens, control tokens, "▁" runs
            ids = [rng.randrange(len(hf_tokenizer)) for _ in range(rng.randrange(1, 12))]
            assert tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def hf_chat_ids(hf_tokenizer, messages):
    return hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)


def test_chat_prompt_has_the_ids_hf_makes_with_one_bos(engine, hf_tokenizer):
    """The template writes <s> itself; the tokenizer's own BOS must not come on top of it."""
    expected = hf_chat_ids(hf_tokenizer, CHAT)
    assert expected.count(hf_tokenizer.bos_token_id) == 1 and expected[0] == hf_tokenizer.bos_token_id
    llm = engine.llm
    assert llm.render_chat(CHAT) == hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    stream = engine.submit(CHAT, SamplingParams(max_tokens=1))
    assert stream.wait(60) and stream.num_prompt_tokens == len(expected)
    assert engine.tokenize_chat(CHAT) == expected
    assert llm.encode_chat(CHAT) == expected


def test_greedy_matches_hf_on_the_same_gguf(engine, hf_tokenizer, spm_gguf):
    """Token ids, the text of a raw prompt, and chat messages, all greedy against HF's generate()."""
    chat_ids = hf_chat_ids(hf_tokenizer, CHAT)
    prompts = random_prompts([3, 17], vocab=len(hf_tokenizer), seed=7) + [hf_tokenizer.encode(TEXTS[2]), chat_ids]
    expected = hf_gguf_greedy(spm_gguf, prompts, NEW_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    streams = [engine.submit(p, params) for p in prompts[:2]] + [engine.submit(TEXTS[2], params),
                                                                 engine.submit(CHAT, params)]
    for s in streams:
        assert s.wait(60)
    assert [s.token_ids for s in streams] == expected


BAD = "\ufffd"


# Pieces, and the text each push shows, then flush. A run of byte tokens is held until a token of
# another kind ends it: HF's ByteFallback decoder makes the whole run U+FFFD if one byte is bad.
@pytest.mark.parametrize("pieces, shown", [
    (["▁Hello", "▁world"], ["Hello", " world", ""]),  # the first token's space goes, the next one's stays
    (["▁", "<0xE4>", "<0xB8>", "<0xAD>", "▁is", "<0x0A>", "<0x0A>", "▁▁", "▁the"],
     ["", "", "", "", "中 is", "", "", "\n\n  ", " the", ""]),
    (["▁▁", "▁the", "▁", "<0xF0>", "<0x9F>", "<0x8E>", "<0x89>", "!"], [" ", " the", " ", "", "", "", "", "🎉!", ""]),
    (["<0xF0>", "<0x9F>", "<0x91>", "<0x8D>", "<0xF0>", "<0x9F>", "<0x8F>", "<0xBD>", "▁it"],
     ["", "", "", "", "", "", "", "", "👍🏽 it", ""]),
    (["<0xF0>", "<0x9F>", "<0x91>", "<0x8D>", "<0xF0>", "▁it"], ["", "", "", "", "", BAD * 5 + " it", ""]),
    (["<0xE4>", "<0xB8>", "</s>", "<0xAD>", "▁is"], ["", "", "", "", "中 is", ""]),  # skipped: the run goes on
    (["▁Hello", "</s>", "<s>", "▁world", "<unk>", "<0xC3>", "<0xA9>"], ["Hello", "", "", " world", "", "", "", "é"]),
    (["<s>", "▁", "▁", "<0xC3>", "<0xA9>", "l", "<0xE4>", "▁at"], ["", "", " ", "", "", "él", "", BAD + " at", ""]),
    (["▁at", "<0xF0>", "<0x9F>"], ["at", "", "", BAD * 2]),  # cut short mid-character
])
def test_streaming_matches_one_shot_decode(engine, hf_tokenizer, pieces, shown):
    ids = hf_tokenizer.convert_tokens_to_ids(pieces)
    detok = IncrementalDetokenizer(engine.llm.tokenizer)
    assert [detok.push([token]) for token in ids] + [detok.flush()] == shown
    assert "".join(shown) == detok.text == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_a_character_completed_inside_a_run_of_byte_tokens_is_held_until_the_run_ends(engine, hf_tokenizer):
    """F0 9F 91 8D is 👍, but the F0 after it is a bad byte of the same run: HF decodes the run as
    five U+FFFD. Shown at once, 👍 could never be taken back, and the text would not be the
    tokens' text."""
    ids = hf_tokenizer.convert_tokens_to_ids(["▁a", "<0xF0>", "<0x9F>", "<0x91>", "<0x8D>", "<0xF0>", "▁it"])
    assert hf_tokenizer.decode(ids[:5]) == "a👍" and hf_tokenizer.decode(ids) == "a" + BAD * 5 + " it"
    detok = IncrementalDetokenizer(engine.llm.tokenizer)
    streamed = "".join(detok.push([token]) for token in ids) + detok.flush()
    assert streamed == detok.text == "a" + BAD * 5 + " it"


def test_a_stop_string_in_a_held_run_stops_at_the_token_that_completes_it(engine, hf_tokenizer):
    ids = hf_tokenizer.convert_tokens_to_ids(["▁a", "<0xE4>", "<0xB8>", "<0xAD>", "▁is"])
    detok = IncrementalDetokenizer(engine.llm.tokenizer, stop=["中"])
    assert [detok.push([token]) for token in ids[:3]] == ["a", "", ""] and not detok.stopped
    assert detok.push([ids[3]]) == "" and detok.stopped and detok.text == "a"
    assert detok.flush() == ""


def test_engine_streams_the_one_shot_text(engine, hf_tokenizer):
    """Seeded sampling on random weights makes runs of byte-fallback tokens, split characters and
    bad bytes among them; the deltas join to HF's decode of the tokens, and each is what the
    one-shot decode shows for good once the tokens before it are known."""
    streams = [engine.submit(CHAT, SamplingParams(temperature=1.0, seed=seed, max_tokens=24)) for seed in range(6)]
    runs = 0
    for stream in streams:
        deltas = list(stream)
        ids = stream.token_ids
        text = hf_tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(d.text for d in deltas) == stream.text == text
        shown, count = "", 0
        for delta in deltas:
            shown, count = shown + delta.text, count + len(delta.token_ids)
            # Whatever tokens come next, the text starts with what was shown.
            for k in range(count, len(ids) + 1):
                assert hf_tokenizer.decode(ids[:k], skip_special_tokens=True).startswith(shown)
        runs += any(0x80 <= t - 3 < 0x100 for t in ids)
    assert runs, "no run had a byte-fallback token past ASCII"

